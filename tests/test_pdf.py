"""The PDF of the book (`make pdf`) builds, is whole, and prints what the HTML
shows.

One build, to a temporary folder (so that it never disturbs `make pdf`'s
_build), serves every test. It needs Debian's TeX packages; without them the
tests fail with the apt-get line to run (CI installs them in .ci/run), they are
not skipped.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
JUPYTER_BOOK = Path(sys.executable).with_name("jupyter-book")
TARGET = "attention-derived"
APT = (
    "apt-get install texlive-latex-recommended texlive-latex-extra "
    "texlive-fonts-recommended "
    "texlive-xetex latexmk texlive-plain-generic fonts-freefont-otf"
)
# The whole book has been 320 to 400 pages, about 560 once its code was
# formatted at 79 characters (shorter lines, more of them, printed at \small
# instead of shrunk to fit), and 753 with its seventeen chapters (session 9);
# a chapter is 25 to 60. Far outside this range, a chapter is missing or a
# cell prints pages it should not.
PAGES = range(600, 900)


def missing_tex() -> list[str]:
    missing = [
        tool
        for tool in ("xelatex", "latexmk", "kpsewhich")
        if shutil.which(tool) is None
    ]
    if not missing:
        # latex-extra
        for sty in (
            "fncychap.sty",
            "tabulary.sty",
            "capt-of.sty",
            "needspace.sty",
        ):
            if (
                subprocess.run(
                    ["kpsewhich", sty], capture_output=True
                ).returncode
                != 0
            ):
                missing.append(sty)
    if not list(Path("/usr/share/fonts").rglob("FreeSerif.otf")):
        missing.append("the FreeSerif font (fonts-freefont-otf)")
    return missing


@pytest.fixture(scope="session")
def latex(tmp_path_factory):
    missing = missing_tex()
    if missing:
        pytest.fail(
            f"TeX for the PDF is missing ({', '.join(missing)}): {APT}"
        )
    out = tmp_path_factory.mktemp("pdf")
    proc = subprocess.run(
        [
            str(JUPYTER_BOOK),
            "build",
            "--builder",
            "pdflatex",
            "--warningiserror",
            "--nitpick",
            "--keep-going",
            "--path-output",
            str(out),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    folder = out / "_build" / "latex"
    if proc.returncode != 0 or not (folder / f"{TARGET}.pdf").exists():
        pytest.fail(
            "the PDF did not "
            f"build:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return proc, folder


@pytest.fixture(scope="session")
def tex(latex):
    return (latex[1] / f"{TARGET}.tex").read_text()


def chapters() -> list[Path]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [
        chapter["file"]
        for part in toc["parts"]
        for chapter in part["chapters"]
    ]
    return [
        ROOT / f"{f}.ipynb" for f in files if (ROOT / f"{f}.ipynb").exists()
    ]


def cells(tagged: str, in_solutions: bool):
    """Code cells with the tag, inside or outside a chapter's Solutions
    section."""
    for path in chapters():
        section = ""
        for cell in json.loads(path.read_text())["cells"]:
            source = "".join(cell["source"])
            if cell["cell_type"] == "markdown":
                headings = re.findall(r"^## (.*)$", source, re.M)
                section = headings[-1] if headings else section
            elif (
                tagged in cell["metadata"].get("tags", [])
                and section.startswith("Solutions") == in_solutions
            ):
                yield path.name, source


# Pygments' LaTeX escapes, undone, so that printed code can be compared with
# the notebooks' code.
_ESCAPES = {
    "bs": "\\",
    "ob": "\0",
    "cb": "\1",
    "ca": "^",
    "am": "&",
    "lt": "<",
    "gt": ">",
    "sh": "#",
    "pc": "%",
    "dl": "$",
    "hy": "-",
    "sq": "'",
    "dq": '"',
    "ti": "~",
    "us": "_",
    "at": "@",
    "lb": "[",
    "rb": "]",
    "Zbs": "\\",
}


def plain_code(tex: str) -> str:
    text = re.sub(
        r"\\PYGZ(\w\w)\{\}",
        lambda m: _ESCAPES.get(m.group(1), m.group(0)),
        tex,
    )
    while True:
        unwrapped = re.sub(r"\\PYG\{[^{}]*\}\{([^{}]*)\}", r"\1", text)
        if unwrapped == text:
            break
        text = unwrapped
    return text.replace("\0", "{").replace("\1", "}")


def test_pdf_builds_with_no_warnings(latex):
    proc, folder = latex
    log = proc.stdout + proc.stderr
    warnings = [
        line for line in log.splitlines() if re.search(r"WARNING|ERROR", line)
    ]
    assert not warnings, "\n".join(warnings)
    assert (folder / f"{TARGET}.pdf").stat().st_size > 1_000_000


def test_page_count_and_references(latex):
    log = (latex[1] / f"{TARGET}.log").read_text(errors="replace")
    pages = re.findall(rf"Output written on {TARGET}\.pdf \((\d+) pages?", log)
    assert pages, "the LaTeX log names no output"
    assert int(pages[-1]) in PAGES, f"{pages[-1]} pages, outside {PAGES}"
    # the log of the last LaTeX run: references and citations left undefined
    # are named there
    undefined = re.findall(
        r"LaTeX Warning: (?:Reference|Citation|Hyper reference) .* "
        r"undefined.*",
        log,
    )
    undefined += re.findall(
        r"There were undefined (?:references|citations)", log
    )
    assert not undefined, "\n".join(undefined[:20])


def test_every_character_has_a_glyph(latex):
    """xelatex prints a character its font lacks as nothing, and only says so
    in its log."""
    log = (latex[1] / f"{TARGET}.log").read_text(errors="replace")
    missing = sorted(
        set(re.findall(r"Missing character: There is no (.*?) in font", log))
    )
    assert not missing, (
        "characters the PDF prints as nothing (add them to "
        f"book_latex.SUBSTITUTES): {missing}"
    )


# A box TeX cannot break that is taller than what is left of its page runs
# into the page's foot. Sphinx used to frame a code block inside an exercise or
# a solution in such a box (book_latex, item 7, sets them unframed now: they
# overflowed by 15 to 97 pt). The footer's rule sits about 30 pt below the end
# of the text block (measured on a rendered page), so an overflow of up to
# OVERFLOW_PT leaves a clear gap; the book's overflows are at most 4 pt.
OVERFLOW_PT = 12


def test_no_page_runs_into_its_footer(latex, tex):
    """An overfull page of more than OVERFLOW_PT prints its last lines over the
    page's footer."""
    log = (latex[1] / f"{TARGET}.log").read_text(errors="replace")
    lines = tex.splitlines()
    overflows = []
    for points, line in re.findall(
        r"Overfull \\vbox \(([\d.]+)pt too high\) detected at line (\d+)", log
    ):
        if float(points) > OVERFLOW_PT:
            boxes = re.findall(
                r"\\begin\{sphinxadmonition\}\{\w+\}\{(.*)\}",
                "\n".join(lines[: int(line)]),
            )
            where = boxes[-1] if boxes else "?"
            overflows.append(
                f"{points} pt at line {line} of {TARGET}.tex, in the box "
                f"'{where}'"
            )
    assert not overflows, (
        "pages whose last lines run into the footer (split the long code cell "
        "there "
        "in two, so that TeX can put the second part on the next page):\n"
        + "\n".join(overflows)
    )


