"""A one-machine run listens on 127.0.0.1 only: `cadence launch`'s and the notebook launcher's rendezvous store and
gloo's connections (torch's TCPStore alone listens on every interface, where anyone on the network could write the
keys the workers read). What is listening is read from the kernel's socket tables while the workers run."""

import json
import socket

import pytest

from cadence.distributed.loopback import loopback_store
from cadence.distributed.notebook import notebook_launcher
from helpers import run_launch

WORKER = '''
import json, os, sys
import torch, torch.distributed as dist

def listening():
    """(address, port) of every listening TCP socket of this machine, from /proc/net/tcp and tcp6."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A":
                addr, port = local.split(":")
                out.append((addr, int(port, 16)))
    return out

def report(path):
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1))          # every rank's gloo connections are up
    if dist.get_rank() == 0:
        seen = {"port": int(os.environ["MASTER_PORT"]), "listening": listening(),
                "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME")}
        open(path, "w").write(json.dumps(seen))
    dist.barrier()
'''

LOOPBACK_V4 = "0100007F"   # 127.0.0.1 as /proc/net/tcp writes it
WILDCARDS = {"00000000", "0" * 32}


def _store_listeners(seen: dict) -> set[str]:
    return {addr for addr, port in seen["listening"] if port == seen["port"]}


@pytest.mark.slow
def test_launch_store_listens_on_loopback_only(tmp_path):
    script = tmp_path / "report.py"
    script.write_text(WORKER + "\nreport(sys.argv[1])\n")
    out = tmp_path / "seen.json"
    run_launch(script, str(out), nproc=2, timeout=180)
    seen = json.loads(out.read_text())
    assert _store_listeners(seen) == {LOOPBACK_V4}, seen
    assert seen["gloo_ifname"] in ("lo", "lo0")


@pytest.mark.slow
def test_notebook_launcher_store_listens_on_loopback_only(tmp_path):
    namespace = {"__name__": "__main__"}
    exec(WORKER, namespace)
    out = tmp_path / "seen.json"
    notebook_launcher(namespace["report"], args=(str(out),), num_processes=2)
    seen = json.loads(out.read_text())
    assert _store_listeners(seen) == {LOOPBACK_V4}, seen
    assert not _store_listeners(seen) & WILDCARDS


def test_busy_port_is_refused_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=rf"--main_process_port {port} cannot be used"):
            with loopback_store(port, 10):
                pass


def test_store_serves_clients_on_loopback():
    import datetime

    import torch.distributed as dist

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with loopback_store(port, 10) as store:
        client = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=10))
        client.set("written by a worker", "1")
        assert store.get("written by a worker") == b"1"


def _machine_address() -> str | None:
    """This machine's address on a network interface (not loopback), or None when it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.254", 9))     # no packet is sent: the kernel picks the outgoing interface
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


@pytest.mark.slow
def test_one_machine_at_its_network_address_still_runs(tmp_path):
    """`--main_process_ip` set to this machine's own network address (a config carried over from a multi-machine
    run): the store listens where the workers connect, as torch's does (on 127.0.0.1 they waited for the timeout)."""
    address = _machine_address()
    if address is None:
        pytest.skip("this machine has no network interface besides loopback")
    script = tmp_path / "report.py"
    script.write_text(WORKER + "\nreport(sys.argv[1])\n")
    out = tmp_path / "seen.json"
    run_launch(script, str(out), nproc=2, timeout=120, flags=("--main_process_ip", address, "--timeout", "60"))
    assert json.loads(out.read_text())["port"] > 0
