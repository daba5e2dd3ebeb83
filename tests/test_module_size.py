"""The shape of the code: every module is small enough for a newcomer to read as one idea."""

from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "cadence"
MAX_LINES = 500


def test_no_module_over_500_lines():
    sizes = {str(p.relative_to(PACKAGE.parent)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    too_long = {path: n for path, n in sorted(sizes.items()) if n > MAX_LINES}
    assert len(sizes) > 50, f"found only {len(sizes)} modules under {PACKAGE}"
    assert not too_long, (f"modules over {MAX_LINES} lines (split each by concern, see docs/design.md): "
                          f"{too_long}")
