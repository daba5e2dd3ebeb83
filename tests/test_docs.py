"""The documentation: `mkdocs build --strict` builds the site (tutorials executed, API reference from the
docstrings), a real headless Chromium renders its pages, every public name is documented with an example,
and the docstring examples that can run here do (doctest)."""

from __future__ import annotations

import doctest
import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import cadence

ROOT = Path(__file__).resolve().parents[1]


def _chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        if path := shutil.which(name):
            return path
    pytest.fail("no chromium on PATH: `make chromium` installs it (apt-get install chromium)")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site as `make docs` builds it, into a temporary directory."""
    pytest.importorskip("mkdocs", reason="the docs extra: pip install -e .[docs]")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    env.pop("CADENCE_DOCS_NOTEBOOKS", None)  # the strict build executes the tutorials
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not re.search(r"^WARNING\s+-", proc.stderr, re.M), proc.stderr   # MkDocs' own (a kernel's log lines aside)
    return out


@pytest.fixture(scope="module")
def served(site):
    """The site over HTTP on a free local port, as a browser reads it (directory URLs, search index)."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def _dom(url: str, tmp_path: Path) -> str:
    """The page's DOM after its scripts ran, from a real headless Chromium."""
    proc = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           f"--user-data-dir={tmp_path / 'chromium-profile'}", "--virtual-time-budget=5000",
                           "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _title(dom: str) -> str:
    return re.search(r"<title>(.*?)</title>", dom, re.S).group(1).strip()


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_home_page_renders_in_chromium_with_navigation_and_code(served, tmp_path):
    dom = _dom(served + "/", tmp_path)
    assert _title(dom) == "cadence"
    nav = dom[dom.index('class="md-nav md-nav--primary"'):dom.index('class="md-content"')]   # the left sidebar
    for entry in ("Tutorials", "Distributed (DDP)", "FSDP2", "DeepSpeed ZeRO", "XLA", "Model parallel",
                  "Coming from Accelerate", "API reference", "Design notes"):
        assert entry in nav, entry
    code = re.search(r'<div class="highlight">.*?</div>', dom, re.S).group(0)
    assert "distrib_ctx" in re.sub(r"<[^>]+>", "", code)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_api_page_renders_the_learner_from_its_docstring(served, tmp_path):
    dom = _dom(served + "/api/learner/", tmp_path)
    assert _title(dom).startswith("Learner") or _title(dom).startswith("The Learner"), _title(dom)
    text = re.sub(r"<[^>]+>", "", dom)
    assert 'id="cadence.Learner"' in dom
    assert cadence.Learner.__doc__.splitlines()[0].strip().replace("`", "") in text   # the docstring's summary line
    for anchor in ("cadence.Learner.fit_one_cycle", "cadence.Learner.get_preds",   # from the mixins
                   "cadence.callbacks.learner_methods.to_fp16", "cadence.callbacks.learner_methods.distrib_ctx"):
        assert f'id="{anchor}"' in dom, anchor
    assert 'class="highlight"' in dom and "&gt;&gt;&gt;" in dom   # a docstring example, as a code block
    assert "md-nav" in dom


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_tutorials_render_with_their_executed_outputs(site):
    quickstart = (site / "tutorials" / "00_quickstart" / "index.html").read_text()
    assert re.search(r"validation accuracy: 0\.9[7-9]|validation accuracy: 1\.0", quickstart), "no executed output"
    assert "data:image/png;base64" in quickstart, "lr_find's plot is missing"
    distributed = (site / "tutorials" / "01_distributed_notebook" / "index.html").read_text()
    assert "trained on 2 processes" in distributed


def _api_names() -> set[str]:
    return {m for page in (ROOT / "docs" / "api").glob("*.md")
            for m in re.findall(r"^::: cadence\.(\w+)$", page.read_text(), re.M)}


def test_every_public_name_is_in_the_api_reference():
    assert set(cadence.__all__) - {"__version__"} == _api_names()


def _public_objects():
    return [(name, getattr(cadence, name)) for name in cadence.__all__ if name != "__version__"]


@pytest.mark.parametrize("name,obj", _public_objects(), ids=[n for n, _ in _public_objects()])
def test_public_name_has_a_summary_line_and_an_example(name, obj):
    doc = obj.__doc__ if callable(obj) or isinstance(obj, type) else None
    assert doc and doc.strip(), f"cadence.{name} has no docstring"
    summary = doc.strip().splitlines()[0]
    assert len(summary) <= 120 and summary.rstrip().endswith((".", ":", ")")), f"cadence.{name}: {summary!r}"
    assert ">>>" in doc, f"cadence.{name}'s docstring has no example"


