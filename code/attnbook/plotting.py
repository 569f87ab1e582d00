"""One figure style for the whole book.

Every chapter calls :func:`use_book_style` in its setup cell and draws with the
helpers below, so figures share sizes, fonts and colours.

Every chapter draws its figures with it; no chapter shows it.
"""

from __future__ import annotations

import matplotlib as mpl
import matplotlib.pyplot as plt
import numpy as np

from ._validate import int_in_range

#: The book's colour cycle (colour-blind safe, after Okabe and Ito).
COLORS = [
    "#0072B2",
    "#D55E00",
    "#009E73",
    "#CC79A7",
    "#E69F00",
    "#56B4E9",
    "#F0E442",
    "#000000",
]

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


def figure(
    ncols: int = 1,
    nrows: int = 1,
    width: float = 6.4,
    height: float = 3.6,
    **kwargs,
):
    """A new figure in the book's style; returns ``(fig, axes)`` like
    ``plt.subplots``."""
    with mpl.rc_context(_STYLE):
        return plt.subplots(nrows, ncols, figsize=(width, height), **kwargs)


def heatmap(
    ax,
    matrix,
    row_labels=None,
    col_labels=None,
    title=None,
    annotate=None,
    cmap="viridis",
    vmin=None,
    vmax=None,
    colorbar=True,
    fmt="{:.2f}",
):
    """Draw a matrix (e.g. attention weights, rows = queries) with optional
    labels.

    matrix: (n_rows, n_cols). ``annotate`` writes each value in its cell; by
    default only for matrices of at most 12 x 12.
    """
    matrix = np.asarray(matrix, dtype=float)
    im = ax.imshow(matrix, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
    ax.grid(False)
    if row_labels is not None:
        ax.set_yticks(range(len(row_labels)), labels=row_labels)
    if col_labels is not None:
        ax.set_xticks(
            range(len(col_labels)), labels=col_labels, rotation=45, ha="right"
        )
    if title:
        ax.set_title(title)
    if annotate is None:
        annotate = max(matrix.shape) <= 12
    if annotate:
        for (i, j), value in np.ndenumerate(matrix):
            r, g, b, _ = im.cmap(im.norm(value))
            # dark text on light cells and vice versa, for any colour map
            # (diverging ones too)
            colour = (
                "white" if 0.299 * r + 0.587 * g + 0.114 * b < 0.5 else "black"
            )
            ax.text(
                j,
                i,
                fmt.format(value),
                ha="center",
                va="center",
                fontsize=8,
                color=colour,
            )
    if colorbar:
        ax.figure.colorbar(im, ax=ax, shrink=0.8)
    return im


def loglog_fit(x, y) -> tuple[float, float]:
    """Least-squares slope and intercept of ``log y`` against ``log x``: the
    measured exponent."""
    slope, intercept = np.polyfit(
        np.log(np.asarray(x, float)), np.log(np.asarray(y, float)), 1
    )
    return float(slope), float(intercept)


def flash_data_movement(
    ax, n_blocks: int = 4, query_block: int = 1, key_block: int = 2
):
    """Draw what FlashAttention's forward pass moves between HBM and the SRAM
    of one SM.

    Chapter 9's figure. On the left, HBM holds Q, K, V and O, each cut into
    ``n_blocks`` blocks of rows; on the right, the SRAM (registers and shared
    memory) of the SM that owns query block ``query_block``: its block Q_i,
    read once and resident for the whole sweep; the key and value blocks K_j,
    V_j, streamed in one after the other (``key_block`` is the one in flight);
    the tile S_ij = tau Q_i K_j^T; and the running state m, l and O~, written
    to O_i once at the end. Returns a dict of the drawn patches by name ("Q0",
    ..., "sram Q_i", ...).
    """
    from matplotlib.patches import FancyArrowPatch, Rectangle

    n_blocks = int_in_range("n_blocks", n_blocks, 2, bounds="an integer >= 2")
    for name, value in (
        ("query_block", query_block),
        ("key_block", key_block),
    ):
        int_in_range(
            name,
            value,
            0,
            n_blocks - 1,
            bounds=f"an integer in [0, n_blocks = {n_blocks})",
        )
    resident, streamed, idle, state = (
        COLORS[0],
        COLORS[1],
        "#e8e8e8",
        COLORS[2],
    )
    patches = {}

    def box(name, x, y, w, h, colour, label=None, **text):
        patches[name] = ax.add_patch(
            Rectangle((x, y), w, h, facecolor=colour, edgecolor="0.3", lw=0.8)
        )
        if label:
            ax.text(
                x + w / 2,
                y + h / 2,
                label,
                ha="center",
                va="center",
                fontsize=8,
                **text,
            )

    height = 4.0 / n_blocks
    top = 5.0
    # HBM: four matrices of n rows, cut into blocks of rows
    ax.add_patch(
        Rectangle(
            (0.1, 0.3), 4.6, 5.4, facecolor="none", edgecolor="0.5", ls="--"
        )
    )
    ax.text(
        2.4,
        5.85,
        "HBM (off chip): Q, K, V, O of n rows",
        ha="center",
        fontsize=9,
    )
    for column, (matrix, x) in enumerate(
        (("Q", 0.4), ("K", 1.5), ("V", 2.6), ("O", 3.7))
    ):
        ax.text(x + 0.4, top + 0.15, matrix, ha="center", fontsize=9)
        for b in range(n_blocks):
            active = (matrix in "QO" and b == query_block) or (
                matrix in "KV" and b == key_block
            )
            colour = (
                (
                    resident
                    if matrix == "Q"
                    else state
                    if matrix == "O"
                    else streamed
                )
                if active
                else idle
            )
            box(
                f"{matrix}{b}",
                x,
                top - (b + 1) * height,
                0.8,
                height * 0.92,
                colour,
                f"{matrix}$_{b}$" if active else None,
                color="white" if active else "black",
            )
    # SRAM of one SM
    ax.add_patch(
        Rectangle(
            (5.6, 0.3), 4.3, 5.4, facecolor="none", edgecolor="0.5", ls="--"
        )
    )
    ax.text(
        7.75,
        5.85,
        f"SRAM of one SM (program i = {query_block})",
        ha="center",
        fontsize=9,
    )
    box(
        "sram Q_i",
        5.9,
        4.2,
        1.2,
        0.7,
        resident,
        "$Q_i$ (stays)",
        color="white",
    )
    box("sram K_j", 7.4, 4.2, 1.0, 0.7, streamed, "$K_j$", color="white")
    box("sram V_j", 8.6, 4.2, 1.0, 0.7, streamed, "$V_j$", color="white")
    box(
        "sram S_ij",
        6.6,
        2.6,
        1.8,
        1.1,
        "#f5f5f5",
        "$S_{ij} = \\tau Q_i K_j^\\top$\n$B_q \\times B_k$",
    )
    box(
        "sram state",
        6.3,
        0.7,
        2.4,
        1.1,
        state,
        "$m$, $\\ell$, $\\tilde O$ (float32)",
        color="white",
    )

    def arrow(start, end, text=None, where=None):
        ax.add_patch(
            FancyArrowPatch(
                start,
                end,
                arrowstyle="-|>",
                mutation_scale=10,
                color="0.2",
                lw=1.0,
            )
        )
        if text:
            ax.text(*where, text, fontsize=7.5, ha="center", va="center")

    y_q, y_k = (
        top - (query_block + 0.5) * height,
        top - (key_block + 0.5) * height,
    )
    arrow((1.2, y_q), (5.9, 4.55), "once", (5.2, 4.85))
    arrow((2.3, y_k), (7.9, 4.2), f"every j = 0..{n_blocks - 1}", (5.3, 3.55))
    arrow((3.4, y_k), (9.1, 4.2))
    # Q_i and K_j make the tile of scores
    arrow((6.5, 4.2), (7.0, 3.7))
    arrow((7.9, 4.2), (7.7, 3.7))
    # the online softmax
    arrow((7.5, 2.6), (7.5, 1.8), "exp, rescale", (8.35, 2.2))
    arrow((9.1, 4.2), (8.5, 1.8), "$\\tilde P V_j$", (9.35, 2.9))
    arrow(
        (6.3, 1.25),
        (4.5, y_q),
        "once, at the end:\n$O_i = \\tilde O / \\ell$",
        (5.15, 1.4),
    )
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 6.2)
    ax.set_aspect("auto")
    ax.axis("off")
    return patches
