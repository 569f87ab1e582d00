"""Run every chapter as a reader on a fresh runtime meets it, and report what
it prints that a reader should not see.

Each chapter is copied alone into an empty folder and executed in a fresh
virtual environment that has the book's dependencies but neither attnbook
(the chapter's setup cell installs it, from a wheel of this checkout) nor
triton (as on Colab's CPU runtime; chapter 10 installs it from the package
index, as it does there, so that chapter needs the network). The report
lists, per chapter, every output on stderr and every output that names a path
of this machine (the repository, the temporary folders, a site-packages
folder).

    python scripts/run_copied_chapters.py [NN ...]   # default: every chapter

It takes as long as running every chapter (about 15 minutes on two cores);
tests/test_colab_setup.py runs the same setup for chapter 1 on every build.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# what the fresh venv does not see of this environment's packages
HIDDEN = ("triton", "attnbook", "__editable__")


def fresh_python(tmp: Path) -> Path:
    """A venv that sees this environment's packages except attnbook and
    triton."""
    env_dir = tmp / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(env_dir)],
        check=True,
    )
    python = env_dir / "bin" / "python"
    purelib = Path(
        subprocess.run(
            [
                str(python),
                "-c",
                "import sysconfig; print(sysconfig.get_paths()['purelib'])",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    # The book's dependencies, seen through a folder of links to this
    # environment's packages without triton and attnbook, their metadata
    # included, so that pip installs them when a chapter asks.
    deps = tmp / "dependencies"
    deps.mkdir()
    here = Path(sysconfig.get_paths()["purelib"])
    for entry in here.iterdir():
        if not entry.name.lower().startswith(HIDDEN):
            (deps / entry.name).symlink_to(entry)
    (purelib / "book_dependencies.pth").write_text(f"{deps}\n")
    return python


def wheel(tmp: Path) -> Path:
    """A wheel of this checkout's attnbook, built from a copy (setuptools
    writes build/ and *.egg-info next to the sources)."""
    source = tmp / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "code",
        source / "code",
        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"),
    )
    out = tmp / "wheel"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(out),
            str(source),
        ],
        check=True,
    )
    (built,) = out.glob("attnbook-*.whl")
    return built


def machine_paths(tmp: Path) -> re.Pattern:
    places = {str(ROOT), str(tmp), tempfile.gettempdir(), str(Path.home())}
    alternatives = "|".join(
        re.escape(p) for p in sorted(places, key=len, reverse=True)
    )
    return re.compile(rf"({alternatives}|site-packages)")


def run_chapter(
    python: Path, notebook: Path, whl: Path, tmp: Path
) -> list[str]:
    folder = tmp / notebook.stem
    folder.mkdir()
    copy = folder / notebook.name
    shutil.copy(notebook, copy)
    executed = folder / "executed.ipynb"
    script = textwrap.dedent(f"""
        import nbformat
        from nbclient import NotebookClient
        nb = nbformat.read({str(copy)!r}, as_version=4)
        NotebookClient(
            nb, timeout=600, kernel_name="python3", allow_errors=True,
            resources={{"metadata": {{"path": {str(folder)!r}}}}},
        ).execute()
        nbformat.write(nb, {str(executed)!r})
    """)
    env = {
        **os.environ,
        "ATTNBOOK_SOURCE": str(whl),
        "PYTHONNOUSERSITE": "1",
        "MPLBACKEND": "Agg",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        # this machine's pip configuration files add local indexes that a
        # reader's runtime does not have (pip warns of the missing ones)
        "PIP_CONFIG_FILE": os.devnull,
    }
    env.pop("PYTHONPATH", None)
    subprocess.run(
        [str(python), "-c", script],
        cwd=folder,
        env=env,
        check=True,
        timeout=1800,
    )
    found = []
    paths = machine_paths(tmp)
    for index, cell in enumerate(json.loads(executed.read_text())["cells"]):
        for output in cell.get("outputs", []):
            if (
                output.get("output_type") == "stream"
                and output.get("name") == "stderr"
            ):
                found.append(
                    f"cell {index}: stderr: {''.join(output['text'])[:300]!r}"
                )
            text = json.dumps(output)
            if output.get("output_type") == "error":
                tags = cell.get("metadata", {}).get("tags", [])
                if "raises-exception" not in tags:
                    found.append(
                        f"cell {index}: error {output.get('ename')}: "
                        f"{output.get('evalue')}"
                    )
                # an exercise stub's traceback names the folder it ran in
                continue
            match = paths.search(text)
            if match:
                start = max(0, match.start() - 60)
                found.append(
                    f"cell {index}: a machine path: "
                    f"...{text[start : match.end() + 60]}..."
                )
    return found


def main(chapters: list[str]) -> int:
    notebooks = sorted((ROOT / "book").glob("[0-9][0-9]-*.ipynb"))
    if chapters:
        notebooks = [n for n in notebooks if n.name[:2] in chapters]
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        whl = wheel(tmp)
        python = fresh_python(tmp)
        problems = 0
        for notebook in notebooks:
            found = run_chapter(python, notebook, whl, tmp)
            problems += len(found)
            print(
                f"{notebook.name}: "
                f"{'clean' if not found else f'{len(found)} findings'}"
            )
            for line in found:
                print("   ", line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
