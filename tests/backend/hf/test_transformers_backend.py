"""The Transformers backend (``backend.hf.transformers_backend``): each supported family served with
transformers' own modeling code and cache object, scheduled by batchc's engine (chunked prefill, the
prefix cache's copies and snapshots, batched decodes), every clear and copy on transformers' state
rows claimed from the ledger.

Per family: every request's greedy output equals transformers' ``generate`` for that request alone
and batchc's own backend on the same weights, and the ledger is drained; the store's rows (conv and
SSM states, keys and values) after a chunked prefill and after a prefix copy equal those of one
from-scratch transformers run of the same tokens; a replayed plan, and a plan over a row whose
ticket it does not carry, are refused before transformers' cache is touched; a forward that fails
leaves the store as it was, its tickets outstanding, and the same plan then runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from backend.hf import load_hf
from backend.hf.transformers_backend import TransformersBackend, TransformersModel, TransformersStore, transformers_transport
from backend.hybrid import HybridModel
from backend.ledger import Ledger
from compiler.engine import Engine
from compiler.prefix_cache import PrefixCache
from compiler.steps import Pipeline
from ir.errors import PlanExecutionError, PreconditionError, ResourceReplayError, TicketMismatchError
from ir.ids import MambaSlot, RequestId
from ir.request import AdmittedRequest, Clear, Continue, CopyFrom
from ir.sampling import SamplingParams
from passes import DecodeContext
from tests.backend.hf.builders import FAMILY_NAMES, save_hf_model

NEW = 8
SHARED = [5, 17, 33, 8, 60, 3, 44, 90, 12, 7, 71, 25, 38, 19, 4, 55]
"""A 16-token prefix three requests share (four prefix-cache blocks of 4)."""
FIRST = [SHARED + [63, 30, 9], [11, 80, 6, 42, 27, 3, 66, 14], [50], SHARED + [1, 2, 3, 4, 5]]
"""Admitted together: 19, 8, 1 and 21 tokens (the shared prefix seen twice: worth a snapshot)."""
LATER = [SHARED + [70, 71], SHARED + [72, 73, 74, 75, 76, 77, 78]]
"""Admitted one at a time after the first wave: each starts from the cached prefix (a copy)."""
TOL = 1e-5


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, TransformersModel, HybridModel]:
    """A family's seeded random checkpoint: transformers' model, it as a ``TransformersModel``, and
    batchc's own model loaded from the same files."""
    name = str(request.param)
    d = tmp_path_factory.mktemp(name)
    hf = save_hf_model(name, d, seed=3)
    return name, hf, TransformersModel(hf), load_hf(d).model


def _generate(hf: Any, prompt: list[int]) -> list[int]:
    """transformers' greedy continuation of ``prompt`` alone, float32, no end-of-sequence stop."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    return [int(t) for t in out[0, len(prompt):]]


def _serve(engine: Engine, sampling: SamplingParams | None = None) -> list[list[int]]:
    with engine:
        for i, p in enumerate(FIRST):
            engine.admit(i, p, max_new_tokens=NEW, sampling=sampling)
        engine.run_until_done()
        for i, p in enumerate(LATER, start=len(FIRST)):
            engine.admit(i, p, max_new_tokens=NEW, sampling=sampling)
            engine.run_until_done()
        assert engine.cache is not None and engine.cache.stats.hit_tokens >= 2 * len(SHARED)  # both later requests copied the prefix
        counts = engine.ledger.counts(engine.target.pool_id)
        assert counts.cows >= 2 and counts.snapshots >= 1 and counts.clears >= len(FIRST)
        engine.drop_cache()
        engine.ledger.assert_drained()
        return [engine.outputs[RequestId(i)] for i in range(len(FIRST) + len(LATER))]


def _engine(model: Any, transformers: bool) -> Engine:
    return Engine(model, None, k=0, capacity=12, kv_capacity=1024, max_len=128, chunk_size=5, prefix_cache=PrefixCache(capacity=4, block=4),
                  transport=transformers_transport() if transformers else None)


def test_outputs_equal_generate_and_batchc_s_own_backend(family: tuple[str, Any, TransformersModel, HybridModel]) -> None:
    name, hf, model, own = family
    got = _serve(_engine(model, transformers=True))
    assert got == [_generate(hf, p) for p in FIRST + LATER], name
    assert got == _serve(_engine(own, transformers=False)), name


def test_sampled_outputs_equal_batchc_s_own_backend(family: tuple[str, Any, TransformersModel, HybridModel]) -> None:
    """batchc's sampler picks the tokens from transformers' logits: the same seeds, the same tokens."""
    name, _, model, own = family
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=11)
    assert _serve(_engine(model, transformers=True), sampling) == _serve(_engine(own, transformers=False), sampling), name


# -- the driver and the store, plan by plan ---------------------------------------------------------

def _scratch(hf: Any, tokens: list[int]) -> Any:
    """transformers' own cache after one run over ``tokens`` from nothing."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        hf(input_ids=torch.tensor([tokens]), past_key_values=cache, use_cache=True)
    return cache


