"""Prefix states handed out by the engine: a prompt prefix prefilled once into a slot of every
pool, which requests admitted with it start from (a COW of that slot, sharing its KV locations).

``PrefixStates`` keeps the ones made and not yet released, checks every record handed back against
them (a forged or released one is refused), and holds one slot and one KV reference per location of
each until it is released.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from backend.allocator import KVAllocator, SlotAllocator
from backend.boundary import Backend, checked
from compiler.engine.admission import MAX_LEN, checked_prompt
from compiler.engine.kv_refs import KVRefs
from compiler.engine.report import PrefixState
from compiler.engine.requests import Request
from compiler.steps import Pipeline
from ir.columns import I64, int_problem
from ir.errors import PreconditionError, SlotError, short_repr
from ir.ids import MambaSlot, RequestId
from ir.request import AdmittedRequest, Clear

__all__ = ["PrefixStates"]


class PrefixStates:
    """The engine's prefix states (see the module): ``make`` prefills a prefix into a fresh slot of every
    pool and records it; ``check`` refuses a prefix argument that is not one of the live records
    (forged or released); ``release`` gives back its slot and KV references, and refuses a record that
    is not live or that a live request has yet to copy (its first chunk has not run)."""

    def __init__(
        self,
        *,
        slots: SlotAllocator,
        kv: KVAllocator,
        kv_refs: KVRefs,
        pipeline: Pipeline,
        executors: Callable[[], Sequence[Backend]],
        k: int,
        max_len: int,
        vocab: int,
        head: bool = False,
    ) -> None:
        self.head = head
        """The draft is a head: it builds its state from the target prefill's hidden states."""
        self.slots, self.kv, self.kv_refs, self.pipeline = slots, kv, kv_refs, pipeline
        self.executors = executors
        self.k, self.max_len, self.vocab = k, max_len, vocab
        self._held: dict[MambaSlot, PrefixState] = {}
        """The prefix states ``make`` made and ``release`` has not released."""

    def held(self) -> dict[MambaSlot, PrefixState]:
        """The live prefix states by slot (a copy)."""
        return dict(self._held)

    def check(self, rid: RequestId, prefix: object, arr: I64, requests: Iterable[Request]) -> None:
        """``Engine.admit``'s checks of a prefix argument: one of this engine's live prefix states
        that the prompt ``arr`` extends (``PreconditionError`` otherwise)."""
        if not isinstance(prefix, PrefixState):
            raise PreconditionError("admit", f"request {rid}: prefix must be a PrefixState (from make_prefix), got {prefix!r}")
        problem = int_problem(prefix.slot)
        if problem is not None:
            raise PreconditionError("admit", f"request {rid}: prefix slot {problem} (got {prefix.slot!r})")
        for name, values in (("tokens", prefix.tokens), ("kv_locs", prefix.kv_locs)):
            if not isinstance(values, tuple):
                raise PreconditionError("admit", f"request {rid}: prefix {name} must be a tuple of ints, got {values!r}")
            for v in values:
                problem = int_problem(v)
                if problem is not None:
                    raise PreconditionError("admit", f"request {rid}: every prefix {name} entry {problem} (got {v!r})")
        n = len(prefix.tokens)
        if len(prefix.kv_locs) != n:
            raise PreconditionError("admit", f"request {rid}: prefix has {len(prefix.kv_locs)} KV locations for {n} tokens")
        if not (n < arr.shape[0] and tuple(int(t) for t in arr[:n]) == prefix.tokens):
            raise PreconditionError("admit", f"request {rid}: prompt does not extend the prefix state's {n} tokens")
        slot = int(prefix.slot)
        if not self.slots.is_live(MambaSlot(slot)):
            raise PreconditionError("admit", f"request {rid}: prefix slot {prefix.slot} was released")
        for other in requests:
            if slot in (other.slot, other.snapshot_slot):
                raise PreconditionError("admit", f"request {rid}: prefix slot {slot} is a slot of live request {other.rid}")
        unheld = [loc for loc in prefix.kv_locs if self.kv_refs.count(loc) == 0]
        if unheld:
            raise PreconditionError("admit", f"request {rid}: prefix KV location {unheld[0]} is not held (not a live prefix)")
        if self._held.get(MambaSlot(slot)) != prefix:
            raise PreconditionError(
                "admit", f"request {rid}: prefix {short_repr(prefix)} is not a prefix this engine holds (forged, or released)"
            )

    def checked_tokens(self, tokens: Sequence[int]) -> I64:
        """``tokens`` checked for ``make``, before a slot, a KV location or a ticket is taken: the
        tokens (``IRValidationError``), their length (a request extending the prefix must fit
        ``max_len``: at least one more prompt token, one new token and the k + 1 speculative
        positions) and the free slots and KV locations (``PreconditionError``)."""
        arr = checked_prompt("prefix", tokens, self.vocab, MAX_LEN)  # huge inputs refused unread
        n = int(arr.shape[0])
        if n + self.k + 3 > self.max_len:
            raise PreconditionError(
                "make_prefix",
                f"tokens: a prefix of {n} tokens leaves no room under max_len {self.max_len} for a request extending it "
                f"(at least {n} + 1 prompt tokens, 1 new token and k + 1 = {self.k + 1} speculative positions)",
            )
        if n > self.kv.num_free or self.slots.num_free == 0:
            raise PreconditionError(
                "make_prefix",
                f"no room for a {n}-token prefix ({self.slots.num_free} free slots, {self.kv.num_free} free KV locations)",
            )
        return arr

    def make(self, arr: I64) -> PrefixState:
        """Prefill ``arr`` (from ``checked_tokens``) into a fresh slot of every pool and hold it. An
        exception escaping the prefill may leave a slot, KV locations or tickets taken."""
        n = int(arr.shape[0])
        slot = self.slots.alloc()
        kv = self.kv_refs.alloc(n)
        req = AdmittedRequest(rid=RequestId(-1 - int(slot)), slot=slot, input_ids=arr, kv_locs=kv, intent=Clear())
        if self.head:
            target, head = self.executors()
            extend, plan = self.pipeline.prefill([req], keep_hidden=True)
            sampled = checked(plan, target.wait(target.submit(plan)))
            hidden = sampled.hidden
            assert hidden is not None  # (``checked``: the plan asked for them)
            _, hplan = self.pipeline.head_extend(extend, hidden)
            head.wait(head.submit(hplan))  # (the head pool runs the prefill's init ops here, once)
        else:
            _, plan = self.pipeline.prefill([req])
            for ex in self.executors():
                ex.wait(ex.submit(plan))  # (each pool runs the prefill's own init ops, once)
        cp = PrefixState(slot=slot, tokens=tuple(arr.tolist()), kv_locs=tuple(kv.tolist()))
        self._held[slot] = cp
        return cp

    def release(self, cp: PrefixState, requests: Iterable[Request]) -> None:
        """Only a prefix this engine made and has not released yet is accepted (the whole record
        must equal the one ``make`` returned), and only while no live request still waits to copy
        it (admitted from it and not yet past its first prefill chunk); otherwise
        ``PreconditionError`` (``SlotError`` for a second release: a double free of its slot), and
        nothing changes."""
        if not isinstance(cp, PrefixState):
            raise PreconditionError(
                "release_prefix", f"cp must be a PrefixState (from make_prefix), not {type(cp).__name__} (got {short_repr(cp)})"
            )
        problem = int_problem(cp.slot)
        if problem is not None:
            raise PreconditionError("release_prefix", f"cp.slot {problem} (got {short_repr(cp.slot)})")
        slot = MambaSlot(int(cp.slot))
        held = self._held.get(slot)
        if held is None and not self.slots.is_live(slot):
            raise SlotError(f"release_prefix: double free of slot {slot}: no prefix of this engine holds it (released already?)")
        if held is None or held != cp:
            raise PreconditionError(
                "release_prefix", f"cp {short_repr(cp)} is not a prefix this engine holds (forged, or released already)"
            )
        waiting = sorted(r.rid for r in requests if r.done == 0 and r.source == held)
        if waiting:
            raise PreconditionError(
                "release_prefix", f"prefix in slot {slot} is still to be copied by request(s) {waiting} (their first chunk has not run)"
            )
        del self._held[slot]
        self.slots.free(slot)
        self.kv_refs.unref(held.kv_locs)
