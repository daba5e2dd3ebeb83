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


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """cadence module -> the cadence modules it imports anywhere in the file: module level, inside functions,
    under `if TYPE_CHECKING:` (a type checker follows those too). `from .x import name` counts as importing
    the module `x.name` when that is a module, else `x`."""
    files = {_module_name(p): p for p in (ROOT / "cadence").rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
                targets.update(f"{module}.{a.name}" if f"{module}.{a.name}" in files else module for a in node.names)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter; counter += 1; stack.append(root); on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop(); on_stack.discard(member); component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter; counter += 1; stack.append(child); on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_the_circle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _circles(graph) == [["a", "b", "c"]]


def test_no_import_circle_between_cadence_modules():
    """Every import counts, a function-level one too: a circle means no module can be read without the others."""
    circles = _circles(_import_graph())
    assert not circles, "import circles (break each so the dependency points one way): " + "; ".join(
        " <-> ".join(c) for c in circles)


def test_dependencies_point_one_way():
    """trainer <- callbacks -> distributed: trainer/ never imports callbacks/ (not even inside a function: the
    Learner methods for callback features are attached by cadence/callbacks/learner_methods.py); distributed/
    never imports trainer/ or callbacks/; nothing below the package's top imports the re-exporting `cadence`."""
    graph = _import_graph()
    for module, targets in graph.items():
        if module.startswith("cadence.trainer."):
            assert not {t for t in targets if t.startswith("cadence.callbacks")}, f"{module} imports callbacks"
        if module.startswith("cadence.distributed."):
            bad = {t for t in targets if t.startswith(("cadence.trainer", "cadence.callbacks"))}
            assert not bad, f"{module} imports {bad}"
        if module not in ("cadence", "cadence.cli"):
            assert "cadence" not in targets, f"{module} imports the whole package (import from the module itself)"


def test_learner_methods_for_callback_features_are_attached():
    for name in ("to_fp16", "to_bf16", "to_fp32", "distrib_ctx", "to_distributed", "detach_distributed", "save_state",
                 "load_state", "save_model", "no_bar", "parallel_ctx"):
        assert getattr(cadence.Learner, name).__qualname__ == f"Learner.{name}", name


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
