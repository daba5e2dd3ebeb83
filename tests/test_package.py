"""Package metadata and the public API."""

import ast
import configparser
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


def test_import_cadence_does_not_import_optional_extras():
    code = ("import sys, cadence; "
            "print([m for m in ('deepspeed', 'torch_xla', 'wandb', 'tensorboard', 'matplotlib') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"
