"""``batchc bench iteration``: one speculative iteration's model phases in target-decode equivalents.

Speculation pays when an iteration (draft proposal, verify, commit, draft catch-up) costs fewer
target decodes than the tokens it emits per row. This benchmark times each phase's model call on
the bundled target and draft, ``rows`` running requests with ``context`` tokens already in their
context (40 by default; a served request's context is longer, and the target's attention over it
makes a decode, the unit, dearer: ``--context``), and divides by one target decode of the same rows:

- ``decode``: one target decode (the unit).
- ``verify``: the target over ``k + 1`` positions, keeping every position's state.
- ``commit``: the target's kept state at each row's accepted position into its slot.
- ``propose``: the draft's ``k + 1`` steps keeping each step's state (what the engine runs).
- ``draft commit``: the draft's kept state at the accepted position (what the engine runs).
- ``propose k`` and ``draft extend``: the alternative the engine replaced, ``k`` proposal steps and
  a catch-up forward over the accepted tokens (accepted lengths cycle over ``0..k`` by row).
- with a draft head (``backend.hybrid.head``, the bundled target's trained one): ``head propose``,
  its ``k`` steps from its carried state, and ``head commit``, its catch-up forward over the
  accepted tokens with the verify's hidden states (what the engine runs with ``--draft mtp``).

Per draft kind (``iterations``): ``model`` = verify + commit + propose + draft commit, ``mtp`` =
verify + commit + head propose + head commit, in target decodes.

Each phase is one call of the model entry point (the kernels and the model's own checks included,
no scheduler). Timings are the minimum over interleaved repeats after a warm-up round, with the
thread count the caller set. Every tensor lives on the target's device; on a CUDA device each timed
call is bracketed by a synchronisation, so that a phase's time is the device's work, not its launch.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs
import torch

from backend.hybrid.head import HeadModel, pack_accepted
from backend.hybrid.kv import KVCache, TokenTable
from backend.hybrid.model import HybridModel
from backend.pool import MambaStatePool
from ir.columns import int_problem

PROMPT_LEN = 40
"""Tokens already in each row's context before the measured phases, by default (``context``)."""
PREFILL_CHUNK = 256
"""Tokens per forward when the rows' contexts are prefilled (before anything is timed)."""


@attrs.frozen(kw_only=True)
class PhaseTime:
    phase: str
    seconds: float
    decodes: float
    """``seconds`` over one target decode of the same rows."""


@attrs.frozen(kw_only=True)
class IterationReport:
    rows: int
    k: int
    context: int
    """Tokens in each row's context before the measured phases."""
    repeats: int
    phases: tuple[PhaseTime, ...]
    iteration_decodes: float | None
    """verify + commit + propose + draft commit, in target decodes (what the engine runs); ``None``
    without a separate draft."""
    replaced_iteration_decodes: float | None
    """verify + commit + propose k + draft extend, in target decodes (the draft-extend iteration);
    ``None`` without a separate draft."""
    iterations: tuple[tuple[str, float], ...] = ()
    """Per draft kind (``"model"``, and ``"mtp"`` with a head), the iteration the engine runs, in target decodes."""

    def to_json(self) -> dict[str, object]:
        return {
            "rows": self.rows, "k": self.k, "context": self.context, "repeats": self.repeats, "statistic": "min",
            "phases": [{"phase": p.phase, "seconds": p.seconds, "decodes": p.decodes} for p in self.phases],
            "iterations": [{"draft": kind, "decodes": d} for kind, d in self.iterations],
        }


