"""attnbook.browser: in the browser, a cell that fails for want of PyTorch
stops with a note, not a traceback.

The handler is exercised in a real IPython shell here; tests/test_lite.py runs
it in Pyodide itself, where "Run All" must go on past such a cell."""

from __future__ import annotations

import pytest
import yaml
from IPython.core.interactiveshell import InteractiveShell

from pathlib import Path

from attnbook import browser

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = "book/04-softmax.ipynb"


@pytest.fixture
def shell():
    shell = InteractiveShell()
    browser.explain_missing_torch(NOTEBOOK, shell=shell)
    yield shell
    shell.set_custom_exc((), None)


def run(shell, capsys, code):
    result = shell.run_cell(code)
    captured = capsys.readouterr()
    return result, captured.out + captured.err


def shown_traceback(shell, monkeypatch):
    """Record whether the shell showed a traceback: JupyterLite's Pyodide
    kernel reports a cell as failed (and "Run All" stops) exactly when its
    shell's _showtraceback is called."""
    shown = []
    original = shell._showtraceback
    monkeypatch.setattr(
        shell,
        "_showtraceback",
        lambda *args: (shown.append(args[0]), original(*args)),
    )
    return shown


@pytest.mark.parametrize(
    "code, what",
    [
        (
            "raise ModuleNotFoundError(\"No module named 'torch'\", "
            "name='torch')",
            "needs PyTorch",
        ),
        (
            "raise ModuleNotFoundError(\"No module named 'torch.nn'\", "
            "name='torch.nn')",
            "needs PyTorch",
        ),
        (
            "raise ModuleNotFoundError(\"No module named 'transformers'\", "
            "name='transformers')",
            "transformers, which needs",
        ),
        ("x = 1\nF.softmax(x)", "F is a PyTorch name"),
        ("torch.manual_seed(0)", "torch is a PyTorch name"),
    ],
)
def test_a_missing_torch_gets_the_note(shell, capsys, monkeypatch, code, what):
    shown = shown_traceback(shell, monkeypatch)
    result, out = run(shell, capsys, code)
    # the cell still stops there (its later lines do not run)
    assert result.error_in_exec is not None
    assert what in out and "does not run in the browser" in out, out
    assert browser.colab_url(NOTEBOOK) in out
    assert "Traceback" not in out
    # no traceback: the Pyodide kernel reports the cell ok
    assert shown == []


def test_names_a_stopped_cell_would_bind_get_the_note(
    shell, capsys, monkeypatch
):
    shown = shown_traceback(shell, monkeypatch)
    run(
        shell,
        capsys,
        "before = 1\nraise ModuleNotFoundError(\"No module named 'torch'\", "
        "name='torch')\n"
        "model = torch.nn.Linear(2, 2)\nfor row in range(2):\n"
        "    weights = [2 * i for i in range(3)]\n"
        "def helper(x):\n    local = x\n    return local",
    )
    result, out = run(shell, capsys, "print(before)\nprint(model)")
    assert (
        out.startswith("1\n")
        and "uses model, which a cell above would have defined" in out
    ), out
    # a cell stopped that way passes its own names on
    run(shell, capsys, "derived = model.weight\nshape = derived.shape")
    _, out = run(shell, capsys, "shape")
    assert "uses shape" in out and "Traceback" not in out, out
    for name in ("weights", "row", "helper"):
        _, out = run(shell, capsys, name)
        assert f"uses {name}," in out, out
    assert shown == []
    # a name local to the stopped cell's function, or never bound, keeps its
    # traceback
    for name in ("local", "i", "undefined_name"):
        result, out = run(shell, capsys, name)
        assert (
            "NameError" in out and "does not run in the browser" not in out
        ), out
    assert len(shown) == 3


