"""Every rank, once all have started, prints 300 lines as fast as it can: `rank <r> line <n> xxx...`, two lines per
`print` (one string holding both: its first newline, and then its own, end them)."""

from cadence.distributed import env, ops

env.setup_distrib()
ops.wait_for_everyone()
for n in range(0, 300, 2):
    print(f"rank {env.rank()} line {n} {'x' * 200}\nrank {env.rank()} line {n + 1} {'x' * 200}")