class _Side:
    """One model's backend state with ``rows`` requests prefilled to ``context`` tokens."""

    def __init__(self, model: HybridModel | HeadModel, rows: int, k: int, context: int, target: _Side | None = None) -> None:
        self.pool: MambaStatePool = model.new_pool(rows)
        self.kv: KVCache = model.new_kv_cache(rows * (context + 4 * (k + 1)) + 8)
        self.table: TokenTable = model.new_token_table(rows, context + 4 * (k + 1))
        dev = self.device = model.device
        self.slots = torch.arange(1, rows + 1, device=dev)
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, model.vocab, (rows * context,), generator=gen).to(dev)  # (drawn on the host: the same tokens on any device)
        self.hidden: torch.Tensor | None = None
        """A target's hidden states over the prompts, packed row after row (a head's extend reads them)."""
        kept: list[torch.Tensor] = []
        # one row and at most PREFILL_CHUNK tokens per forward: a long context's attention stays small
        for row in range(rows):
            for a in range(0, context, PREFILL_CHUNK):
                b = min(a + PREFILL_CHUNK, context)
                at = slice(row * context + a, row * context + b)
                slots, cu, prefix = self.slots[row : row + 1], torch.tensor([0, b - a], device=dev), torch.tensor([a], device=dev)
                ids, positions, locs = tokens[at], torch.arange(a, b, device=dev), torch.arange(at.start + 1, at.stop + 1, device=dev)
                if isinstance(model, HeadModel):  # a head over the target's prompt: the target's hidden states there
                    assert target is not None and target.hidden is not None
                    model.extend(self.pool, self.kv, self.table, slots=slots, cu_seqlens=cu, prefix_lens=prefix, input_ids=ids,
                                 positions=positions, kv_locs=locs, hidden=target.hidden[at])
                else:
                    out = model.extend(self.pool, self.kv, self.table, slots=slots, cu_seqlens=cu, prefix_lens=prefix, input_ids=ids,
                                       positions=positions, kv_locs=locs, keep_hidden=True).all_hidden
                    assert out is not None  # (keep_hidden)
                    kept.append(out)
        if kept:
            self.hidden = torch.cat(kept)
        self.next_loc = rows * context + 1

    def locs(self, rows: int, width: int) -> torch.Tensor:
        """Fresh KV locations, ``[rows, width]`` (the same ones every call: the phases are repeated)."""
        return torch.arange(self.next_loc, self.next_loc + rows * width, device=self.device).reshape(rows, width)


