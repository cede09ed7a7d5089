"""A tensor-parallel group's channel: rank 0's messages to the workers, the ranks' agreement on each
plan, and how a failed rank is named. Everything travels through ``torch.distributed`` (a broadcast
from rank 0, all-reduces, all-gathers on a gloo group) and its ``TCPStore``; nothing is pickled.

Timeouts: every collective of the group fails after ``timeout_s`` without its peers (gloo's process
group timeout); a rank that dies is noticed at once (its sockets close). The workers wait at most
``timeout_s`` for rank 0's next message, so a rank 0 that idles longer sends ``TPLeader.ping``.

When a collective fails, ``failure`` names the rank that caused it: a rank that raised left its
cause in the store (``report_fault``) before it went; a rank that was killed is found by its process
(a child this rank spawned, or a process of this host whose pid the rank registered); otherwise the
rank that did not answer within the timeout, or that lost its connection.

Failures are said in the words of every mode (``backend.children``): "rank 1 killed by signal 9",
"rank 1 exited with status 1", "rank 1 did not answer within 60 s", "rank 1 failed: <its error>".
The transport's own text (gloo's, the store's) is never the message: it goes to the debug log.
The workers rank 0 starts (``spawn_workers``) are ``backend.children.spawn``'s children: they die
with rank 0, whenever and however it ends.
"""

from __future__ import annotations

import datetime
import enum
import logging
import os
import re
import socket
import struct
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Final

import torch
import torch.distributed as dist
from torch.distributed import (  # type: ignore[attr-defined]  # public at run time (torch.distributed re-exports them); not listed in its __all__
    PrefixStore,
    Store,
    TCPStore,
)

from backend import children
from backend.boundary import BackendBroken
from ir.errors import BatchcError

__all__ = [
    "MAX_PAYLOAD", "MAX_WORLD", "Msg", "RankFailed", "RankFault", "RankRefused", "TPGroup", "Vote", "connect", "launched_rank", "one_line",
    "spawn_workers",
]

_log = logging.getLogger("batchc.tp")

MAX_PAYLOAD: Final = 1 << 31
"""Largest message the workers accept (an ``ir.wire`` message's own bound)."""
INLINE: Final = 4096 - 24
"""Largest payload that travels inside a message's head (most plan messages of a few requests)."""
_HEAD_BYTES: Final = INLINE + 24
_DETAIL_BYTES: Final = 2000
MAX_WORLD: Final = 64
"""Most ranks a group takes."""
MAX_TIMEOUT_S: Final = 86400
_DIGITS: Final = re.compile(r"[0-9]{1,6}")
_GRACE_S: Final = 3.0
"""How long ``failure`` looks for the cause a failing rank reports before it settles for less."""


class Msg(enum.IntEnum):
    """The kinds of rank 0's messages."""

    START = 1  # a serving session: pools, sizes, rank 0's serial epoch (JSON)
    PLAN = 2  # arg: the pool's index; payload: an ir.wire plan message
    SHARE = 3  # the token table's share_prefix (JSON [src, dst, length])
    FORGET = 4  # arg: the pool's index; Executor.forget_verifies
    CANCEL = 5  # cancel every outstanding ticket (JSON reason)
    CLOSE = 6  # end the session: every rank's ledger counts are gathered
    SHUTDOWN = 7  # the worker returns
    PING = 8  # nothing: rank 0 is alive
    ARM = 9  # tests: arm a fault point on one rank (JSON [rank, point, after])


class Vote(enum.IntEnum):
    """A rank's word on a plan at an agreement; the group's is the worst."""

    REFUSED = 0  # the plan does not fit this rank (a BatchcError: a replayed, forged or bad plan): a bug
    FAILED = 1  # something else went wrong before anything was written (a fault: out of memory, say)
    OK = 2


