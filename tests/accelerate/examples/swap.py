"""Copy Accelerate's examples (upstream/) with the import swapped: `accelerate` -> `cadence`, nothing else.

`from accelerate import X` -> `from cadence import X`, `from accelerate.utils import X` ->
`from cadence.utils import X` (and `.logging`, `.local_sgd`, ...), `import accelerate` -> `import cadence`.
Only import lines change; `swap` checks that and returns how many lines it changed per script.

    python tests/accelerate/examples/swap.py /tmp/swapped      # writes /tmp/swapped/nlp_example.py, by_feature/...
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

UPSTREAM = Path(__file__).parent / "upstream"
IMPORT = re.compile(r"^(\s*)(from|import)\s+accelerate(?=[\s.])")


def swap_line(line: str) -> str:
    return IMPORT.sub(lambda m: f"{m.group(1)}{m.group(2)} cadence", line)


def swap_source(text: str) -> tuple[str, int]:
    """The script with every `accelerate` import made a `cadence` one, and the number of lines changed."""
    lines = text.splitlines(keepends=True)
    swapped = [swap_line(line) for line in lines]
    changed = sum(a != b for a, b in zip(lines, swapped))
    leftover = [line for line in swapped if re.match(r"\s*(from|import)\s+accelerate\b", line)]
    if leftover:
        raise ValueError(f"import lines left unswapped: {leftover}")
    return "".join(swapped), changed


def swap(out: Path, library: str = "cadence") -> dict[str, int]:
    """Write every upstream script under `out` (same relative paths), swapped unless `library == "accelerate"`."""
    changes = {}
    for src in sorted(UPSTREAM.rglob("*.py")):
        rel = src.relative_to(UPSTREAM)
        text = src.read_text()
        if library == "cadence":
            text, changes[str(rel)] = swap_source(text)
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(text)
    return changes


if __name__ == "__main__":
    for name, n in swap(Path(sys.argv[1])).items():
        print(f"{name}: {n} import line(s) swapped")
