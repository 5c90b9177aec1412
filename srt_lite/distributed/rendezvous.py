"""Where the tensor-parallel ranks meet: the TCP store on rank 0 and the interface that gloo and
NCCL use, both held to the address the user gave.

torch's TCPStore listens on every interface when it opens its own socket, and gloo picks the
address the host name resolves to. The ranks' traffic is unauthenticated, so neither default is
acceptable on a machine with a public interface: rank 0 binds the store's socket itself, to the
`--dist-init-addr` host only, and every rank points gloo (and NCCL's bootstrap) at the interface
that carries its route to that host.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket

import torch.distributed as dist

from srt_lite import envs
from srt_lite.utils import split_host_port

__all__ = ["bind_collectives_to", "interface_of", "is_wildcard", "local_address_towards", "open_store", "split_host_port"]

logger = logging.getLogger(__name__)

# Kept open for the life of the process: the store serves on this socket's file descriptor.
_STORE_LISTENER: socket.socket | None = None


def is_wildcard(host: str) -> bool:
    """0.0.0.0 or ::, which the user may ask for explicitly: every interface."""
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def open_store(host: str, port: int, rank: int, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """Rank 0 serves the store on a socket bound to exactly (host, port); the others connect
    to it, retrying until `timeout` while rank 0's node is still starting."""
    global _STORE_LISTENER
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout)
    family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(sockaddr)
    except OSError as e:
        listener.close()
        raise RuntimeError(
            f"cannot listen on --dist-init-addr {host}:{port} ({e.strerror}): on node 0 it must be "
            "an address of this machine and a free port"
        ) from None
    listener.listen(128)
    _STORE_LISTENER = listener
    return dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=False, master_listen_fd=listener.fileno())


def local_address_towards(host: str, port: int) -> str:
    """This machine's address on the route to (host, port). A UDP connect sends nothing; it
    only asks the kernel which source address it would use."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds `address`, if any does."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addrs):
            return name
    return None


def bind_collectives_to(host: str, port: int) -> None:
    """Points gloo (GLOO_SOCKET_IFNAME) and NCCL's bootstrap (NCCL_SOCKET_IFNAME) at the
    interface that reaches the rendezvous host, unless the user chose one. With a wildcard
    host the user asked for every interface, and the libraries' own choice stands."""
    if is_wildcard(host):
        return
    try:
        resolved = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0]
        iface = interface_of(local_address_towards(resolved, port))
    except OSError as e:
        logger.warning("cannot tell which interface reaches %s (%s); gloo/NCCL choose their own", host, e)
        return
    if iface is None:
        logger.warning("no interface holds the route to %s; gloo/NCCL choose their own", host)
        return
    for var in (envs.GLOO_SOCKET_IFNAME, envs.NCCL_SOCKET_IFNAME):
        if not var.get():
            os.environ[var.name] = iface