class RankFault(RuntimeError):
    """A rank failed on a plan before anything was written anywhere (not a refusal): no rank ran
    it, the group serves on, and the engine aborts the plan's requests as it does for any failed
    forward. ``faults``: (rank, why)."""

    def __init__(self, plan: str, faults: Sequence[tuple[int, str]]) -> None:
        said = "; ".join(f"rank {r}: {why}" for r, why in faults)
        super().__init__(f"{plan} failed on the tensor-parallel group before it ran ({said})")
        self.faults = tuple(faults)


class RankFailed(BackendBroken):
    """A rank of the group died, raised after it had accepted a plan, or stopped answering: the
    group cannot go on. ``rank`` is the rank that failed (None when it cannot be told); ``cause``
    says what it did, as a predicate ("killed by signal 9", "did not answer within 60 s", "failed:
    <its error>"), so the message reads "rank 1 killed by signal 9". Without a rank, ``cause`` is
    the whole message."""

    def __init__(self, rank: int | None, cause: str) -> None:
        super().__init__(f"rank {rank} {cause}" if rank is not None else cause)
        self.rank = rank
        self.cause = cause


class RankRefused(BatchcError):
    """One or more ranks refused a plan message before anything ran (a replayed, out-of-order or
    forged message, a plan its checks refuse): no rank ran it. ``refusals``: (rank, why)."""

    def __init__(self, plan: str, refusals: Sequence[tuple[int, str]]) -> None:
        said = "; ".join(f"rank {r}: {why}" for r, why in refusals)
        super().__init__(f"{plan} refused by the tensor-parallel group ({said})")
        self.refusals = tuple(refusals)


def one_line(exc: BaseException) -> str:
    """``Kind: first line of the message``, at most a few hundred characters."""
    text = " ".join(str(exc).split()) or "(no message)"
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(exc).__name__}: {text}"