def test_every_chapter_is_in_the_pdf(tex):
    for path in chapters():
        title = re.search(
            r"^# (.+)$",
            "".join(json.loads(path.read_text())["cells"][0]["source"]),
            re.M,
        )
        label = re.escape(path.stem)
        assert re.search(
            rf"\\chapter\{{.*\}}\s*\\label\{{\\detokenize\{{book/{label}:", tex
        ), (
            f"{path.name} ({title.group(1) if title else '?'}) has no chapter "
            "in the PDF"
        )


def test_proofs_print_as_proofs(tex):
    """sphinx-proof's untitled box (an empty title bar) becomes "Proof." in
    italics, ended by a square."""
    sources = [p.read_text() for p in chapters()] + [
        p.read_text() for p in (ROOT / "book").glob("*.md")
    ]
    proofs = sum(len(re.findall(r"\{prf:proof\}", s)) for s in sources)
    assert proofs > 0
    assert tex.count(r"\sphinxstyleemphasis{Proof.}") == proofs
    assert tex.count(r"\hfill\ensuremath{\square}") == proofs
    untitled = re.findall(r"\\begin\{sphinxadmonition\}\{note\}(?!\{)", tex)
    assert not untitled, f"{len(untitled)} boxes with an empty title bar"


def test_solutions_print_their_code(tex):
    """The solutions say "the code is in the cell below": the PDF prints it,
    although the HTML folds it."""
    code = plain_code(tex)
    hidden = list(cells("hide-input", in_solutions=True))
    assert hidden, (
        "no folded solution cell left: this test (and book_latex's fix) can go"
    )
    for name, source in hidden:
        assert source.strip() in code, (
            f"{name}: solution code not printed: {source[:200]!r}"
        )
    # elsewhere, hide-input hides plotting code, in the PDF as in the HTML
    for name, source in cells("hide-input", in_solutions=False):
        assert source.strip() not in code, (
            f"{name}: hidden cell printed: {source[:200]!r}"
        )


