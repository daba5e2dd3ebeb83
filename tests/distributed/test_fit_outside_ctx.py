"""A launched script whose fit runs outside `distrib_ctx` trains alone on every process, on all the data and without
the launcher's settings: the first process says so, once; inside `distrib_ctx` nothing is said."""

import pytest

from helpers import run_launch

MESSAGE = "this process is one of 2 launched, and the fit runs outside distrib_ctx"


@pytest.mark.slow
def test_a_fit_outside_distrib_ctx_in_a_launched_process_is_warned_once():
    proc = run_launch("fit_outside_ctx.py", "alone", timeout=180)
    assert proc.stderr.count(MESSAGE) == 1, proc.stderr
    assert proc.stdout.count("STEPS 4") == 2                 # each process took every batch alone
    proc = run_launch("fit_outside_ctx.py", "ctx", timeout=180)
    assert MESSAGE not in proc.stderr and proc.stdout.count("STEPS 2") == 2, proc.stdout + proc.stderr