class TPGroup:
    """One rank's handle on the group (``torch.distributed`` initialised over ``store``)."""

    def __init__(self, *, rank: int, world: int, store: Store, timeout_s: float,
                 procs: dict[int, subprocess.Popen[bytes]] | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised (connect first)")
        self.rank, self.world, self.store, self.timeout_s = rank, world, store, timeout_s
        self.procs = dict(procs or {})
        """The workers this rank started (rank 0 under ``batchc run --tp``), by rank."""
        # messages and agreements on a CPU (gloo) group even when the model's sums run on NCCL
        self.cpu_group: dist.ProcessGroup | None = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        self.broken: RankFailed | None = None
        self.closed = False
        self.message_s = 0.0
        """Seconds this rank spent in message broadcasts (sending or receiving)."""
        self.agree_s = 0.0
        """Seconds this rank spent in the per-plan agreements."""

    # -- messages ------------------------------------------------------------------------------

    def send(self, kind: Msg, payload: bytes = b"", arg: int = 0) -> None:
        """Rank 0: broadcast one message to every worker (returns once they have it). A payload of
        up to ``INLINE`` bytes travels inside the fixed-size head: one broadcast, not two."""
        assert self.rank == 0, "only rank 0 sends"
        t0 = time.perf_counter()
        head = bytearray(_HEAD_BYTES)
        head[:24] = struct.pack("<qqq", int(kind), len(payload), arg)
        if len(payload) <= INLINE:
            head[24 : 24 + len(payload)] = payload
        self._collective(lambda: dist.broadcast(torch.frombuffer(head, dtype=torch.uint8), 0, group=self.cpu_group))
        if len(payload) > INLINE:
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            self._collective(lambda: dist.broadcast(buf, 0, group=self.cpu_group))
        self.message_s += time.perf_counter() - t0

    def receive(self) -> tuple[Msg, int, bytes]:
        """A worker: the next message from rank 0 (``RankFailed`` when rank 0 is gone or sent
        nothing within the timeout)."""
        head = torch.zeros(_HEAD_BYTES, dtype=torch.uint8)
        self._collective(lambda: dist.broadcast(head, 0, group=self.cpu_group))
        t0 = time.perf_counter()
        raw = head.numpy().tobytes()
        kind, size, arg = struct.unpack_from("<qqq", raw)
        if not 0 <= size <= MAX_PAYLOAD or kind not in Msg._value2member_map_:
            raise RankFailed(0, f"sent a message header this rank cannot read (kind {kind}, {size} bytes)")
        if size <= INLINE:
            data = raw[24 : 24 + size]
        else:
            buf = torch.empty(size, dtype=torch.uint8)
            self._collective(lambda: dist.broadcast(buf, 0, group=self.cpu_group))
            data = buf.numpy().tobytes()
        self.message_s += time.perf_counter() - t0
        return Msg(kind), arg, data

    # -- agreement -----------------------------------------------------------------------------

    def agree(self, vote: Vote = Vote.OK, detail: str = "") -> tuple[Vote, list[tuple[int, str]]]:
        """Every rank votes on the current plan; returns the worst vote and the dissent (rank, why),
        empty when every rank said ``OK``. Every rank gets the same answer."""
        t0 = time.perf_counter()
        flag = torch.tensor([int(vote)], dtype=torch.int64)
        self._collective(lambda: dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.cpu_group))
        worst = Vote(int(flag.item()))
        if worst is Vote.OK:
            self.agree_s += time.perf_counter() - t0
            return worst, []
        data = b"" if vote is Vote.OK else ((detail or vote.name.lower()).encode()[:_DETAIL_BYTES])
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        self._collective(lambda: dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self.cpu_group))
        width = max(int(s.item()) for s in sizes)
        mine = torch.zeros(width, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
        parts = [torch.zeros(width, dtype=torch.uint8) for _ in range(self.world)]
        self._collective(lambda: dist.all_gather(parts, mine, group=self.cpu_group))
        self.agree_s += time.perf_counter() - t0
        return worst, [
            (r, parts[r][: int(sizes[r].item())].numpy().tobytes().decode(errors="replace"))
            for r in range(self.world) if int(sizes[r].item())
        ]

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        """The model's sum across ranks (``backend.hybrid.model.Collective``), on the default group."""
        self._collective(lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM))

    def gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's ``values`` (the same length on every rank), by rank."""
        mine = torch.tensor(list(values), dtype=torch.int64)
        parts = [torch.zeros_like(mine) for _ in range(self.world)]
        self._collective(lambda: dist.all_gather(parts, mine, group=self.cpu_group))
        return [[int(x) for x in p.tolist()] for p in parts]

    # -- failures ------------------------------------------------------------------------------

    def _collective(self, op: Callable[[], object]) -> None:
        if self.broken is not None:
            raise self.broken
        if self.closed:
            raise RuntimeError("this tensor-parallel group is closed")
        t0 = time.monotonic()
        try:
            op()
        except RuntimeError as exc:
            self.broken = self.failure(exc, waited_s=time.monotonic() - t0)
            raise self.broken from None

    def report_fault(self, cause: str) -> None:
        """Leave this rank's cause of failure where the others look for it (best effort: the store
        may be gone with rank 0)."""
        try:
            self.store.set(f"fault/{self.rank}", cause[:_DETAIL_BYTES])
        except Exception:  # noqa: BLE001 - the store went with rank 0; the others learn from the closed sockets
            pass

    def failure(self, exc: BaseException, waited_s: float = 0.0) -> RankFailed:
        """The ``RankFailed`` for a collective that raised ``exc`` after ``waited_s`` seconds: the
        rank that reported a fault, else a rank whose process is gone, else the rank that did not
        answer within the timeout (or lost its connection, sooner). ``exc``'s text goes to the
        debug log only."""
        if isinstance(exc, RankFailed):
            return exc
        _log.debug("rank %d: a collective failed after %.1f s: %s", self.rank, waited_s, one_line(exc))
        deadline = time.monotonic() + _GRACE_S
        while True:
            try:
                for r in range(self.world):
                    if r != self.rank and self.store.check([f"fault/{r}"]):
                        return RankFailed(r, self.store.get(f"fault/{r}").decode(errors="replace"))
            except Exception:  # noqa: BLE001 - the store is gone: it lived with rank 0
                if self.rank != 0:
                    return RankFailed(0, "is gone (the group's store is unreachable)")
            gone = self._gone()
            if gone is not None:
                return RankFailed(*gone)
            if time.monotonic() > deadline:
                other = 1 - self.rank if self.world == 2 else None  # (in a pair, the one other rank)
                timed_out = waited_s >= 0.9 * self.timeout_s
                said = children.no_answer(self.timeout_s) if timed_out else "lost its connection"
                return RankFailed(other, said if other is not None else f"a rank of the tensor-parallel group {said}")
            time.sleep(0.05)

    def _gone(self) -> tuple[int, str] | None:
        for r, proc in sorted(self.procs.items()):
            code = proc.poll()
            if code is not None:
                return r, children.ended(code)
        host = socket.gethostname()
        for r in range(self.world):
            if r == self.rank or r in self.procs:
                continue
            try:
                where = self.store.get(f"pid/{r}").decode() if self.store.check([f"pid/{r}"]) else ""
            except Exception:  # noqa: BLE001 - the store is gone
                return None
            h, _, pid = where.rpartition(":")
            if h == host and pid.isdigit() and not _alive(int(pid)):
                return r, "is gone (its process ended)"
        return None

    def close(self, *, wait_s: float = 30.0) -> None:
        """Leave the group: destroy the process group and wait up to ``wait_s`` for the workers this
        rank started, killing any still running then. When the group is broken the workers are
        stopped at once (SIGKILL): one may still wait in a collective whose sockets this process
        keeps open (an interrupted wait keeps its process group alive). Idempotent."""
        if self.closed:
            return
        self.closed = True
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group: its sockets close with it anyway
                pass
        if self.broken is not None:
            for proc in self.procs.values():
                children.kill(proc, wait_s=0.0)
            wait_s = min(wait_s, 5.0)
        deadline = time.monotonic() + wait_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                children.kill(proc)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped) is gone too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


