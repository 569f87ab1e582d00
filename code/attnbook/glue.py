"""Quote a machine-dependent number in a chapter's prose from the output that
measured it.

A timing or a speed-up ratio differs from machine to machine, so the prose must
not type it in: the cell that measures it calls ``glue("ch8-speedup", ratio)``,
and the markdown says ``{glue:text}`ch8-speedup:.1f` ``. MyST-NB substitutes
the committed output's value when the book is built, so the text and the table
beside it always agree. Any chapter may use it.

Chapters 1, 4, 5, 8, 9, 12 and 13 glue their timings into the prose with
:func:`glue`.
"""

from __future__ import annotations

# MyST-NB's own record format ("scrapbook" metadata on a display_data output
# whose MIME types carry this prefix), written here directly so that a reader's
# runtime (Colab) needs no MyST-NB.
_GLUE_PREFIX = "application/papermill.record/"


def glue(name: str, value) -> None:
    """Record ``value`` under ``name`` for ``{glue:text}`name` `` in the same
    notebook; displays nothing."""
    try:
        from IPython.core.formatters import format_display_data
        from IPython.display import display
    except ImportError:  # plain Python, no notebook: nothing to record into
        return
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        # np.float64(0.1) would be glued as its repr, which no format spec
        # reads
        value = value.item()
    bundle, metadata = format_display_data(value)
    metadata["scrapbook"] = {"name": name, "mime_prefix": _GLUE_PREFIX}
    display(
        {_GLUE_PREFIX + k: v for k, v in bundle.items()},
        raw=True,
        metadata=metadata,
    )
