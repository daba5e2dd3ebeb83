"""Shared helpers for the tests that execute notebooks in a real Jupyter kernel (nbclient)."""

from __future__ import annotations

import sys
from pathlib import Path


def python3_kernel(tmp_path: Path, monkeypatch, one_thread: bool = False) -> str:
    """The name of a kernel that runs this interpreter, installing a kernelspec into a temp prefix if needed.
    `one_thread`: the kernel's own OMP/MKL threads set to 1 (a launcher in it gives each worker its share)."""
    if one_thread:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            monkeypatch.setenv(var, "1")
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        argv0 = KernelSpecManager().get_kernel_spec("python3").argv[0]
    except NoSuchKernel:
        argv0 = None
    # jupyter_client replaces a bare "python" with sys.executable; an absolute path must be ours
    if argv0 not in ("python", "python3", sys.executable):
        from ipykernel.kernelspec import install

        prefix = tmp_path / "kernel-prefix"
        install(kernel_name="python3", prefix=str(prefix))
        monkeypatch.setenv("JUPYTER_PATH", str(prefix / "share" / "jupyter"))  # searched before every other dir
        assert KernelSpecManager().get_kernel_spec("python3").argv[0] in ("python", sys.executable)
    return "python3"


def outputs(nb, output_type: str) -> list:
    """Every output of `output_type` ("stream", "error", "execute_result", "display_data") in the code cells."""
    return [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs
            if out.output_type == output_type]


def output_text(out) -> str:
    """The text of a stream output, or the text/plain of a result."""
    if out.output_type == "stream":
        return out.text
    return out.get("data", {}).get("text/plain", "")