# -- joining a group -----------------------------------------------------------------------------


def launched_rank() -> tuple[int, int] | None:
    """``(rank, world)`` when this process was started as a rank (by ``torchrun``, or by
    ``spawn_workers``): the ``RANK`` and ``WORLD_SIZE`` environment variables; else None."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None or world is None:
        return None
    if not (_DIGITS.fullmatch(rank) and _DIGITS.fullmatch(world) and 0 <= int(rank) < int(world) <= MAX_WORLD):
        raise ValueError(f"RANK {rank!r} and WORLD_SIZE {world!r} must be ints with 0 <= RANK < WORLD_SIZE <= {MAX_WORLD}")
    return int(rank), int(world)


def _check_args(where: str, *, rank: object = 0, world: object, timeout_s: object, start_timeout_s: object, backend: object) -> None:
    """``ValueError`` naming the argument unless each is what ``connect`` / ``spawn_workers`` take."""
    if type(world) is not int or not 1 <= world <= MAX_WORLD:
        raise ValueError(f"{where}: world must be an int in [1, {MAX_WORLD}], got {world!r}")
    if type(rank) is not int or not 0 <= rank < world:
        raise ValueError(f"{where}: rank must be an int in [0, {world}), got {rank!r}")
    for name, value in (("timeout_s", timeout_s), ("start_timeout_s", start_timeout_s)):
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= MAX_TIMEOUT_S):
            raise ValueError(f"{where}: {name} must be a number of seconds in (0, {MAX_TIMEOUT_S}], got {value!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"{where}: backend must be 'gloo' or 'nccl', got {backend!r}")


def connect(rank: int, world: int, *, timeout_s: float, start_timeout_s: float = 600.0, backend: str = "gloo") -> TPGroup:
    """Join the group the environment describes (``MASTER_ADDR``, ``MASTER_PORT``: ``torchrun``'s
    or ``spawn_workers``'s). Under ``torchrun`` the agent's store is used as is."""
    _check_args("connect", rank=rank, world=world, timeout_s=timeout_s, start_timeout_s=start_timeout_s, backend=backend)
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port_text = os.environ.get("MASTER_PORT", "")
    if not (_DIGITS.fullmatch(port_text) and 1 <= int(port_text) <= 65535):
        raise ValueError(f"MASTER_PORT must be a port number in [1, 65535], got {port_text!r}")
    if not addr or addr != addr.strip() or any(not c.isprintable() for c in addr):
        raise ValueError(f"MASTER_ADDR must be a host name or address, got {addr!r}")
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        store = TCPStore(addr, int(port_text), world, is_master=rank == 0 and not agent,
                         timeout=datetime.timedelta(seconds=start_timeout_s), wait_for_workers=False)
        return _join(PrefixStore("batchc", store), rank, world, timeout_s, backend, {})
    except RuntimeError as exc:  # torch's DistError family: no store there, or the others never came
        _log.debug("rank %d: could not form the group: %s", rank, one_line(exc))
        raise RankFailed(None, f"the tensor-parallel group could not form at {addr}:{port_text} within {start_timeout_s:g} s") from None


def _join(store: Store, rank: int, world: int, timeout_s: float, backend: str,
          procs: dict[int, subprocess.Popen[bytes]]) -> TPGroup:
    store.set(f"pid/{rank}", f"{socket.gethostname()}:{os.getpid()}")
    dist.init_process_group(backend, store=PrefixStore("pg", store), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return TPGroup(rank=rank, world=world, store=store, timeout_s=timeout_s, procs=procs)


def spawn_workers(world: int, command: Sequence[str], *, timeout_s: float, start_timeout_s: float = 600.0,
                  backend: str = "gloo", env: dict[str, str] | None = None) -> TPGroup:
    """Rank 0 of a group on this machine: start ``world - 1`` worker processes running ``command``
    (with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, as
    ``torchrun`` would) and join the group with them. A worker that exits before it joins, or does
    not join within ``start_timeout_s``, is reported as ``RankFailed`` (and every worker stopped)."""
    _check_args("spawn_workers", world=world, timeout_s=timeout_s, start_timeout_s=start_timeout_s, backend=backend)
    if isinstance(command, str) or not command or not all(isinstance(c, str) for c in command):
        raise ValueError(f"spawn_workers: command must be a non-empty list of strings (program and arguments), got {command!r}")
    store = TCPStore("127.0.0.1", 0, world, is_master=True, timeout=datetime.timedelta(seconds=start_timeout_s), wait_for_workers=False)
    base = dict(os.environ if env is None else env)
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE=str(world))
    base.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    base.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # a worker whose rank 0 is gone says so in one line, not a C++ warning
    procs: dict[int, subprocess.Popen[bytes]] = {}
    try:
        for r in range(1, world):
            procs[r] = children.spawn(list(command), env=dict(base, RANK=str(r), LOCAL_RANK=str(r)), stdin=subprocess.DEVNULL)
        prefixed = PrefixStore("batchc", store)
        deadline = time.monotonic() + start_timeout_s
        waiting = set(procs)
        while waiting:  # each worker registers its pid before it joins the process group
            for r in sorted(waiting):
                code = procs[r].poll()
                if prefixed.check([f"pid/{r}"]):
                    waiting.discard(r)
                elif code is not None:
                    raise RankFailed(r, f"{children.ended(code)} before joining the group")
            if waiting and time.monotonic() > deadline:
                raise RankFailed(min(waiting), f"{children.no_answer(start_timeout_s)} (it never joined the group)")
            time.sleep(0.05)
        return _join(prefixed, 0, world, timeout_s, backend, procs)
    except BaseException:
        for proc in procs.values():
            children.kill(proc)
        raise
