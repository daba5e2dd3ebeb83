"""The how-to pages' code: every fence in docs/*.md is closed, and every ```python block is either an include of a
section of a docs/examples/ script (which tests/test_docs_examples.py runs) or marked `<!-- not run: reason -->` on
the line before it. A block pasted into a page cannot rot unseen: its code lives in a script the tests run."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^(\s*)```(.*)$")
INCLUDE = re.compile(r'^--8<-- "(docs/examples/[\w.-]+\.py):([\w-]+)"$')
NOT_RUN = re.compile(r"^<!-- not run: .+ -->$")


def fenced_blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """(line of the opening fence, its info string, the block's lines) for each fenced block; AssertionError naming
    the line when a fence is never closed (a fence with an info string inside a block is content, not a close)."""
    blocks, opened = [], None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if opened is None:
            if match:
                opened = (number, match.group(2).strip(), [])
        elif match and not match.group(2).strip():
            blocks.append(opened)
            opened = None
        else:
            assert not match, (f"line {number}: a ```{match.group(2).strip()} fence inside the block opened at line "
                               f"{opened[0]}: that block is never closed")
            opened[2].append(line)
    assert opened is None, f"the block opened at line {opened[0]} is never closed"
    return blocks


def section(path: Path, name: str) -> list[str]:
    """The lines between `# --8<-- [start:name]` and `# --8<-- [end:name]` in path."""
    lines = path.read_text().splitlines()
    start, end = f"# --8<-- [start:{name}]", f"# --8<-- [end:{name}]"
    stripped = [line.strip() for line in lines]
    assert stripped.count(start) == 1 and stripped.count(end) == 1, f"{path.name}: no single section {name!r}"
    return lines[stripped.index(start) + 1:stripped.index(end)]


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_page_python_blocks_are_tested_examples(page):
    lines = page.read_text().splitlines()
    for number, info, body in fenced_blocks(page.read_text()):
        if info.split()[:1] != ["python"]:
            continue
        where = f"{page.name}:{number}"
        includes = [INCLUDE.match(line.strip()) for line in body if line.strip()]
        if includes and all(includes):
            for include in includes:
                example = ROOT / include.group(1)
                assert example.is_file(), f"{where}: {include.group(1)} does not exist"
                assert section(example, include.group(2)), f"{where}: section {include.group(2)!r} is empty"
            continue
        assert not any(includes), f"{where}: a block mixes snippet includes with code"
        ast.parse("\n".join(body), filename=where)   # a block shown as it is must at least be Python
        assert number > 1 and NOT_RUN.match(lines[number - 2].strip()), (
            f"{where}: a ```python block that no test runs: put its code in a docs/examples/ script between "
            f'`# --8<-- [start:NAME]` / `# --8<-- [end:NAME]` and include it (--8<-- "docs/examples/X.py:NAME"), '
            f"or mark it `<!-- not run: reason -->` on the line before")


def test_an_unclosed_block_is_found():
    with pytest.raises(AssertionError, match="opened at line 1"):
        fenced_blocks("```python\nx = 1\n\nprose\n```python\ny = 2\n")
    assert [b[0] for b in fenced_blocks("```python\nx = 1\n```\n\n```bash\nls\n```\n")] == [1, 5]
