r"""Small fixes to the HTML the book's theme produces.

1. Serve MathJax from the built book instead of a CDN. The book must render its
   mathematics with no network (CI checks the built pages in a headless browser
   on a machine that reaches only package registries). The
   ``django-static-mathjax`` wheel ships MathJax 3 as plain files (it needs no
   Django); its self-contained SVG build is copied into ``_static``.
2. Drop scripts registered twice. Jupyter Book loads sphinx-thebe, whose inline
   configuration script ends up on the page twice and throws
   "Identifier 'THEBE_JS_URL' has already been declared" in the console.
3. Load MathJax on every page. Sphinx loads it only on pages whose body has
   math, but chapter titles with math ("Why divide by $\sqrt{d_k}$") appear in
   every page's navigation, and stayed raw TeX on pages without math.
4. Give the theme a default colour mode ("auto", the reader's system setting):
   without one, pydata-sphinx-theme logs "Got invalid theme mode" as an error.
5. Build the "Run in your browser" site with the book, and link chapters to it
   (``browser_lite``).
6. Size code so that a line of the book's line length fits the page
   (``static/book.css``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

_MATHJAX = "mathjax/tex-svg.js"


def _mathjax_source() -> Path:
    import mathjax  # the django-static-mathjax distribution's package

    path = (
        Path(mathjax.__file__).parent
        / "static"
        / "mathjax"
        / "es5"
        / "tex-svg.js"
    )
    if not path.exists():
        raise FileNotFoundError(
            f"MathJax not found at {path}; is django-static-mathjax installed?"
        )
    return path


def _copy_mathjax(app, exception) -> None:
    if exception is None and app.builder.format == "html":
        target = Path(app.outdir) / "_static" / _MATHJAX
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_mathjax_source(), target)


def _page_context(app, pagename, templatename, context, doctree) -> None:
    scripts, seen = [], set()
    for script in context.get("script_files", []):
        # sphinx-thebe's twin differs only in filename: None once, "" the other
        # time
        key = (
            getattr(script, "filename", script) or "",
            repr(sorted(getattr(script, "attributes", {}).items())),
        )
        if key not in seen:
            seen.add(key)
            scripts.append(script)
    context["script_files"] = scripts
    context.setdefault("default_mode", "auto")


def _every_page_has_math(app, env) -> None:
    equations = env.get_domain("math").data["has_equations"]
    for docname in env.found_docs:
        equations[docname] = True


def _add_static(app) -> None:
    app.config.html_static_path.append(str(Path(__file__).parent / "static"))


def setup(app):
    # fail the build early, with a clear message, if MathJax is missing
    _mathjax_source()
    app.config.mathjax_path = _MATHJAX
    app.connect("build-finished", _copy_mathjax)
    app.connect("html-page-context", _page_context)
    app.connect("env-updated", _every_page_has_math)
    app.connect("builder-inited", _add_static)
    app.add_css_file("book.css")
    app.setup_extension("browser_lite")
    return {"parallel_read_safe": True, "parallel_write_safe": True}
