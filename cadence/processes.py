"""Whether a process is still there, by its pid (this machine's): what tells a dead writer's leftovers from a live one's.

>>> process_exists(os.getpid())
True
"""

from __future__ import annotations

import os


def process_exists(pid: int) -> bool:
    """True while a process of this pid exists on this machine (another user's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
