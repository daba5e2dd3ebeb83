"""Package metadata and the public API."""

import ast
import configparser
import os
import subprocess
import sys
from pathlib import Path

import cadence

ROOT = Path(__file__).parent.parent


def test_settings_ini_version_matches_package():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "settings.ini")
    assert cfg["DEFAULT"]["version"] == cadence.__version__
    assert cfg["DEFAULT"]["lib_name"] == "cadence"


def test_public_api_is_exported():
    for name in cadence.__all__:
        assert hasattr(cadence, name), name


def _imports(path: Path, top_level_only: bool) -> set[str]:
    """Modules imported by a file (relative imports resolved against the cadence package)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            found.add(f"{base}.{node.module}" if node.level else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_dependencies_point_one_way():
    """trainer/ imports neither callbacks/ nor distributed/ at import; distributed/ never imports the others."""
    for path in (ROOT / "cadence" / "trainer").glob("*.py"):
        bad = {m for m in _imports(path, top_level_only=True) if m.startswith(("cadence.callbacks", "cadence.distributed"))}
        assert not bad, f"{path.name} imports {bad} at module level"
    for path in (ROOT / "cadence" / "distributed").glob("*.py"):
        bad = {m for m in _imports(path, top_level_only=False) if m.startswith(("cadence.trainer", "cadence.callbacks"))}
        assert not bad, f"{path.name} imports {bad}"


def test_import_cadence_does_not_import_optional_extras_or_what_only_some_runs_need():
    # rich draws only on a terminal, yaml is read only by configs and the CSV tracker: importing them
    # up front cost ~0.1 s of every start, launched workers included
    code = ("import sys, cadence; print([m for m in ('deepspeed', 'torch_xla', 'wandb', 'tensorboard', 'matplotlib', "
            "'rich', 'yaml') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_a_fit_logged_to_a_file_prints_plain_lines_without_importing_rich(tmp_path):
    code = ("import sys, torch; from torch import nn; from cadence import Learner, DataLoaders\n"
            "data = [(torch.randn(4, 3), torch.randint(0, 2, (4,)))] * 3\n"
            "Learner(DataLoaders(data, data, device='cpu'), nn.Linear(3, 2), loss_func=nn.CrossEntropyLoss()).fit(2)\n"
            "print('rich' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120, env=env)
    lines = out.stdout.splitlines()
    assert [line.split(" | ")[0] for line in lines[:2]] == ["epoch 0", "epoch 1"] and "train_loss" in lines[0]
    assert lines[-1] == "False"
