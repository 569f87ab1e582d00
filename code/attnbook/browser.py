"""Running a chapter in the web browser (JupyterLite's Pyodide kernel), where there is no PyTorch.

No single chapter shows it: the setup cell of each chapter that runs in the browser (1, 2, 4 and 9)
calls ``explain_missing_torch`` there, and nowhere else. Pyodide has numpy and matplotlib but no build of
PyTorch, so the few cells of those chapters that compare with PyTorch or load MiniLM cannot run; with
the handler installed, such a cell ends with a note that says so and where the chapter runs whole
(Colab) instead of a traceback about a missing module.
"""
from __future__ import annotations

import sys

# the packages that come with PyTorch or need it (the minilm extra's), none of which Pyodide has
TORCH_PACKAGES = ("torch", "triton", "transformers", "safetensors", "tokenizers", "huggingface_hub")
# the names a setup cell binds to torch objects; in the browser they stay undefined
TORCH_NAMES = ("torch", "F", "nn", "FlopCounterMode")


def in_browser() -> bool:
    """Whether this Python runs in a web page (Pyodide is built with Emscripten)."""
    return sys.platform == "emscripten"


def colab_url(notebook: str) -> str:
    """The address that opens a chapter of the book (``"book/04-softmax.ipynb"``) on Colab."""
    return f"https://colab.research.google.com/github/attention-derived/attention-derived/blob/main/{notebook}"


def missing_torch_note(error: BaseException, notebook: str, names=TORCH_NAMES) -> str | None:
    """The note for an error that a missing PyTorch caused, or None for any other error."""
    if isinstance(error, ModuleNotFoundError):
        missing = (error.name or "").split(".")[0]
        if missing not in TORCH_PACKAGES:
            return None
        what = f"{missing}, which needs PyTorch" if missing != "torch" else "PyTorch"
    elif isinstance(error, NameError) and getattr(error, "name", None) in names:
        what = f"PyTorch ({error.name} is a PyTorch name)"
    else:
        return None
    return (f"This cell needs {what}, which does not run in the browser (Pyodide has no build of it). "
            f"The rest of the chapter runs here; to run this cell too, open the chapter on Colab: "
            f"{colab_url(notebook)}")


def explain_missing_torch(notebook: str, shell=None) -> None:
    """Make a cell that fails for want of PyTorch end with a note (``missing_torch_note``), not a traceback.

    ``shell`` is the IPython shell (the running one by default); every other error keeps its usual
    traceback."""
    if shell is None:
        from IPython import get_ipython

        shell = get_ipython()

    def handler(shell, etype, value, tb, tb_offset=None):
        # IPython shows nothing itself for an exception it hands to a custom handler
        note = missing_torch_note(value, notebook)
        if note is None:
            shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
        else:
            shell._showtraceback(etype, value, [note])   # the kernel sends it as the cell's error, in place of
                                                         # the traceback

    shell.set_custom_exc((ModuleNotFoundError, NameError), handler)
