"""The distributed examples run green: examples/distrib.py on 2 processes through `cadence launch`, and
nbs/01_distributed_notebook.ipynb in a real Jupyter kernel, where notebook_launcher trains on 2 processes."""

import json
import re
import shutil

import pytest
from helpers import REPO, run_launch
from notebooks import output_text, outputs, python3_kernel

SCRIPT = REPO / "examples" / "distrib.py"
NOTEBOOK = REPO / "nbs" / "01_distributed_notebook.ipynb"
ACCURACY_LINE = re.compile(r"validation accuracy: ([0-9.]+)")

pytest.importorskip("sklearn", reason="the digits data ships with scikit-learn: pip install -e .[examples]")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("flags", [(), pytest.param(("--use_fsdp",), marks=pytest.mark.long)], ids=["ddp", "fsdp"])
def test_distrib_script_trains_on_2_processes(tmp_path, flags):
    data_dir = tmp_path / "data"
    proc = run_launch(SCRIPT, "--data_dir", str(data_dir), nproc=2, flags=flags, timeout=240)

    found = ACCURACY_LINE.findall(proc.stdout)
    assert len(found) == 1, f"expected one 'validation accuracy:' line (main process only):\n{proc.stdout}"
    assert float(found[0]) >= 0.97, proc.stdout
    assert proc.stdout.count("trained on 2 processes") == 1, proc.stdout
    assert (data_dir / "digits.npz").exists(), "rank0_first did not cache the data"
    assert "Traceback" not in proc.stderr, proc.stderr


# appended to the notebook by the test: what `notebook_launcher` returned, machine-readable
REPORT_CELL = 'import json; print("RESULT " + json.dumps({k: result[k] for k in ("world_size", "rank", "accuracy")}))'


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_distributed_notebook_trains_on_2_processes_in_a_kernel(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    kernel_name = python3_kernel(tmp_path, monkeypatch, one_thread=True)
    workdir = tmp_path / "nbs"
    workdir.mkdir()
    nb_path = workdir / NOTEBOOK.name
    shutil.copy(NOTEBOOK, nb_path)
    nb = nbformat.read(nb_path, as_version=4)
    assert not any(cell.get("outputs") for cell in nb.cells if cell.cell_type == "code"), "commit the notebook with outputs cleared"
    nb.cells.append(nbformat.v4.new_code_cell(REPORT_CELL))

    nbclient.NotebookClient(nb, timeout=240, kernel_name=kernel_name,
                            resources={"metadata": {"path": str(workdir)}}).execute()

    errors = outputs(nb, "error")
    assert not errors, "\n".join(f"{e.ename}: {e.evalue}" for e in errors)
    stderr = "".join(o.text for o in outputs(nb, "stream") if o.name == "stderr")
    assert "Traceback" not in stderr, stderr
    text = "".join(output_text(o) for kind in ("stream", "execute_result") for o in outputs(nb, kind))
    reports = re.findall(r"^RESULT (.*)$", text, flags=re.M)
    assert len(reports) == 1, text
    result = json.loads(reports[0])
    assert result["world_size"] == 2 and result["rank"] == 0, result
    assert result["accuracy"] >= 0.97, result
    assert "trained on 2 processes; this result comes from rank 0" in text, text
    found = ACCURACY_LINE.findall(text)
    assert found and float(found[-1]) >= 0.97, text
    assert len(re.findall(r"^epoch \d+: train_loss", text, flags=re.M)) == 8, "the recorder's 8 epochs did not come back"
