"""Which rank `cadence launch` blames: a rank killed outright (SIGKILL records no error) is the cause, not the
rank whose collective then failed on the connection its death closed."""

import json
import re
import time

import pytest

from tests.helpers import run_launch


@pytest.mark.slow
def test_a_sigkilled_rank_is_the_cause_not_the_peer_whose_collective_failed():
    # the agent checks the workers every second here, so that rank 0's error is recorded by the time it finds
    # rank 1 gone (the order seen at the default 0.1 s): both ranks are failures, and rank 1 comes first
    proc = run_launch("blame_sigkill.py", flags=("--monitor_interval", "1"), check=False, timeout=180)
    assert "KILLING" in proc.stdout, proc.stderr
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("cadence launch:")]
    assert lines[0] == "cadence launch: rank 1 failed: killed by SIGKILL", proc.stderr
    assert re.fullmatch(r"cadence launch: rank 0 also stopped: RuntimeError: .*Connection (reset|closed) by peer.*",
                        lines[1]), proc.stderr
    assert "rank 0 failed" not in proc.stderr


def test_a_peer_failure_comes_after_a_rank_the_agent_stopped_and_a_real_error_before_both(tmp_path, capsys):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from cadence.distributed.failure_report import report_failure

    def raised(rank: int, headline: str, peer_failure: bool) -> ProcessFailure:
        path = tmp_path / f"error{rank}.json"
        path.write_text(json.dumps({"message": {"message": headline, "extraInfo": {
            "py_callstack": f"Traceback (most recent call last):\n{headline}\n", "timestamp": str(int(time.time())),
            "time_ns": time.time_ns(), "peer_failure": peer_failure}}}))
        return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=1, error_file=str(path))

    killed = ProcessFailure(local_rank=1, pid=101, exitcode=-9, error_file=str(tmp_path / "none.json"))
    peer = raised(0, "RuntimeError: Read error: Connection reset by peer", True)
    assert report_failure({0: peer, 1: killed}) == 1
    assert capsys.readouterr().err.splitlines() == [
        "cadence launch: rank 1 failed: killed by SIGKILL",
        "cadence launch: rank 0 also stopped: RuntimeError: Read error: Connection reset by peer"]

    stopped = ProcessFailure(local_rank=1, pid=101, exitcode=-15, error_file=str(tmp_path / "none.json"))
    assert report_failure({0: peer, 1: stopped, 2: raised(2, "ValueError: bad batch", False)}) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "cadence launch: rank 2 failed:" and "ValueError: bad batch" in err
    assert err[-2:] == ["cadence launch: rank 1 also stopped: killed by SIGTERM",
                        "cadence launch: rank 0 also stopped: RuntimeError: Read error: Connection reset by peer"]
