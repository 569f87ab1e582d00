"""Show the package's own code inside a chapter, so the book explains the code
that runs.

Every chapter calls :func:`show_source`. Its output names where the code is
defined, so that a reader can find it, and so that
``tests/test_chapter_map.py`` can check that the code a chapter shows is still
the code in the package (a shown function is book text: change it, and the
chapters that show it must be re-executed).
"""

from __future__ import annotations

import inspect
from pathlib import Path


def defined_in(obj) -> tuple[str, str]:
    """``(path of its module relative to the package's parent, qualified
    name)`` of a function, class or method of attnbook, e.g.
    ``("attnbook/kv_cache.py", "KVCache.update")``. Triton kernels
    (``JITFunction``) are named by the Python function they wrap (``.fn``)."""
    # a Triton JITFunction wraps the Python function
    obj = getattr(obj, "fn", obj)
    module = inspect.getmodule(obj)
    is_package = Path(inspect.getfile(module)).name == "__init__.py"
    path = module.__name__.replace(".", "/") + (
        "/__init__.py" if is_package else ".py"
    )
    return path, obj.__qualname__


def show_source(obj) -> None:
    """Display the source of a function or class as a highlighted code block,
    below a line that says where it is defined ("Defined in
    `attnbook/softmax.py` as `softmax`").

    In a notebook the block renders as Python; elsewhere it is printed.
    """
    path, name = defined_in(obj)
    header = f"Defined in `{path}` as `{name}`"
    source = inspect.getsource(getattr(obj, "fn", obj))
    try:
        from IPython.display import Markdown, display
    except ImportError:  # plain Python: no rich display
        print(f"{header}\n{source}")
        return
    display(Markdown(f"{header}\n\n```python\n{source}```"))
