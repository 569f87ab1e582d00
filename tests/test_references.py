"""The bibliography parses and holds each key once (without a book build: a
merge that drops a brace otherwise shows only when the book or the PDF is
built)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIB = ROOT / "book" / "references.bib"


def test_the_bibliography_parses():
    pybtex = __import__("pytest").importorskip("pybtex.database")
    entries = pybtex.parse_file(str(BIB)).entries
    keys = re.findall(r"^@\w+\{([^,\s]+),", BIB.read_text(), re.M)
    assert len(entries) == len(keys)


def test_every_key_is_defined_once():
    keys = re.findall(r"^@\w+\{([^,\s]+),", BIB.read_text(), re.M)
    assert keys, "no entry found"
    twice = [key for key, count in Counter(keys).items() if count > 1]
    assert not twice, twice


def test_every_entry_closes_before_the_next_opens():
    # an entry's last line is a lone "}" before the next "@" line
    text = BIB.read_text()
    chunks = re.split(r"^(?=@\w+\{)", text, flags=re.M)[1:]
    unclosed = [
        re.match(r"@\w+\{([^,\s]+),", chunk)[1]
        for chunk in chunks
        if not chunk.rstrip().endswith("}")
        or chunk.count("{") != chunk.count("}")
    ]
    assert not unclosed, unclosed
