"""The user-facing examples run green: examples/train_digits.py as a script, nbs/00_quickstart.ipynb in a real kernel."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from notebooks import output_text as _text
from notebooks import outputs as _outputs
from notebooks import python3_kernel as _python3_kernel

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_digits.py"
NOTEBOOK = ROOT / "nbs" / "00_quickstart.ipynb"
ACCURACY_LINE = re.compile(r"validation accuracy: ([0-9.]+)")

pytest.importorskip("sklearn", reason="the digits data ships with scikit-learn: pip install -e .[examples]")


def _one_thread_env() -> dict[str, str]:
    """The notebook's tiny model gains nothing from intra-op threads, and on a busy machine loses a lot to them
    (the script sets one thread itself: `--threads 1`)."""
    return {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def test_train_digits_script_reaches_97_percent(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    found = ACCURACY_LINE.findall(proc.stdout)
    assert found, f"no 'validation accuracy:' line in the output:\n{proc.stdout}"
    assert float(found[-1]) >= 0.97, proc.stdout


@pytest.mark.slow
def test_quickstart_notebook_runs_in_a_kernel(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    kernel_name = _python3_kernel(tmp_path, monkeypatch)
    for var, value in _one_thread_env().items():
        monkeypatch.setenv(var, value)
    workdir = tmp_path / "nbs"
    workdir.mkdir()
    nb_path = workdir / NOTEBOOK.name
    shutil.copy(NOTEBOOK, nb_path)  # the notebook saves into ./models: keep that out of the repository
    nb = nbformat.read(nb_path, as_version=4)

    nbclient.NotebookClient(nb, timeout=120, kernel_name=kernel_name, resources={"metadata": {"path": str(workdir)}}).execute()

    errors = _outputs(nb, "error")
    assert not errors, "\n".join(f"{e.ename}: {e.evalue}" for e in errors)
    stderr = "".join(o.text for o in _outputs(nb, "stream") if o.name == "stderr")
    assert "Traceback" not in stderr, stderr
    text = "".join(_text(o) for kind in ("stream", "execute_result") for o in _outputs(nb, kind))
    found = ACCURACY_LINE.findall(text)
    assert found, "the notebook printed no 'validation accuracy:' line"
    assert float(found[-1]) >= 0.97, text
    assert any("image/png" in o.get("data", {}) for o in _outputs(nb, "display_data")), "lr_find drew no plot"
    assert (workdir / "models" / "digits" / "model.safetensors").exists()
    after_load = re.findall(r"after load:\s+([0-9.]+)", text)
    assert after_load and float(after_load[0]) >= 0.97, text
