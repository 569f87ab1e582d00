"""The book builds with no warning, its internal links resolve, and a real
browser renders it.

The build goes to a temporary folder so that the test never disturbs `make
book`'s _build.
"""

from __future__ import annotations

import functools
import http.server
import re
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import yaml
from bs4 import BeautifulSoup

ROOT = Path(__file__).resolve().parents[1]
JUPYTER_BOOK = Path(sys.executable).with_name("jupyter-book")


def toc_pages() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    pages = [toc["root"]]
    for part in toc.get("parts", []):
        pages += [chapter["file"] for chapter in part["chapters"]]
    return pages


@pytest.fixture(scope="session")
def build(tmp_path_factory):
    out = tmp_path_factory.mktemp("book")
    proc = subprocess.run(
        [
            str(JUPYTER_BOOK),
            "build",
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
    return proc, out / "_build" / "html"


@pytest.fixture(scope="session")
def html(build):
    proc, site = build
    if proc.returncode != 0:
        pytest.fail(
            "the book did not "
            f"build:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return site


def test_book_builds_with_no_warnings(build):
    proc, site = build
    log = proc.stdout + proc.stderr
    warnings = [
        line for line in log.splitlines() if re.search(r"WARNING|ERROR", line)
    ]
    assert proc.returncode == 0 and not warnings, (
        "\n".join(warnings) or log[-4000:]
    )
    for page in toc_pages():
        assert (site / f"{page}.html").exists(), page


def test_internal_links_resolve(html):
    problems = []
    pages = [p for p in html.rglob("*.html") if "_static" not in p.parts]
    ids = {}
    for page in pages:
        soup = BeautifulSoup(page.read_text(), "html.parser")
        ids[page] = {tag["id"] for tag in soup.find_all(id=True)}
    for page in pages:
        soup = BeautifulSoup(page.read_text(), "html.parser")
        for tag in soup.find_all(["a", "img", "link", "script"]):
            url = tag.get("href") or tag.get("src")
            if (
                not url
                or re.match(r"^[a-z][a-z0-9+.-]*:", url)
                or url.startswith("//")
            ):
                continue  # external (checked by readers, not by an offline CI)
            parts = urlsplit(url)
            target = (
                page
                if not parts.path
                else (page.parent / unquote(parts.path)).resolve()
            )
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                problems.append(
                    f"{page.relative_to(html)}: {url} (no such file)"
                )
            elif (
                parts.fragment
                and target.suffix == ".html"
                and target in ids
                and unquote(parts.fragment) not in ids[target]
            ):
                problems.append(
                    f"{page.relative_to(html)}: {url} (no such anchor)"
                )
    assert not problems, "\n".join(problems[:50])


def test_every_chapter_offers_colab_and_download(html):
    url = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"][
        "url"
    ]
    slug = url.split("github.com/")[1]
    for page in toc_pages():
        if not (ROOT / f"{page}.ipynb").exists():
            continue
        text = (html / f"{page}.html").read_text()
        assert (
            f"colab.research.google.com/github/{slug}/blob/main/{page}.ipynb"
            in text
        ), page
        assert f"_sources/{page}.ipynb" in text, (
            f"{page}: no notebook download link"
        )


def test_launch_menus_open_the_browser_site_where_it_runs(html):
    """ "Run in your browser" on the chapters that run there, "Exercises in your browser" on the torch
    chapters whose exercises do, and each points to a notebook that the built
    site holds."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "build_lite", ROOT / "scripts" / "build_lite.py"
    )
    build_lite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_lite)
    exercises = build_lite.exercise_notebooks()
    for page in toc_pages():
        if not (ROOT / f"{page}.ipynb").exists():
            continue
        name = page.rsplit("/", 1)[-1]
        links = {
            a.get_text(strip=True): a["href"]
            for a in BeautifulSoup(
                (html / f"{page}.html").read_text(), "html.parser"
            ).find_all("a", href=True)
        }
        wanted = (
            {"Run in your browser": name}
            if name in build_lite.BROWSER_CHAPTERS
            else {}
        )
        if name in exercises:
            wanted["Exercises in your browser"] = f"{name}-exercises"
        assert ("Browser: needs PyTorch, use Colab" in links) == (
            name not in build_lite.BROWSER_CHAPTERS
        ), page
        for text, notebook in wanted.items():
            assert links.get(text, "").endswith(
                f"lite/notebooks/index.html?path={notebook}.ipynb"
            ), (page, text)
            assert (html / "lite" / "files" / f"{notebook}.ipynb").exists(), (
                notebook
            )
        assert "Exercises in your browser" in links or name not in exercises, (
            page
        )


# --- the headless browser --------------------------------------------------


@pytest.fixture(scope="session")
def server(html):
    handler = functools.partial(QuietHandler, directory=str(html))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.mark.parametrize("page", toc_pages())
def test_page_renders_in_a_browser(browser, server, page):
    tab = browser.new_page()
    errors = []
    tab.on(
        "console",
        lambda msg: (
            errors.append(f"console: {msg.text} ({msg.location.get('url')})")
            if msg.type == "error"
            else None
        ),
    )
    tab.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))
    tab.on(
        "requestfailed",
        lambda req: (
            errors.append(f"failed request: {req.url}")
            if req.url.startswith(server)
            else None
        ),
    )
    tab.on(
        "response",
        lambda resp: (
            errors.append(f"HTTP {resp.status}: {resp.url}")
            if resp.status >= 400
            else None
        ),
    )
    tab.goto(f"{server}/{page}.html", wait_until="load")
    # Sphinx loads MathJax only on pages with math
    if tab.query_selector('script[src*="mathjax"]'):
        tab.wait_for_function(
            "() => window.MathJax && MathJax.startup && "
            "MathJax.startup.promise",
            timeout=30_000,
        )
        tab.evaluate("() => MathJax.startup.promise")
    report = tab.evaluate("""() => {
        const math = [...document.querySelectorAll('.math')];
        return {
            math: math.length,
            unrendered: math.filter(m => !m.querySelector('mjx-container')).map(m => m.textContent.slice(0, 80)),
            texErrors: [...document.querySelectorAll('mjx-merror')].map(e => e.textContent.slice(0, 80)),
            rawDollars: [...document.querySelectorAll('article p, article li, article td')]
                .filter(e => !e.closest('pre, code, .cell_output') && /\\$[^$\\s][^$]*\\$/.test(e.textContent)
                             && !e.querySelector('mjx-container'))
                .map(e => e.textContent.slice(0, 80)),
            images: [...document.images].map(i => ({src: i.src, ok: i.complete && i.naturalWidth > 0})),
        };
    }""")
    tab.close()
    assert not errors, errors
    assert not report["unrendered"], (
        f"math left unrendered: {report['unrendered']}"
    )
    assert not report["texErrors"], f"TeX errors: {report['texErrors']}"
    assert not report["rawDollars"], (
        f"raw $...$ left in the text: {report['rawDollars']}"
    )
    broken = [i["src"] for i in report["images"] if not i["ok"]]
    assert not broken, f"images that did not load: {broken}"
    if page == "book/intro":
        assert report["math"] > 0, (
            "the introduction's formula should have been found"
        )


# The code a page shows: its cells' sources and the package source that
# show_source displays, not the text that cells print.
SHOWN_CODE = """() => [
    ...document.querySelectorAll('article div.highlight pre')]
    .filter(p => !p.closest(
        '.output.stream, .output.text_plain, .output.stderr, '
        + '.output.traceback, .output.error'))
    .filter(p => p.scrollWidth > p.clientWidth + 1)
    .map(p => p.textContent.split('\\n')
        .reduce((a, b) => (a.length >= b.length ? a : b)))"""


@pytest.mark.parametrize("page", toc_pages())
def test_no_shown_code_scrolls_sideways(browser, server, page):
    """At a 1280-pixel window every line of shown code fits its block: the
    line length of pyproject.toml against the font size of book.css."""
    tab = browser.new_page(viewport={"width": 1280, "height": 800})
    tab.goto(f"{server}/{page}.html", wait_until="load")
    too_wide = tab.evaluate(SHOWN_CODE)
    tab.close()
    assert not too_wide, (
        f"{len(too_wide)} code blocks scroll sideways; their longest lines:\n"
        + "\n".join(too_wide)
    )
