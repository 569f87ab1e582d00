"""Serve MathJax from the built book instead of a CDN.

The book must render its mathematics with no network (CI checks the built
pages in a headless browser on a machine that reaches only package
registries). The ``django-static-mathjax`` wheel ships MathJax 3 as plain files
(it needs no Django); this extension copies its self-contained SVG build into
``_static`` and points Sphinx at it.
"""
from __future__ import annotations

import shutil
from pathlib import Path

_TARGET = "mathjax/tex-svg.js"


def _source() -> Path:
    import mathjax  # the django-static-mathjax distribution's package

    path = Path(mathjax.__file__).parent / "static" / "mathjax" / "es5" / "tex-svg.js"
    if not path.exists():
        raise FileNotFoundError(f"MathJax not found at {path}; is django-static-mathjax installed?")
    return path


def _copy(app, exception) -> None:
    if exception is None and app.builder.format == "html":
        target = Path(app.outdir) / "_static" / _TARGET
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_source(), target)


def setup(app):
    _source()  # fail the build early, with a clear message, if MathJax is missing
    app.config.mathjax_path = _TARGET
    app.connect("build-finished", _copy)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
