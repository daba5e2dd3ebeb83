"""A one-machine launch listens on the loopback interface only: its rendezvous store and gloo's connections.

torch's TCPStore server listens on every interface whatever MASTER_ADDR says, so anyone who can reach
the machine could connect to a one-machine run's store and write the keys its workers read. The
launcher therefore opens that store itself, on a socket bound to 127.0.0.1 (TCPStore's
`master_listen_fd`) and multi-tenant: the elastic agent's store on the same port, and the workers'
(which connect to the agent's), are this server. gloo's own connections get the loopback interface
(GLOO_SOCKET_IFNAME) unless one is set. The notebook launcher does the same: the kernel hosts the
store, every worker connects to it (TORCHELASTIC_USE_AGENT_STORE, as under the elastic agent).

With `--rdzv_backend c10d` torch's rendezvous opens a second store for the workers on a port of its
choosing, on every interface; the default static rendezvous has no such store.

>>> with loopback_store(port, timeout_s=300):
...     torchrun.run(agent_args)
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Iterator

import torch.distributed as dist

__all__ = ["loopback_store", "loopback_interface"]


@contextlib.contextmanager
def loopback_store(port: int, timeout_s: float, flag: str = "--main_process_port") -> Iterator[dist.TCPStore]:
    """A TCPStore server on 127.0.0.1:`port` only, shared (multi-tenant) with every TCPStore this process opens on
    that port while the block runs. ValueError naming the port (set by `flag`) when it cannot be bound.

    >>> with loopback_store(29500, 60) as store:
    ...     store.set("key", "value")
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(socket.SOMAXCONN)
    except OSError as e:
        sock.close()
        raise ValueError(f"{flag} {port} cannot be used on this machine ({e.strerror}): pick another port, or leave "
                         f"{flag} out to get a free one") from None
    try:
        store = dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=False, multi_tenant=True, master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()   # the store's server owns the listening socket now, and closes it
    try:
        yield store
    finally:
        del store


def loopback_interface() -> str | None:
    """The name of the loopback network interface ("lo" on Linux, "lo0" on macOS), None when there is none.

    >>> loopback_interface()
    'lo'
    """
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n in ("lo", "lo0")), next((n for n in names if n.startswith("lo")), None))


def gloo_interface_env(one_machine: bool) -> dict[str, str | None]:
    """GLOO_SOCKET_IFNAME for the workers: the loopback interface on one machine, unless the user chose one."""
    if not one_machine or os.environ.get("GLOO_SOCKET_IFNAME"):
        return {}
    name = loopback_interface()
    return {"GLOO_SOCKET_IFNAME": name} if name else {}
