"""The "Run in your browser" site: a chapter runs in Pyodide inside a real browser, offline, fast enough.

scripts/build_lite.py builds the site (JupyterLite, its Pyodide kernel, the verified Pyodide 0.27.7 and
attnbook's wheel) into a temporary folder; a local server serves it on 127.0.0.1 and headless Chromium
opens chapter 4 in JupyterLite's notebook app, as a reader's "Run in your browser" does. Then:
- the chapter's own setup cell installs attnbook with piplite, and a numpy cell prints what the committed
  notebook shows;
- the exercise checker accepts the chapter's solution and rejects a classic wrong answer (the softmax
  without its shift) with that mistake's diagnosis; a cell that needs PyTorch says so (no traceback);
  embeddings.cooccurrence_counts takes int64 ids on wasm32;
- every request the page made went to the local server;
- the first result came in under 60 s.
A test of the verification step (a tampered file is refused) needs no browser.
"""
from __future__ import annotations

import base64
import functools
import hashlib
import http.server
import importlib.util
import io
import json
import os
import threading
import time
import zipfile
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = "04-softmax"
FIRST_RESULT_LIMIT_S = 60


def load_build_lite():
    spec = importlib.util.spec_from_file_location("build_lite", ROOT / "scripts" / "build_lite.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_lite = load_build_lite()


# --- the verification step -------------------------------------------------------------------------------

def fake_lock_and_mirror(files: dict[str, bytes], tamper: str | None = None):
    packages = {name: {"file_name": f"{name}-1.0-py3-none-any.whl", "sha256": hashlib.sha256(data).hexdigest(),
                       "depends": []} for name, data in files.items()}
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as mirror:
        for name, data in files.items():
            if name == tamper:
                data = data[:-1] + bytes([data[-1] ^ 1])   # one bit flipped
            mirror.writestr(build_lite.MIRROR_FOLDER + packages[name]["file_name"], data)
    return packages, zipfile.ZipFile(io.BytesIO(buffer.getvalue()))


def test_verified_files_are_copied(tmp_path):
    files = {"alpha": b"first package", "beta": b"second package"}
    packages, mirror = fake_lock_and_mirror(files)
    written = build_lite.extract_verified(mirror, build_lite.MIRROR_FOLDER, packages, ["alpha", "beta"], tmp_path)
    assert written == sum(map(len, files.values()))
    assert (tmp_path / "beta-1.0-py3-none-any.whl").read_bytes() == b"second package"


def test_a_tampered_file_is_refused(tmp_path):
    packages, mirror = fake_lock_and_mirror({"alpha": b"first package", "beta": b"second package"}, tamper="beta")
    with pytest.raises(build_lite.VerificationError, match="beta-1.0-py3-none-any.whl"):
        build_lite.extract_verified(mirror, build_lite.MIRROR_FOLDER, packages, ["alpha", "beta"], tmp_path)
    assert not (tmp_path / "beta-1.0-py3-none-any.whl").exists()


def test_a_file_missing_from_the_mirror_is_refused(tmp_path):
    packages, mirror = fake_lock_and_mirror({"alpha": b"first package"})
    packages["gamma"] = {"file_name": "gamma-1.0-py3-none-any.whl", "sha256": "0" * 64, "depends": []}
    with pytest.raises(build_lite.VerificationError, match="missing from the mirror"):
        build_lite.extract_verified(mirror, build_lite.MIRROR_FOLDER, packages, ["gamma"], tmp_path)


def test_the_runtime_tarball_is_checked_against_npm_integrity():
    data = b"a tarball"
    pinned = base64.b64encode(hashlib.sha512(data).digest()).decode()
    build_lite.check_npm_integrity(data, pinned)
    with pytest.raises(build_lite.VerificationError, match="sha512"):
        build_lite.check_npm_integrity(data + b"!", pinned)


def test_a_lock_of_another_version_is_refused():
    with pytest.raises(build_lite.VerificationError, match="0.28.0"):
        build_lite.lock_packages({"info": {"version": "0.28.0"}, "packages": {}})


def test_dependencies_follow_the_lock():
    packages = {"a": {"depends": ["B_c"]}, "b-c": {"depends": ["d"]}, "d": {"depends": []}, "e": {"depends": []}}
    assert build_lite.needed_packages(packages, seeds=("a",)) == ["a", "b-c", "d"]


# --- the site in a browser -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("lite") / "lite"
    start = time.perf_counter()
    build_lite.build(out)
    print(f"lite build: {time.perf_counter() - start:.1f} s")
    return out


class SiteHandler(http.server.SimpleHTTPRequestHandler):
    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map,
                      ".wasm": "application/wasm", ".mjs": "text/javascript", ".js": "text/javascript",
                      ".json": "application/json"}

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server(site):
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(SiteHandler, directory=str(site)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def browser():
    from test_book import CHROMIUM_ARGS, chromium_path

    path = chromium_path()
    if path is None:
        message = "Debian's chromium is not installed (apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(message)  # in CI a missing browser is a failure, never a skip
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        yield b
        b.close()


def code_cells():
    cells = json.loads((ROOT / "book" / f"{CHAPTER}.ipynb").read_text())["cells"]
    return [c for c in cells if c["cell_type"] == "code"]


def find_cell(predicate) -> int:
    return next(i for i, c in enumerate(code_cells()) if predicate("".join(c["source"]), c))


def committed_text(index: int) -> str:
    return "".join("".join(o.get("text", "")) for o in code_cells()[index]["outputs"] if o["output_type"] == "stream")


def expose_app(route):
    """Serve the site's configuration with exposeAppInBrowser, so that the test can reach the app as
    window.jupyterapp (readers' pages do not need it); everything else is served as built."""
    response = route.fetch()
    config = response.json()
    config["jupyter-config-data"]["exposeAppInBrowser"] = "true"
    route.fulfill(response=response, json=config)


OPEN_NOTEBOOK = """async () => {
    const app = window.jupyterapp;
    await app.restored;
    let panel = app.shell.currentWidget;
    for (let i = 0; i < 600 && !(panel && panel.sessionContext); i++) {
        await new Promise(r => setTimeout(r, 100));
        panel = app.shell.currentWidget;
    }
    await panel.context.ready;
    await panel.sessionContext.ready;
    return panel.sessionContext.session.kernel.name;
}"""

# Run one of the notebook's own code cells, as Shift+Enter does; return its outputs as text.
RUN_CELL = """async (index) => {
    const app = window.jupyterapp;
    const notebook = app.shell.currentWidget.content;
    const cell = notebook.widgets.filter(c => c.model.type === 'code')[index];
    notebook.activeCellIndex = notebook.widgets.indexOf(cell);
    await app.commands.execute('notebook:run-cell');
    return cell.model.outputs.toJSON().map(o =>
        o.output_type === 'stream' ? o.text :
        o.output_type === 'error' ? 'ERROR ' + o.ename + ': ' + (o.traceback || []).join('\\n') :
        (o.data && o.data['text/plain']) || '').join('');
}"""

# Run code in the notebook's kernel, as a new cell would; return what it printed or raised.
RUN_CODE = """async (code) => {
    const kernel = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
    const future = kernel.requestExecute({code});
    const out = [];
    future.onIOPub = msg => {
        const c = msg.content;
        if (msg.header.msg_type === 'stream') out.push(c.text);
        if (msg.header.msg_type === 'error') out.push('ERROR ' + c.ename + ': ' + c.evalue + '\\n' + c.traceback.join('\\n'));
        if (msg.header.msg_type === 'execute_result') out.push(c.data['text/plain']);
    };
    await future.done;
    return out.join('');
}"""

WRONG_SOFTMAX = """
def my_softmax(x):
    e = np.exp(x)                       # the classic mistake: no shift by the maximum
    return e / e.sum(axis=-1, keepdims=True)

try:
    check_softmax(my_softmax)
except Exception as err:
    print(type(err).__name__, err)
"""


def run_here(code: str) -> str:
    """What the code prints in this Python, with the chapter's names."""
    import contextlib

    from attnbook.exercises import check_softmax

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, {"np": np, "check_softmax": check_softmax})
    return out.getvalue()