def test_exercise_stubs_print_short_errors(tex):
    """A stub's NotImplementedError prints the checker's message, not pages of
    traceback."""
    stubs = tex.split(r"\begin{sphinxuseclass}{tag_raises-exception}")[1:]
    assert len(stubs) == len(
        list(cells("raises-exception", in_solutions=False))
    )
    for stub in stubs:
        output = stub.split(r"\begin{sphinxuseclass}{cell_output}", 1)[
            1
        ].split(r"\end{sphinxVerbatim}", 1)[0]
        lines = output.strip().splitlines()[1:]  # after \begin{sphinxVerbatim}
        assert len(lines) <= 8, plain_code("\n".join(lines[:12]))
    assert "Traceback (most recent call last)" not in plain_code(tex)


def test_code_in_boxes_is_set_breakable():
    """book_latex's patch of Sphinx's sphinxVerbatim finds the test it replaces
    in the installed Sphinx (no build needed): a Sphinx that changed the macro
    would stop the PDF build with an error, not overflow the footers again."""
    sys.path.insert(0, str(ROOT / "book" / "_ext"))
    import book_latex
    import sphinx

    sty = (
        Path(sphinx.__file__).parent / "texinputs" / "sphinxlatexliterals.sty"
    ).read_text()
    searched = re.search(
        r"\\patchcmd\{\\endsphinxVerbatim\}\{(.*?)\}\{",
        book_latex.NESTED_VERBATIM_PATCH,
    ).group(1)
    assert sty.count(searched) == 1, searched


def test_the_book_links_to_the_published_pdf():
    """The introduction's link, the PDF's name and the Pages workflow agree (no
    build needed)."""
    sys.path.insert(0, str(ROOT / "book" / "_ext"))
    import book_latex

    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert config["latex"]["latex_documents"]["targetname"] == f"{TARGET}.tex"
    assert book_latex.PDF_NAME == f"{TARGET}.pdf"
    owner, repo = (
        config["repository"]["url"]
        .removeprefix("https://github.com/")
        .strip("/")
        .split("/")
    )
    assert (
        book_latex.published_pdf_url(config["repository"]["url"])
        == f"https://{owner.lower()}.github.io/{repo}/{TARGET}.pdf"
    )  # GitHub Pages' address of the site root
    assert "{{ pdf_link }}" in (ROOT / "book" / "intro.md").read_text()
    steps = yaml.safe_load(
        (ROOT / ".github" / "workflows" / "publish.yml").read_text()
    )["jobs"]["build"]["steps"]
    runs = [step.get("run", "") for step in steps]
    upload = next(
        i
        for i, step in enumerate(steps)
        if "upload-pages-artifact" in step.get("uses", "")
    )
    assert steps[upload]["with"]["path"] == "_build/html"
    pdf = next(i for i, run in enumerate(runs) if "make pdf" in run)
    copy = next(
        i
        for i, run in enumerate(runs)
        if f"_build/latex/{TARGET}.pdf _build/html/{TARGET}.pdf" in run
    )
    assert pdf < copy < upload
