"""MkDocs hook: the tutorials are the notebooks in nbs/, executed in a real Jupyter kernel at every build.

Each notebook runs in a fresh kernel on this interpreter, in a scratch copy of nbs/ (the quickstart saves
into ./models), with one intra-op thread (the tiny models lose time to threads on a busy machine). A cell
that raises fails the build. The executed copies go to a temporary directory of this build and are
handed to mkdocs-jupyter, which renders them with their outputs; nbs/ keeps its notebooks without outputs.
`CADENCE_DOCS_NOTEBOOKS=skip` renders them unexecuted, for a quick look at the prose (the strict build and
the docs test execute them).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "nbs"
TIMEOUT_S = 600  # per cell; the distributed notebook starts two worker processes


def _kernel_env(prefix: Path) -> None:
    """A `python3` kernelspec that runs this interpreter, found before any other (JUPYTER_PATH)."""
    from ipykernel.kernelspec import install

    install(kernel_name="python3", prefix=str(prefix))
    os.environ["JUPYTER_PATH"] = str(prefix / "share" / "jupyter")


def execute(src: Path, dest: Path) -> None:
    import nbclient
    import nbformat

    with tempfile.TemporaryDirectory(prefix="cadence-docs-nb-") as tmp:
        _kernel_env(Path(tmp) / "kernel")
        work = Path(tmp) / "nbs"
        work.mkdir()
        nb = nbformat.read(src, as_version=4)
        os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        nbclient.NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3",
                                resources={"metadata": {"path": str(work)}}).execute()
    dest.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, dest)


_built: list[Path] = []  # this build's directory of executed notebooks, removed when the build ends


@event_priority(100)  # before mkdocs-jupyter turns .ipynb files into pages
def on_files(files, config):
    skip = os.environ.get("CADENCE_DOCS_NOTEBOOKS") == "skip"
    out = Path(tempfile.mkdtemp(prefix="cadence-docs-notebooks-"))
    _built.append(out)
    for src in sorted(NOTEBOOKS.glob("*.ipynb")):
        dest = out / "tutorials" / src.name
        if skip:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dest)
        else:
            execute(src, dest)
        files.append(File(f"tutorials/{src.name}", str(out), config["site_dir"], config["use_directory_urls"]))
    return files


def on_post_build(config):
    while _built:
        shutil.rmtree(_built.pop(), ignore_errors=True)
