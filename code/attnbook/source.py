"""Show the package's own code inside a chapter, so the book explains the code that runs."""
from __future__ import annotations

import inspect


def show_source(obj) -> None:
    """Display the source of a function or class as a highlighted code block.

    In a notebook the block renders as Python; elsewhere it is printed.
    """
    source = inspect.getsource(obj)
    try:
        from IPython.display import Markdown, display
    except ImportError:  # plain Python: no rich display
        print(source)
        return
    display(Markdown(f"```python\n{source}```"))
