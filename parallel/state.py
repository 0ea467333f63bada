"""Process groups for one world: world = data x tensor; TP groups of consecutive ranks; one EP
group over the whole world. NCCL on CUDA devices, gloo on CPU (backend `auto`).

The target's ShardWorkers form one such world; the drafter group's actors form another of their
own (separate processes, their own rendezvous), with TP groups of `speculative.draft_tensor`."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend != "auto":
        return backend
    return "nccl" if device.type == "cuda" else "gloo"


def free_port() -> int:
    """A TCP port free on this node now (for a server that binds it itself: HTTP, DeepSpeed's
    launcher). Not for a world's rendezvous: another process may take it before it is bound
    again; `open_rendezvous` binds first and tells the port after."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def open_rendezvous(timeout_s: float = 300.0) -> dist.TCPStore:
    """The server side of a world's rendezvous: a TCPStore listening on every interface, on a port
    the OS picks as it binds (`.port`), so nothing can take the port between choosing and binding
    it. Opened by whoever hands the port out (rank 0's actor, a launching parent) and kept alive
    while the world forms; every rank then joins it as a client (`init_parallel`)."""
    return dist.TCPStore("0.0.0.0", 0, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)


def join_rendezvous(master_addr: str, master_port: int, timeout_s: float = 300.0) -> dist.TCPStore:
    """A rank's client of the rendezvous `open_rendezvous` serves at master_addr:master_port."""
    return dist.TCPStore(master_addr, master_port, None, False, timedelta(seconds=timeout_s))


def local_address_towards(addr: str, port: int = 9) -> str:
    """This host's address on the route to `addr` (a UDP connect only picks the route; nothing is
    sent). For rank 0's own address it is that address; for 127.0.0.1, 127.0.0.1."""
    family, kind, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind) as s:
        s.connect(sockaddr)
        return s.getsockname()[0]


def interface_of(address: str) -> "str | None":
    """The network interface holding `address`, or None."""
    try:
        import psutil
    except ImportError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addrs):
            return name
    return None


_gloo_ifname_set = None  # the GLOO_SOCKET_IFNAME init_parallel set (one a user set is never replaced)


def bind_gloo_to_route(master_addr: str) -> "str | None":
    """Make gloo's pairs listen on the interface that reaches rank 0. Left alone, gloo binds to the
    address the host name resolves to, and falls back to 127.0.0.1 when that is not a local
    address (a host whose name maps to 127.0.0.1 or to another interface, a container, a network
    namespace): the peers on other hosts are then told to connect to 127.0.0.1 and the world never
    forms ("Gloo connectFullMesh failed ... remote=[127.0.0.1]"). A GLOO_SOCKET_IFNAME the user set
    wins. Returns the interface used, or None."""
    global _gloo_ifname_set
    current = os.environ.get("GLOO_SOCKET_IFNAME")
    if current and current != _gloo_ifname_set:
        return current
    try:
        iface = interface_of(local_address_towards(master_addr))
    except OSError:
        iface = None
    if iface:
        os.environ["GLOO_SOCKET_IFNAME"] = _gloo_ifname_set = iface
    return iface


@dataclass
class CommStats:
    """Bytes each rank sends per kind of collective (payload, not protocol overhead)."""

    bytes: dict = field(default_factory=lambda: {"all_reduce": 0, "all_gather": 0, "all_to_all": 0, "broadcast": 0})
    calls: dict = field(default_factory=lambda: {"all_reduce": 0, "all_gather": 0, "all_to_all": 0, "broadcast": 0})

    def add(self, kind: str, nbytes: int):
        self.bytes[kind] += int(nbytes)
        self.calls[kind] += 1

    def snapshot(self) -> dict:
        return {"bytes": dict(self.bytes), "calls": dict(self.calls)}


@dataclass
class ParallelState:
    rank: int
    world_size: int
    tp_size: int
    tp_rank: int
    dp_rank: int
    tp_group: object
    ep_group: object
    tp_ranks: list
    device: torch.device
    stats: CommStats = field(default_factory=CommStats)


def init_parallel(rank: int, world_size: int, tp_size: int, master_addr: str, master_port: int,
                  backend: str, device: torch.device, timeout_s: float = 300.0,
                  store: "dist.TCPStore | None" = None) -> ParallelState:
    """Join a world (the target's, or the drafter group's own) and build its TP and EP groups
    (collective: every rank of that world calls this with the same address, port and sizes). The
    rendezvous at master_addr:master_port is `open_rendezvous`'s; a rank that opened it passes
    its `store` instead of dialling itself."""
    backend = resolve_backend(backend, device)
    if backend == "gloo":
        bind_gloo_to_route(master_addr)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if store is None:
        store = join_rendezvous(master_addr, master_port, timeout_s)
    store.set_timeout(timedelta(seconds=timeout_s))  # (rank 0's was opened with open_rendezvous's own)
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    tp_group = None
    tp_ranks = []
    for start in range(0, world_size, tp_size):
        ranks = list(range(start, start + tp_size))
        group = dist.new_group(ranks)  # every rank creates every group, as torch requires
        if rank in ranks:
            tp_group, tp_ranks = group, ranks
    # no group of its own for expert migration: its transfers run on the step thread between steps, over the
    # EP group, so they are ordered with the step's collectives (a second communicator could deadlock with NCCL)
    return ParallelState(
        rank=rank,
        world_size=world_size,
        tp_size=tp_size,
        tp_rank=rank % tp_size,
        dp_rank=rank // tp_size,
        tp_group=tp_group,
        ep_group=dist.group.WORLD,
        tp_ranks=tp_ranks,
        device=device,
    )


def shutdown_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