def test_running_the_setup_again_keeps_the_names_remembered(
    shell, capsys, monkeypatch
):
    shown = shown_traceback(shell, monkeypatch)
    run(shell, capsys, "model = torch.nn.Linear(2, 2)")
    callbacks = len(shell.events.callbacks["pre_run_cell"])
    # the reader runs the setup cell again
    browser.explain_missing_torch(NOTEBOOK, shell=shell)
    assert len(shell.events.callbacks["pre_run_cell"]) == callbacks
    _, out = run(shell, capsys, "model")
    assert (
        "uses model, which a cell above would have defined" in out
        and shown == []
    ), out


STUB = """
from attnbook.exercises import check_softmax

def my_softmax(x):
    {body}

check_softmax(my_softmax)
print("after the checker")
"""


def test_an_untouched_stub_prints_its_verdict_and_a_wrong_answer_stays_an_error(
    shell, capsys, monkeypatch
):
    shown = shown_traceback(shell, monkeypatch)
    result, out = run(
        shell,
        capsys,
        STUB.format(body="raise NotImplementedError  # your code here"),
    )
    assert result.error_in_exec is not None and "after the checker" not in out
    assert (
        out.startswith("NotAttemptedError: ")
        and "the function is still the stub" in out
    ), out
    assert "Traceback" not in out and shown == []
    result, out = run(shell, capsys, STUB.format(body="return x"))
    assert "ExerciseError" in out and len(shown) == 1, out


def test_skip_in_browser_is_a_no_op_here(shell, capsys):
    result, out = run(
        shell,
        capsys,
        "from attnbook.browser import skip_in_browser\n"
        "skip_in_browser('needs about 1.5 GiB.')\nprint('ran')",
    )
    assert result.success and out == "ran\n"


def test_skip_in_browser_stops_the_cell_there(shell, capsys, monkeypatch):
    shown = shown_traceback(shell, monkeypatch)
    monkeypatch.setattr(browser.sys, "platform", "emscripten")
    result, out = run(
        shell,
        capsys,
        "from attnbook.browser import skip_in_browser\nbig = 0\n"
        "skip_in_browser('This needs about 1.5 GiB.')\nbig = 1\nprint('ran')",
    )
    assert "ran" not in out and shell.user_ns["big"] == 0
    assert (
        "This cell stops here in the browser: This needs about 1.5 GiB." in out
    ), out
    assert browser.colab_url(NOTEBOOK) in out and shown == []


@pytest.mark.parametrize(
    "code, shown",
    [
        (
            "raise ModuleNotFoundError(\"No module named 'nonesuch'\", "
            "name='nonesuch')",
            "nonesuch",
        ),
        ("undefined_name + 1", "undefined_name"),
        ("1 / 0", "ZeroDivisionError"),
    ],
)
def test_other_errors_keep_their_traceback(
    shell, capsys, monkeypatch, code, shown
):
    tracebacks = shown_traceback(shell, monkeypatch)
    result, out = run(shell, capsys, code)
    assert result.error_in_exec is not None
    assert shown in out and "does not run in the browser" not in out, out
    # the kernel reports these as errors
    assert len(tracebacks) == 1


def test_colab_url_is_the_books_repository():
    url = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"][
        "url"
    ]
    slug = url.split("github.com/")[1]
    assert (
        browser.colab_url(NOTEBOOK)
        == f"https://colab.research.google.com/github/{slug}/blob/main/{NOTEBOOK}"
    )


def test_in_browser_is_false_here():
    assert browser.in_browser() is False


def test_bound_names_are_the_top_level_ones():
    source = (
        "import numpy as np, os.path\nfrom math import sqrt as root\n(a, [b, "
        "*c]) = 1, [2, 3]\n"
        "with open('x') as handle:\n    inner = 1\nclass Model:\n    field = "
        "1\n"
        "try:\n    pass\nexcept ValueError as err:\n    caught = 1\n"
        "squares = {k: k * k for k in range(3)}\nf = lambda arg: arg\nx += 1\n"
    )
    assert browser.bound_names(source) == {
        "np",
        "os",
        "root",
        "a",
        "b",
        "c",
        "handle",
        "inner",
        "Model",
        "err",
        "caught",
        "squares",
        "f",
        "x",
    }
    # not Python: nothing known
    assert browser.bound_names("%pip install attnbook") == set()