def test_a_chapter_runs_in_pyodide_offline(browser, server):
    setup = 0
    numpy_cell = find_cell(lambda s, c: s.startswith("x = np.array([2.0, 1.0, 0.1, -1.0])"))
    solution = find_cell(lambda s, c: "check_softmax(my_softmax)" in s and "raises-exception" not in
                         c["metadata"].get("tags", []))
    torch_cell = find_cell(lambda s, c: "naive_softmax(masked)" in s and "torch" in s)

    page = browser.new_page()
    requests, problems = [], []
    page.on("request", lambda req: requests.append(req.url))
    page.on("websocket", lambda ws: requests.append(ws.url))
    page.route(f"{server}/jupyter-lite.json", expose_app)
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.on("response", lambda resp: problems.append(f"HTTP {resp.status}: {resp.url}") if resp.status >= 400 else None)
    page.set_default_timeout(180_000)
    start = time.perf_counter()
    page.goto(f"{server}/notebooks/index.html?path={CHAPTER}.ipynb", wait_until="load")
    page.wait_for_function("() => window.jupyterapp !== undefined")
    kernel = page.evaluate(OPEN_NOTEBOOK)
    setup_out = page.evaluate(RUN_CELL, setup)
    first = page.evaluate(RUN_CELL, numpy_cell)
    first_result_s = time.perf_counter() - start

    platform = page.evaluate(RUN_CODE, "import sys; print(sys.platform, 'attnbook' in sys.modules, 'torch' in sys.modules)")
    right = page.evaluate(RUN_CELL, solution)
    wrong = page.evaluate(RUN_CODE, WRONG_SOFTMAX)
    torch_out = page.evaluate(RUN_CELL, torch_cell)
    ids = [[0, 1, 2, 1, 0], [2, 2, 1]]
    counts = page.evaluate(RUN_CODE, "from attnbook.embeddings import cooccurrence_counts\n"
                                     f"print(cooccurrence_counts([np.array(s, dtype=np.int64) for s in {ids}], 3)"
                                     ".astype(int).tolist())")
    page.close()
    print(f"first result {first_result_s:.1f} s; {len(requests)} requests")

    assert kernel == "python"
    assert "ERROR" not in setup_out, setup_out
    assert platform.split() == ["emscripten", "True", "False"], platform
    assert first == committed_text(numpy_cell), first                        # the numpy cell's committed output
    assert first_result_s < FIRST_RESULT_LIMIT_S, f"first result after {first_result_s:.0f} s"

    assert right.strip() == committed_text(solution).strip(), right           # "Correct: ..."
    assert wrong.startswith("ExerciseError") and "Diagnosis: your softmax overflows" in wrong, wrong
    assert wrong == run_here(WRONG_SOFTMAX), wrong        # the very message CPython gives
    assert "does not run in the browser" in torch_out and "Traceback" not in torch_out, torch_out
    assert "colab.research.google.com" in torch_out
    from attnbook.embeddings import cooccurrence_counts
    expected = cooccurrence_counts([np.array(s) for s in ids], 3).astype(int).tolist()
    assert counts.strip() == str(expected), counts

    outside = [url for url in requests if urlsplit(url).scheme not in ("data", "blob")
               and urlsplit(url).hostname != "127.0.0.1"]
    assert not outside, f"requests that left 127.0.0.1: {outside}"
    assert not problems, problems