# Public names whose docstring examples show usage in a context this test does not build, so doctest does
# not run them (their behaviour is tested elsewhere); every other public docstring's examples run below.
_PROCESSES = "needs several processes (the values shown are rank 0's on 2)"
_PROGRESS = "trains with the progress display on: the epoch lines carry times that vary"
_OWN = "names the user's own objects (data, a model class, a file)"
_REPR = "shows a call without the object's printed form"
_SERVICE = "writes to a tracking service or its files"
NOT_DOCTESTED = {
    "Learner": _PROGRESS, "Callback": _PROGRESS, "Recorder": _PROGRESS, "BnFreeze": _PROGRESS,
    "ParamScheduler": _PROGRESS, "EarlyStopping": _PROGRESS, "ReduceLROnPlateau": _PROGRESS, "SaveModel": _PROGRESS,
    "TerminateOnNaN": _PROGRESS, "Checkpoint": _PROGRESS, "MixUp": _PROGRESS, "CutMix": _OWN, "before_batch_cb": _PROGRESS,
    "load_learner": _OWN, "DataLoaders": _OWN, "Perplexity": _OWN, "accuracy_multi": _OWN, "Dice": _OWN,
    "DummyScheduler": _OWN, "find_executable_batch_size": _OWN, "ProfileKwargs": _OWN, "init_empty_weights": _OWN,
    "infer_auto_device_map": _OWN, "dispatch_model": _OWN, "load_checkpoint_and_dispatch": _OWN, "to_detach": _OWN,
    "InitProcessGroupKwargs": _OWN, "combine_scheds": _OWN,
    "SumMetric": _REPR, "AccumMetric": _REPR, "PearsonCorrCoef": _REPR, "RocAuc": _REPR,
    "DistributedDataParallelKwargs": _REPR, "GradScalerKwargs": _REPR, "ProjectConfiguration": _REPR,
    "DataLoaderConfiguration": _REPR, "DeepSpeedPlugin": _REPR, "FullyShardedDataParallelPlugin": _REPR,
    "GradientAccumulationPlugin": _REPR,
    "DistributedDL": _PROCESSES, "broadcast": _PROCESSES, "gather": _PROCESSES, "gather_for_metrics": _PROCESSES,
    "local_main_process_first": _PROCESSES, "main_print": _PROCESSES, "main_process_first": _PROCESSES,
    "pad_across_processes": _PROCESSES, "rank0_first": _PROCESSES, "reduce": _PROCESSES, "debug_launcher": _PROCESSES,
    "CSVTracker": _SERVICE, "TensorBoardTracker": _SERVICE, "Tracker": _SERVICE, "WandbTracker": _SERVICE,
}


def _doctest_namespace() -> dict:
    """What the examples may use: torch, nn, F, every public name, and a small `dls`, `model` and `learn`
    (4 batches of 8 items, 4 features, 2 classes; the progress display removed and the rows it leaves to
    `learn.logger` dropped, so fits print nothing)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    data = [(torch.randn(8, 4), torch.randint(0, 2, (8,))) for _ in range(4)]
    dls = cadence.DataLoaders(data, data, device="cpu")
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    learn = cadence.Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=cadence.accuracy)
    learn.remove_cbs([cb for cb in learn.cbs if isinstance(cb, cadence.ProgressCallback)])
    learn.logger = lambda row: None
    return {"torch": torch, "nn": nn, "F": F, **{n: getattr(cadence, n) for n in cadence.__all__},
            "dls": dls, "model": model, "learn": learn}


def test_not_doctested_names_are_public():
    assert set(NOT_DOCTESTED) <= set(cadence.__all__)


@pytest.mark.parametrize("name", [n for n, _ in _public_objects() if n not in NOT_DOCTESTED])
def test_docstring_examples_run(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # examples that write files write here
    tests = doctest.DocTestFinder(recurse=False).find(getattr(cadence, name), name, globs=_doctest_namespace())
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report = []
    for test in tests:
        runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)
    assert runner.tries > 0, f"cadence.{name} has no example doctest could find"


def _readme_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"<!-- tests/test_docs.py runs this block -->\n```python\n(.*?)```", text, re.S)


def test_readme_has_two_runnable_quickstarts_of_about_twenty_lines():
    blocks = _readme_blocks()
    assert len(blocks) == 2 and all(len(b.splitlines()) <= 30 for b in blocks)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", [0, 1], ids=["learner", "accelerator"])
def test_readme_quickstart_trains(index, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_readme_blocks()[index])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    accuracy = float(re.findall(r"validation accuracy: ([0-9.]+)", proc.stdout)[-1])
    assert accuracy >= 0.85, proc.stdout   # the rule x0 + x1 > 0 is learnt; chance is 0.5
    if index == 0:
        assert (tmp_path / "models" / "quickstart" / "model.safetensors").is_file()
