"""One figure style for the whole book.

Every chapter calls :func:`use_book_style` in its setup cell and draws with the
helpers below, so figures share sizes, fonts and colours.

Every chapter draws its figures with it; no chapter shows it.
"""
from __future__ import annotations

import matplotlib as mpl
import matplotlib.pyplot as plt
import numpy as np

#: The book's colour cycle (colour-blind safe, after Okabe and Ito).
COLORS = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#F0E442", "#000000"]

_STYLE = {
    "figure.figsize": (6.4, 3.6),
    "figure.dpi": 100,
    "savefig.dpi": 100,
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.prop_cycle": mpl.cycler(color=COLORS),
    "legend.frameon": False,
    "image.cmap": "viridis",
    "figure.constrained_layout.use": True,
    "svg.hashsalt": "attnbook",  # reproducible SVG ids
}


def use_book_style() -> None:
    """Apply the book's matplotlib style to every later figure."""
    mpl.rcParams.update(_STYLE)


def figure(ncols: int = 1, nrows: int = 1, width: float = 6.4, height: float = 3.6, **kwargs):
    """A new figure in the book's style; returns ``(fig, axes)`` like ``plt.subplots``."""
    with mpl.rc_context(_STYLE):
        return plt.subplots(nrows, ncols, figsize=(width, height), **kwargs)


def heatmap(ax, matrix, row_labels=None, col_labels=None, title=None, annotate=None,
            cmap="viridis", vmin=None, vmax=None, colorbar=True, fmt="{:.2f}"):
    """Draw a matrix (e.g. attention weights, rows = queries) with optional labels.

    matrix: (n_rows, n_cols). ``annotate`` writes each value in its cell; by
    default only for matrices of at most 12 x 12.
    """
    matrix = np.asarray(matrix, dtype=float)
    im = ax.imshow(matrix, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
    ax.grid(False)
    if row_labels is not None:
        ax.set_yticks(range(len(row_labels)), labels=row_labels)
    if col_labels is not None:
        ax.set_xticks(range(len(col_labels)), labels=col_labels, rotation=45, ha="right")
    if title:
        ax.set_title(title)
    if annotate is None:
        annotate = max(matrix.shape) <= 12
    if annotate:
        for (i, j), value in np.ndenumerate(matrix):
            r, g, b, _ = im.cmap(im.norm(value))
            # dark text on light cells and vice versa, for any colour map (diverging ones too)
            colour = "white" if 0.299 * r + 0.587 * g + 0.114 * b < 0.5 else "black"
            ax.text(j, i, fmt.format(value), ha="center", va="center", fontsize=8, color=colour)
    if colorbar:
        ax.figure.colorbar(im, ax=ax, shrink=0.8)
    return im


def loglog_fit(x, y) -> tuple[float, float]:
    """Least-squares slope and intercept of ``log y`` against ``log x``: the measured exponent."""
    slope, intercept = np.polyfit(np.log(np.asarray(x, float)), np.log(np.asarray(y, float)), 1)
    return float(slope), float(intercept)