def _assert_row_is(store: TransformersStore, slot: int, cache: Any) -> None:
    """Row ``slot`` of the store holds what the from-scratch run's cache holds."""
    row = store.row_state(slot)
    for i in store.mamba_layers:
        layer = cache.layers[i]
        assert torch.allclose(row[f"conv.{i}"], layer.conv_states[0][0], atol=TOL), (slot, i, "conv")
        assert torch.allclose(row[f"ssm.{i}"], layer.recurrent_states[0][0], atol=TOL), (slot, i, "ssm")
    for i in store.attn_layers:
        layer = cache.layers[i]
        assert row[f"keys.{i}"].shape == layer.keys[0].shape, (slot, i)
        assert torch.allclose(row[f"keys.{i}"], layer.keys[0], atol=TOL), (slot, i, "keys")
        assert torch.allclose(row[f"values.{i}"], layer.values[0], atol=TOL), (slot, i, "values")


def _req(rid: int, slot: int, tokens: list[int], intent: Clear | Continue | CopyFrom, *, more: bool = False,
         snapshot_to: int | None = None) -> AdmittedRequest:
    first = 1 + 64 * rid + intent.prefix_len  # (each request's positions its own KV locations)
    return AdmittedRequest(rid=RequestId(rid), slot=MambaSlot(slot), input_ids=tokens, kv_locs=list(range(first, first + len(tokens))), intent=intent,
                           more_chunks=more, snapshot_to=None if snapshot_to is None else MambaSlot(snapshot_to))


