"""attnbook.browser: in the browser, a cell that fails for want of PyTorch ends with a note, not a traceback.

The handler is exercised in a real IPython shell here; tests/test_lite.py runs it in Pyodide itself."""
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
    return result, capsys.readouterr().out


@pytest.mark.parametrize("code, what", [
    ("raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')", "needs PyTorch"),
    ("raise ModuleNotFoundError(\"No module named 'torch.nn'\", name='torch.nn')", "needs PyTorch"),
    ("raise ModuleNotFoundError(\"No module named 'transformers'\", name='transformers')", "transformers, which needs"),
    ("x = 1\nF.softmax(x)", "F is a PyTorch name"),
    ("torch.manual_seed(0)", "torch is a PyTorch name"),
])
def test_a_missing_torch_gets_the_note(shell, capsys, code, what):
    result, out = run(shell, capsys, code)
    assert result.error_in_exec is not None          # the cell still fails (its later lines did not run)
    assert what in out and "does not run in the browser" in out, out
    assert browser.colab_url(NOTEBOOK) in out
    assert "Traceback" not in out


@pytest.mark.parametrize("code, shown", [
    ("raise ModuleNotFoundError(\"No module named 'nonesuch'\", name='nonesuch')", "nonesuch"),
    ("undefined_name + 1", "undefined_name"),
    ("1 / 0", "ZeroDivisionError"),
])
def test_other_errors_keep_their_traceback(shell, capsys, code, shown):
    result, out = run(shell, capsys, code)
    assert result.error_in_exec is not None
    assert shown in out and "does not run in the browser" not in out, out


def test_colab_url_is_the_books_repository():
    url = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"]
    slug = url.split("github.com/")[1]
    assert browser.colab_url(NOTEBOOK) == f"https://colab.research.google.com/github/{slug}/blob/main/{NOTEBOOK}"


def test_in_browser_is_false_here():
    assert browser.in_browser() is False
