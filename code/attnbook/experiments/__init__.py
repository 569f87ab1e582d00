"""Experiments: code that exists to produce one chapter's numbers and figures.

The rest of :mod:`attnbook` is the library: the mechanisms the chapters derive,
the models built from them, and the tools that measure them. A module here may
import the library; the library never imports a module here
(``tests/test_chapter_map.py`` checks it), so an experiment can be rewritten
for its chapter without touching what other chapters build on. Every chapter
with an experiment of its own has a module here, whose docstring names it.
"""
