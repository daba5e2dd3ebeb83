"""Every rank, once all have started, prints 300 lines as fast as it can: `rank <r> line <n> xxx...` (one `print`
each)."""

from cadence.distributed import env, ops

env.setup_distrib()
ops.wait_for_everyone()
for n in range(300):
    print(f"rank {env.rank()} line {n}", "x" * 200)
