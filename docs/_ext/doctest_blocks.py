"""Griffe extension: the `>>>` examples in cadence's docstrings render as code blocks in the API reference.

Docstrings here are plain text with doctest-style examples, as `help()` shows them; Markdown would run
those lines together into a paragraph. Each run of `>>>`/`...` lines and the output lines after it
(up to a blank line) becomes a fenced `pycon` block.
"""

from __future__ import annotations

import griffe


def fence_doctests(text: str) -> str:
    out, in_block = [], False
    for line in text.splitlines():
        stripped = line.lstrip()
        if not in_block and stripped.startswith(">>>"):
            indent = line[: len(line) - len(stripped)]
            out.append(f"{indent}```pycon")
            in_block = True
        elif in_block and not stripped:
            out.append(f"{indent}```")
            in_block = False
        out.append(line)
    if in_block:
        out.append(f"{indent}```")
    return "\n".join(out)


class DoctestBlocks(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_doctests(obj.docstring.value)
