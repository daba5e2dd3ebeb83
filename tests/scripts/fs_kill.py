"""Kill this process (SIGKILL) just before a chosen filesystem call made inside a chosen method.

Used by the scripts that test and benchmark what a kill during a save leaves behind:
`kill_at_filesystem_op("rename:2", Checkpoint, "_save")` kills before the second `os.rename` made
while `Checkpoint._save` runs, or by a checkpoint writer thread (which deletes pruned checkpoints after
the save returned). Kinds: rename, replace, unlink, rmdir (shutil.rmtree goes through the last two),
save (torch.save), any.
"""

import os
import signal
import threading

import torch


def kill_at_filesystem_op(spec: str, owner: type, method: str) -> dict[str, int]:
    """Install the counting wrappers; returns the live counts per kind (and "any")."""
    kind, n = spec.split(":")
    counts, inside = {}, [False]

    def counted(name, fn):
        def op(*args, **kwargs):
            if inside[0] or threading.current_thread().name == "checkpoint writer":
                for key in (name, "any"):
                    counts[key] = counts.get(key, 0) + 1
                if counts.get(kind) == int(n):
                    os.kill(os.getpid(), signal.SIGKILL)
            return fn(*args, **kwargs)
        return op

    for module, name in ((os, "rename"), (os, "replace"), (os, "unlink"), (os, "rmdir"), (torch, "save")):
        setattr(module, name, counted("save" if module is torch else name, getattr(module, name)))
    original = getattr(owner, method)

    def watched(*args, **kwargs):
        inside[0] = True
        try:
            return original(*args, **kwargs)
        finally:
            inside[0] = False
    setattr(owner, method, watched)
    return counts
