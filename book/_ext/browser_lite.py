"""The "Run in your browser" site, built with the book, and the launch-menu
entries that open it.

After an HTML build, ``scripts/build_lite.py`` writes JupyterLite with its
Pyodide kernel, a verified Pyodide 0.27.7 and attnbook's wheel to ``lite/`` in
the output folder, with the chapters that run in the browser (numpy
throughout). Each of those chapters' launch menu (the rocket) gets "Run in your
browser", which opens the chapter there; every other chapter's menu says that
it needs PyTorch, which does not run in the browser, and links to Colab
instead, and, where some of its exercises are checked by numpy alone, gets
"Exercises in your browser", a notebook of those exercises in the site. A
failure of the site's build (a file that does not match its pinned digest,
above all) fails the book's build.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _build_lite_module():
    spec = importlib.util.spec_from_file_location(
        "build_lite", ROOT / "scripts" / "build_lite.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BUILD_LITE = _build_lite_module()
SITE = "lite"


@functools.lru_cache(maxsize=None)
def _exercise_chapters() -> frozenset[str]:
    """The chapters that need PyTorch but have exercises numpy alone checks
    (their notebooks are in the site)."""
    return frozenset(BUILD_LITE.exercise_notebooks())


def _build_site(app, exception) -> None:
    if exception is None and app.builder.format == "html":
        BUILD_LITE.build(Path(app.outdir) / SITE)


def _launch_entry(app, pagename, templatename, context, doctree) -> None:
    """Add the browser's entry to a chapter's launch menu (after the theme has
    made the menu)."""
    name = pagename.rsplit("/", 1)[-1]
    if not (
        pagename.startswith("book/") and (ROOT / f"{pagename}.ipynb").exists()
    ):
        return
    group = next(
        (
            b
            for b in context.get("header_buttons", [])
            if b.get("label") == "launch-buttons"
        ),
        None,
    )
    if group is None:
        return
    lite_index = context["pathto"](SITE + "/notebooks/index.html", 1)
    if name in BUILD_LITE.BROWSER_CHAPTERS:
        group["buttons"].append(
            {
                "type": "link",
                "text": "Run in your browser",
                "tooltip": "Open this chapter in JupyterLite: Python runs "
                "inside the page (no install, no account); "
                "the few cells that need PyTorch say so",
                "icon": "_static/images/logo_jupyterlite.svg",
                "url": f"{lite_index}?path={name}.ipynb",
                "label": "launch-browser-button",
            }
        )
    else:
        if name in _exercise_chapters():
            group["buttons"].append(
                {
                    "type": "link",
                    "text": "Exercises in your browser",
                    "tooltip": "The chapter needs PyTorch; its exercises that "
                    "numpy alone checks run in JupyterLite, "
                    "inside the page (no install, no account)",
                    "icon": "_static/images/logo_jupyterlite.svg",
                    "url": f"{lite_index}?path={name}-exercises.ipynb",
                    "label": "launch-browser-exercises-button",
                }
            )
        colab = next(
            (b["url"] for b in group["buttons"] if b.get("text") == "Colab"),
            None,
        )
        if colab:
            group["buttons"].append(
                {
                    "type": "link",
                    "text": "Browser: needs PyTorch, use Colab",
                    "tooltip": "This chapter needs PyTorch, which does not "
                    "run in the browser (Pyodide): open it on "
                    "Colab",
                    "icon": "_static/images/logo_colab.png",
                    "url": colab,
                    "label": "launch-browser-button",
                }
            )


def setup(app):
    app.connect("build-finished", _build_site)
    app.connect(
        "html-page-context", _launch_entry, priority=502
    )  # the theme makes its menu at 501
    return {"parallel_read_safe": True, "parallel_write_safe": True}
