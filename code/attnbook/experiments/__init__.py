"""Experiments: code that exists to produce one chapter's numbers and figures.

The rest of :mod:`attnbook` is the library: the mechanisms the chapters derive, the models
built from them, and the tools that measure them. A module here may import the library;
the library never imports a module here (``tests/test_chapter_map.py`` checks it), so an
experiment can be rewritten for its chapter without touching what other chapters build on.
Each module's docstring names its chapter.
"""
