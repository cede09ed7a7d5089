"""``batchc run --tp N``: where this process stands in a tensor-parallel group, starting the group,
and a worker rank's whole job.

Launch: without ``RANK``/``WORLD_SIZE`` in the environment, ``batchc run --tp N`` is rank 0 and
starts ranks 1..N-1 itself (the same command line, each with ``RANK`` set: ``backend.tp.group.
spawn_workers``). Under ``torchrun --nproc-per-node N -m compiler.cli run ...`` every process is one
rank. Either way every rank loads the models and checks the command line the same way; rank 0
then serves and reports, and the others serve its plans on their shards (``serve_worker``) and
print nothing but a failure, in one line on stderr.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from backend.hybrid.config import HybridConfig
from backend.hybrid.head import HeadModel
from backend.hybrid.model import HybridModel
from backend.tp import check_tp, shard_model
from backend.tp.group import RankFailed, TPGroup, connect, launched_rank, spawn_workers
from backend.tp.serve import TPLeader, serve_worker
from compiler.workload import ServeError
from ir.ids import DRAFT_POOL, TARGET_POOL


def placement(tp: int | None) -> tuple[int, int, bool]:
    """``(rank, world, launched)``: ``launched`` when a launcher (torchrun, or rank 0 of
    ``batchc run --tp``) started this process as a rank. ``ServeError`` when ``--tp`` contradicts
    the launcher's ``WORLD_SIZE``."""
    try:
        where = launched_rank()
    except ValueError as exc:
        raise ServeError(str(exc)) from None
    if where is None:
        return 0, tp if tp is not None else 1, False
    rank, world = where
    if tp is not None and tp != world:
        raise ServeError(f"--tp {tp} in a group of WORLD_SIZE {world} (torchrun's --nproc-per-node): they must be equal")
    return rank, world, True


def check_splits(world: int, models: Sequence[tuple[str, HybridConfig]]) -> None:
    """``ServeError`` in one line, naming the model, unless each splits over ``world`` ranks."""
    for name, config in models:
        try:
            check_tp(config, world)
        except ValueError as exc:
            raise ServeError(f"--tp {world}: {name}: {exc}") from None


TP_TIMEOUT_S = 60
"""``--tp-timeout``'s default: how long a rank waits on the others in any step."""
START_TIMEOUT_S = 600
"""How long a rank waits for the others to join (each loads its models first)."""


def start(rank: int, world: int, launched: bool, argv: Sequence[str], timeout_s: int) -> TPGroup:
    """Join (launched) or start (``batchc run --tp``: rank 0 starts the others with ``argv``) the
    group, each rank waiting up to ``START_TIMEOUT_S`` for the others. ``ServeError`` for a launcher
    environment that names no usable address (``MASTER_ADDR``, ``MASTER_PORT``); ``RankFailed``
    when the group cannot form."""
    try:
        if launched:
            return connect(rank, world, timeout_s=timeout_s, start_timeout_s=START_TIMEOUT_S)
        return spawn_workers(world, [sys.executable, "-m", "compiler.cli", *argv], timeout_s=timeout_s, start_timeout_s=START_TIMEOUT_S)
    except ValueError as exc:
        raise ServeError(str(exc)) from None


def shards(group: TPGroup, target: HybridModel, draft: HybridModel | HeadModel | None) -> tuple[HybridModel, HybridModel | HeadModel | None]:
    """This rank's shards of the models, summing through the group; a draft head stays whole (bound
    to the whole target: it reads the hidden states every rank has whole, and its phases issue no
    collective)."""
    t = shard_model(target, group.rank, group.world, group)
    if draft is None or isinstance(draft, HeadModel):
        return t, draft
    return t, shard_model(draft, group.rank, group.world, group)


def work(rank: int, world: int, launched: bool, argv: Sequence[str], timeout_s: int, target: HybridModel,
         draft: HybridModel | HeadModel | None) -> int:
    """A worker rank's job: join the group and serve rank 0's plans until it shuts the group down.
    Exit status 0, or 1 (with one line on stderr) when this rank or the group failed."""
    try:
        group = start(rank, world, launched, argv, timeout_s)
    except RankFailed as exc:
        print(_said_by(rank, exc), file=sys.stderr, flush=True)
        return 1
    t, d = shards(group, target, draft)
    models = {TARGET_POOL: t} | ({DRAFT_POOL: d} if d is not None else {})
    try:
        serve_worker(group, models)
    except RankFailed as exc:
        print(_said_by(group.rank, exc), file=sys.stderr, flush=True)
        os._exit(1)  # leave at once: the group's sockets close, and nothing waits on a broken group
    group.close()
    return 0


def _said_by(rank: int, exc: RankFailed) -> str:
    """A worker's one line: its own failure as is ("rank 1 failed: ..."), another's prefixed with
    the speaker ("rank 1: rank 0 did not answer within 60 s")."""
    return f"batchc: {exc}" if exc.rank == rank else f"batchc: rank {rank}: {exc}"


__all__ = ["TPLeader", "check_splits", "placement", "shards", "start", "work"]