def _contents(store: TransformersStore) -> list[torch.Tensor]:
    """Every tensor of transformers' cache object the store holds, and the KV lengths."""
    out = [torch.from_numpy(store.lengths.copy())]
    for layer in store.cache.layers:
        for t in (getattr(layer, "conv_states", {}).get(0), getattr(layer, "recurrent_states", {}).get(0), getattr(layer, "keys", None),
                  getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                out.append(t.clone())
    return out


def _rows(store: TransformersStore) -> list[torch.Tensor]:
    """Every row's state (``TransformersStore.row_state``: Mamba states, KV up to its length) and the
    lengths: what a restore puts back (the KV scratch past a row's length is not state)."""
    return [torch.from_numpy(store.lengths.copy())] + [t for s in range(store.capacity + 1) for t in store.row_state(s).values()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _driver(model: TransformersModel) -> tuple[Ledger, Pipeline, TransformersBackend]:
    ledger = Ledger()
    return ledger, Pipeline(ledger), TransformersBackend(model, model.new_store(8, max_len=64), ledger)


def test_state_rows_after_chunks_and_a_prefix_copy_equal_a_from_scratch_run(family: tuple[str, Any, TransformersModel, HybridModel]) -> None:
    name, hf, model, _ = family
    ledger, pipe, be = _driver(model)
    prompt = SHARED + [63, 30, 9]
    # three chunks of slot 1 (7, 9, 3 tokens); the second one ends at the shared prefix: snapshot it into slot 5
    _, plan = pipe.prefill([_req(1, 1, prompt[:7], Clear(), more=True)])
    be.execute(plan)
    _assert_row_is(be.store, 1, _scratch(hf, prompt[:7]))
    _, plan = pipe.prefill([_req(1, 1, prompt[7:16], Continue(prefix_len=7), more=True, snapshot_to=5)])
    be.execute(plan)
    _assert_row_is(be.store, 5, _scratch(hf, SHARED))
    _, plan = pipe.prefill([_req(1, 1, prompt[16:], Continue(prefix_len=16))])
    first = be.execute(plan)
    _assert_row_is(be.store, 1, _scratch(hf, prompt))
    # slot 2 starts from the cached prefix (Mamba rows and KV copied by the ledger's op) beside a fresh slot 3
    other = SHARED + [70, 71]
    batch, plan = pipe.prefill([_req(2, 2, other[16:], CopyFrom(src=MambaSlot(5), prefix_len=16)), _req(3, 3, [50, 51], Clear())])
    out = be.execute(plan)
    _assert_row_is(be.store, 2, _scratch(hf, other))
    _assert_row_is(be.store, 3, _scratch(hf, [50, 51]))
    _assert_row_is(be.store, 5, _scratch(hf, SHARED))  # the source is left as it was
    with torch.no_grad():
        want = [int(hf(input_ids=torch.tensor([p])).logits[0, -1].argmax()) for p in (prompt, other, [50, 51])]
    assert [int(t) for t in first.tokens] + [int(t) for t in out.tokens] == want, name  # type: ignore[union-attr]
    # one decode of rows of different lengths (batched, the shorter row's KV masked): each row as a from-scratch run
    tokens = [int(t) for t in out.tokens]  # type: ignore[union-attr]
    _, dplan = pipe.decode(batch, DecodeContext(next_tokens=tokens, kv_locs=[1000, 1001]))
    be.execute(dplan)
    _assert_row_is(be.store, 2, _scratch(hf, other + tokens[:1]))
    _assert_row_is(be.store, 3, _scratch(hf, [50, 51] + tokens[1:]))
    ledger.assert_drained()


def test_a_replayed_or_stripped_plan_is_refused_before_transformers_cache_is_touched(family: tuple[str, Any, TransformersModel, HybridModel]) -> None:
    name, _, model, _ = family
    ledger, pipe, be = _driver(model)
    _, plan = pipe.prefill([_req(1, 1, SHARED[:6], Clear(), snapshot_to=4)])
    be.execute(plan)
    after = _contents(be.store)
    with pytest.raises(ResourceReplayError, match="already consumed"):
        be.execute(plan)  # type: ignore[linear-reuse]  # the replay is the test
    assert _same(after, _contents(be.store)), name
    # a prefill lowered and registered, then its copy with the ticket stripped: the row's registered clear is not carried
    _, plan2 = pipe.prefill([_req(2, 2, [7, 8, 9], Clear())])
    import attrs

    stripped = attrs.evolve(plan2, tickets=())
    with pytest.raises(TicketMismatchError, match="does not carry"):
        be.execute(stripped)
    assert _same(after, _contents(be.store)), name
    be.execute(plan2)
    ledger.assert_drained()


def test_a_failed_forward_leaves_the_store_as_it_was_and_the_plan_runs_again(
    family: tuple[str, Any, TransformersModel, HybridModel], monkeypatch: pytest.MonkeyPatch,
) -> None:
    name, hf, model, _ = family
    ledger, pipe, be = _driver(model)
    _, plan = pipe.prefill([_req(1, 1, SHARED[:5], Clear(), snapshot_to=4)])
    be.execute(plan)
    _, plan = pipe.prefill([_req(2, 2, SHARED[5:9], CopyFrom(src=MambaSlot(4), prefix_len=5)), _req(1, 1, SHARED[5:7], Continue(prefix_len=5))])
    before = _rows(be.store)
    calls = []
    real = TransformersModel.forward

    def failing(self: TransformersModel, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 2:  # the second row, after the first row's states were written
            raise RuntimeError("injected")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(TransformersModel, "forward", failing)
    with pytest.raises(RuntimeError, match="injected"):
        be.execute(plan)
    assert _same(before, _rows(be.store)), name
    assert len(ledger.outstanding()) == 1
    monkeypatch.setattr(TransformersModel, "forward", real)
    be.execute(plan)  # type: ignore[linear-reuse]  # its tickets went back to outstanding: it runs again
    _assert_row_is(be.store, 2, _scratch(hf, SHARED[:9]))
    _assert_row_is(be.store, 1, _scratch(hf, SHARED[:7]))
    ledger.assert_drained()


def test_refusals(family: tuple[str, Any, TransformersModel, HybridModel]) -> None:
    name, _, model, own = family
    with pytest.raises(PreconditionError, match="no draft model"):
        Engine(model, own, k=2, transport=transformers_transport())
    with pytest.raises(PreconditionError, match="transformers_transport"):
        Engine(model, None, k=0)  # batchc's executor cannot run it
    with pytest.raises(PreconditionError, match="penalties"):
        Engine(model, None, k=0, transport=transformers_transport(), penalties=True)
    ledger, pipe, be = _driver(model)
    _, plan = pipe.prefill([_req(1, 1, [4, 5], Clear())], keep_hidden=True)
    with pytest.raises(PlanExecutionError, match="hidden states"):
        be.execute(plan)
    # a continuation at 3 tokens of a slot that holds none: its state is not the plan's, refused inside the claim
    _, plan = pipe.prefill([_req(6, 6, [9], Continue(prefix_len=3))])
    before = _contents(be.store)
    with pytest.raises(PlanExecutionError, match="holds the state of 0 tokens"):
        be.execute(plan)
    assert _same(before, _contents(be.store)), name


def test_the_store_refuses_bad_arguments(family: tuple[str, Any, TransformersModel, HybridModel], tmp_path: Path) -> None:
    _, _, model, _ = family
    for kw in ({"capacity": 0}, {"capacity": True}, {"capacity": 4, "max_len": 0}, {"capacity": 4, "pool_id": ""}):
        with pytest.raises(PreconditionError):
            TransformersStore(model, **kw)  # type: ignore[arg-type]
    with pytest.raises(PlanExecutionError, match="out of range"):
        model.new_store(4).clear_rows([5])
