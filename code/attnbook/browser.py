"""Running a chapter in the web browser (JupyterLite's Pyodide kernel), where
there is no PyTorch.

No single chapter shows it: the setup cell of each chapter that runs in the
browser (1, 2, 4 and 9) calls ``explain_missing_torch`` there, and nowhere
else. Pyodide has numpy and matplotlib but no build of PyTorch, so the few
cells of those chapters that compare with PyTorch or load MiniLM cannot run;
with the handler installed, such a cell stops with a note that says so and
where the chapter runs whole (Colab) instead of a traceback about a missing
module, and "Run All" goes on to the next cell. A later cell that uses a name
such a cell would have defined stops with the same kind of note. Chapter 9 also
calls ``skip_in_browser`` in the few measurements that need more memory or time
than a browser tab has: a no-op anywhere else, it stops the cell there with a
note. An exercise stub that is still a stub (``NotAttemptedError``) prints its
verdict the same way, so that "Run All" goes on past the exercises as it does
in Jupyter (those cells are tagged ``raises-exception``, which JupyterLite does
not honour).
"""

from __future__ import annotations

import ast
import sys

from .verdicts import NotAttemptedError

# the packages that come with PyTorch or need it (the minilm extra's), none of
# which Pyodide has
TORCH_PACKAGES = (
    "torch",
    "triton",
    "transformers",
    "safetensors",
    "tokenizers",
    "huggingface_hub",
)
# the names a setup cell binds to torch objects; in the browser they stay
# undefined
TORCH_NAMES = ("torch", "F", "nn", "FlopCounterMode")


class SkippedInBrowser(Exception):
    """Raised by ``skip_in_browser``: the cell does not run in the browser, for
    the reason given."""


def in_browser() -> bool:
    """Whether this Python runs in a web page (Pyodide is built with
    Emscripten)."""
    return sys.platform == "emscripten"


def skip_in_browser(reason: str) -> None:
    """In the browser, stop the cell here (the handler prints why); anywhere
    else, do nothing."""
    if in_browser():
        raise SkippedInBrowser(reason)


def colab_url(notebook: str) -> str:
    """The address that opens a chapter of the book
    (``"book/04-softmax.ipynb"``) on Colab."""
    return f"https://colab.research.google.com/github/attention-derived/attention-derived/blob/main/{notebook}"


def missing_torch_note(
    error: BaseException, notebook: str, names=TORCH_NAMES, skipped=()
) -> str | None:
    """The note for an error that a missing PyTorch caused, or None for any
    other error.

    ``skipped`` are the names that cells stopped by such an error would have
    defined: a NameError for one of them was caused by the missing PyTorch too.
    A ``SkippedInBrowser`` gets its own reason."""
    if isinstance(error, SkippedInBrowser):
        return (
            f"This cell stops here in the browser: {error} "
            "Run the chapter on Colab or locally to see it: "
            f"{colab_url(notebook)}"
        )
    if isinstance(error, ModuleNotFoundError):
        missing = (error.name or "").split(".")[0]
        if missing not in TORCH_PACKAGES:
            return None
        what = (
            f"needs {missing}, which needs PyTorch"
            if missing != "torch"
            else "needs PyTorch"
        )
    elif (
        isinstance(error, NameError) and getattr(error, "name", None) in names
    ):
        what = f"needs PyTorch ({error.name} is a PyTorch name)"
    elif (
        isinstance(error, NameError)
        and getattr(error, "name", None) in skipped
    ):
        what = (
            f"uses {error.name}, which a cell above would have defined if "
            "PyTorch ran here, so it needs PyTorch too"
        )
    else:
        return None
    return (
        f"This cell stops here: it {what}, and PyTorch does not run in the "
        "browser (Pyodide has no build "
        "of it). The rest of the chapter runs here; to run this cell too, "
        "open the chapter on Colab: "
        f"{colab_url(notebook)}"
    )


def bound_names(source: str) -> set[str]:
    """The names that running ``source`` at the top level of a notebook would
    bind (assignments, loop and ``with`` targets, imports, functions, classes);
    not those local to a function or comprehension."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    names = set()
    todo = [tree]
    while todo:
        for node in ast.iter_child_nodes(todo.pop()):
            if isinstance(
                node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
            ):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(
                node.ctx, ast.Store
            ):
                names.add(node.id)
            elif isinstance(node, ast.alias):
                names.add((node.asname or node.name).split(".")[0])
            elif isinstance(node, ast.ExceptHandler) and node.name:
                names.add(node.name)
                todo.append(node)
            elif not isinstance(
                node,
                (
                    ast.Lambda,
                    ast.ListComp,
                    ast.SetComp,
                    ast.DictComp,
                    ast.GeneratorExp,
                ),
            ):
                todo.append(node)
    return names


def explain_missing_torch(notebook: str, shell=None) -> None:
    """Make a cell that fails for want of PyTorch stop with a note
    (``missing_torch_note``), not a traceback.

    ``shell`` is the IPython shell (the running one by default). The note is
    printed (to stderr), not shown as the cell's error: JupyterLite's Pyodide
    kernel reports a cell as failed only when a traceback was shown, and
    JupyterLite cancels every queued cell after a failed one, so a shown error
    would end "Run All" there. (IPython still records the exception as the
    cell's ``error_in_exec``.) The names such a cell binds are remembered, so
    that a later cell that needs one of them gets the note too. An exercise
    stub's ``NotAttemptedError`` prints its verdict the same way; every other
    error, a wrong answer to an exercise included, keeps its usual traceback
    and stops "Run All".

    Running the setup cell again installs the handler again and keeps the names
    remembered so far: the cells that bound them are not run again, and a later
    cell that needs one of them still gets the note."""
    if shell is None:
        from IPython import get_ipython

        shell = get_ipython()
    previous = getattr(shell, "_attnbook_missing_torch", None)
    if previous is not None:
        shell.events.unregister("pre_run_cell", previous["remember_cell"])
    skipped: set[str] = previous["skipped"] if previous is not None else set()
    cell = {"source": ""}

    def remember_cell(info):
        cell["source"] = info.raw_cell or ""

    def handler(shell, etype, value, tb, tb_offset=None):
        # IPython shows nothing itself for an exception it hands to a custom
        # handler
        if isinstance(value, NotAttemptedError):
            print(
                "\n".join(value._render_traceback_()),
                file=sys.stderr,
                flush=True,
            )
            return
        note = missing_torch_note(value, notebook, skipped=skipped)
        if note is None:
            shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
            return
        # IPython ran it, so it transforms
        skipped.update(bound_names(shell.transform_cell(cell["source"])))
        print(note, file=sys.stderr, flush=True)

    shell.events.register("pre_run_cell", remember_cell)
    shell._attnbook_missing_torch = {
        "skipped": skipped,
        "remember_cell": remember_cell,
    }
    shell.set_custom_exc(
        (ModuleNotFoundError, NameError, SkippedInBrowser, NotAttemptedError),
        handler,
    )