def run_iteration_bench(
    target: HybridModel, draft: HybridModel | None, *, rows: int = 8, k: int = 2, repeats: int = 7, head: HeadModel | None = None,
    context: int = PROMPT_LEN,
) -> IterationReport:
    """The phases of the target and of each draft given (a separate ``draft``, a ``head``; at least
    one), ``rows`` requests with ``context`` tokens already in their context."""
    if draft is None and head is None:
        raise ValueError("run_iteration_bench needs a draft, a head or both")
    problem = int_problem(context)
    if problem is not None or context < 1:
        raise ValueError(f"context must be a positive int, got {context!r}")
    t = _Side(target, rows, k, context)
    h = _Side(head, rows, k, context, target=t) if head is not None else None
    n, w, dev = rows, k + 1, target.device
    gen = torch.Generator().manual_seed(1)
    window = torch.randint(0, target.config.vocab, (n, w), generator=gen).to(dev)
    pos = torch.full((n,), context, dtype=torch.int64, device=dev)
    wpos = pos[:, None] + torch.arange(w, device=dev)[None, :]
    lens = [i % w + 1 for i in range(n)]  # tokens each row's catch-up covers: accepted drafts cycling over 0..k, plus the bonus
    accept = torch.tensor([m - 1 for m in lens], dtype=torch.int64, device=dev)
    verified = target.verify(t.pool, t.kv, t.table, slots=t.slots, input_ids=window, positions=wpos, kv_locs=t.locs(n, w))
    verify_states = verified.states
    ext_lens = accept + 1
    ext_ids = torch.cat([window[i, : lens[i]] for i in range(n)])
    ext_pos = torch.cat([torch.arange(context, context + lens[i], device=dev) for i in range(n)])
    ext_locs = torch.cat([t.locs(n, w)[i, : lens[i]] for i in range(n)])  # (every side's locations are laid out alike)
    ext_cu = torch.cat((torch.zeros(1, dtype=torch.int64, device=dev), ext_lens.cumsum(0)))
    decode_locs = t.locs(n, 1)[:, 0].contiguous()

    # The pools are scratch: a phase may leave a row advanced, which changes no phase's cost.
    phases: dict[str, Callable[[], object]] = {
        "decode": lambda: target.decode(t.pool, t.kv, t.table, slots=t.slots, input_ids=window[:, 0].contiguous(), positions=pos, kv_locs=decode_locs),
        "verify": lambda: target.verify(t.pool, t.kv, t.table, slots=t.slots, input_ids=window, positions=wpos, kv_locs=t.locs(n, w)),
        "commit": lambda: target.commit(t.pool, verify_states, accept_pos=accept, slots=t.slots),
    }
    if draft is not None:
        sep, d = draft, _Side(draft, rows, k, context)
        _, draft_states = sep.propose_keeping_states(
            d.pool, d.kv, d.table, slots=d.slots, input_ids=window[:, 0].contiguous(), positions=pos, kv_locs=d.locs(n, w), k=k
        )
        phases |= {
            "propose": lambda: sep.propose_keeping_states(
                d.pool, d.kv, d.table, slots=d.slots, input_ids=window[:, 0].contiguous(), positions=pos, kv_locs=d.locs(n, w), k=k
            ),
            "draft commit": lambda: sep.commit(d.pool, draft_states, accept_pos=accept, slots=d.slots),
            "propose k": lambda: sep.propose(
                d.pool, d.kv, d.table, slots=d.slots, input_ids=window[:, 0].contiguous(), positions=pos, kv_locs=d.locs(n, w)[:, :k].contiguous(),
                k=k,
            ),
            "draft extend": lambda: sep.extend(
                d.pool, d.kv, d.table, slots=d.slots, cu_seqlens=ext_cu, prefix_lens=pos, input_ids=ext_ids, positions=ext_pos, kv_locs=ext_locs
            ),
        }
    if head is not None and h is not None:
        head_hidden = pack_accepted(verified.hidden, ext_lens)
        phases["head propose"] = lambda: head.propose(
            h.pool, h.kv, h.table, slots=h.slots, input_ids=window[:, 0].contiguous(), positions=pos, kv_locs=h.locs(n, w), k=k
        )
        phases["head commit"] = lambda: head.extend(
            h.pool, h.kv, h.table, slots=h.slots, cu_seqlens=ext_cu, prefix_lens=pos, input_ids=ext_ids, positions=ext_pos,
            kv_locs=ext_locs, hidden=head_hidden,
        )
    best = dict.fromkeys(phases, float("inf"))
    sync: Callable[[], None] = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        for fn in phases.values():  # warm-up
            fn()
        for r in range(repeats):
            order = list(phases) if r % 2 == 0 else list(reversed(phases))
            for name in order:
                sync()  # (nothing queued before the clock starts; the phase's own work done before it stops)
                t0 = time.perf_counter()
                phases[name]()
                sync()
                best[name] = min(best[name], time.perf_counter() - t0)
    unit = best["decode"]
    times = tuple(PhaseTime(phase=name, seconds=s, decodes=s / unit) for name, s in best.items())
    per = {p.phase: p.decodes for p in times}
    model = per["verify"] + per["commit"] + per["propose"] + per["draft commit"] if draft is not None else None
    kinds = [("model", model)] if model is not None else []
    if head is not None:
        kinds.append(("mtp", per["verify"] + per["commit"] + per["head propose"] + per["head commit"]))
    return IterationReport(
        rows=rows, k=k, context=context, repeats=repeats, phases=times, iteration_decodes=model,
        replaced_iteration_decodes=per["verify"] + per["commit"] + per["propose k"] + per["draft extend"] if draft is not None else None,
        iterations=tuple(kinds),
    )
