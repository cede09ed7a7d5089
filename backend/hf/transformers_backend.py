"""A Transformers backend: a Hugging Face hybrid checkpoint (Bamba, Granite-4.0-H, Nemotron-H) served
with transformers' own modeling code as the forward and transformers' own cache object as the
state store, scheduled by batchc's IR, with every clear and copy on that store claimed from
batchc's ledger (``backend.state_store.StateOps.applying``).

Parts:

- ``TransformersModel``: a transformers ``*ForCausalLM`` (in eval mode, no gradients) and the shapes
  of its cache, read by one probe forward through a fresh ``DynamicCache(config=...)`` (the cache
  transformers 5 builds for these families: a ``LinearAttentionLayer`` per Mamba layer, a
  ``DynamicLayer`` per attention layer). It is a ``backend.model.ServedModel`` for
  ``compiler.engine.Engine``'s argument checks (vocabulary, state layout); batchc's executor cannot
  run it (``new_pool`` and ``serving_hook`` refuse): an engine serves it through
  ``TransformersTransport``.
- ``TransformersStore``: a ``backend.state_store.RestorableStore`` over one ``DynamicCache`` whose
  batch dimension is the slot: row ``s`` of every Mamba layer's ``conv_states[0]``
  ``[capacity + 1, conv_dim, conv_kernel]`` and ``recurrent_states[0]``
  ``[capacity + 1, heads, head_dim, d_state]`` is slot ``s``'s recurrent state, and row ``s`` of every
  attention layer's ``keys`` / ``values`` ``[capacity + 1, kv_heads, allocated, head_dim]`` holds the
  first ``lengths[s]`` positions of slot ``s``'s attention KV (keys after the rotary embedding, as
  transformers caches them). Row 0 is padding, never named by a plan. A clear zeroes a row's
  Mamba state and sets its KV length to 0; a copy copies the whole row, Mamba state, KV and its
  length. The attention layers' own sequence length is the allocation (grown on demand, doubling,
  up to ``max_len``), not any row's: ``lengths`` says how much of each row is a sequence's, and
  the positions past it are scratch that no forward reads (a batched decode zeroes them in its
  gathered copy). A row's state is its Mamba states, its first ``lengths[s]`` keys and values and
  ``lengths[s]``: that is what ``save_rows`` keeps and ``restore_rows`` puts back.
- ``TransformersBackend``: the driver: runs batchc's ``ExtendPlan`` / ``DecodePlan`` / ``MixedPlan``
  (and answers an ``IdlePlan``) inside ``StateOps(ledger).applying(plan, store)``, so every ticket is
  claimed before the store is touched, the init ops (clears, copy-on-writes) run before the forward
  and the snapshots after it, and a failed forward leaves the store as it was. It is a
  ``backend.boundary.Backend`` (``submit`` runs the plan at once, as batchc's in-process executor).
- ``TransformersTransport``: a ``backend.boundary.Transport`` that opens one ``TransformersBackend``
  for an engine's target (``transformers_transport()``), so ``compiler.engine.Engine`` drives it
  like its own executors: prefix cache, chunked prefill, mixed forwards, retractions, retries.

Each forward, per plan row: an extend row runs transformers' model once on its chunk (batch 1),
continuing from ``prefix_lens`` tokens: a per-forward ``DynamicCache`` whose Mamba layers hold views
of the store's rows (transformers writes the new conv and SSM states into them in place) with
``has_previous_state`` set when the prefix is not empty, and whose attention layers hold the row's
first ``prefix_len`` keys and values; ``position_ids`` are the chunk's absolute positions. The
decode rows of a plan run as one batch: their KV gathered to the longest row's length, the positions
past a row's length masked out by a 2D attention mask (and zeroed), one token each at its own
position; their new Mamba states and their new key and value are written back into the store.
Logits are read at each row's last position (``logits_to_keep=1``), in plan order (extend rows,
then decode rows), and the tokens chosen by batchc's sampler (``backend.plan_sampling``: greedy for a
plan without sampling rows, ``NON_FINITE`` where the logits are not finite).

Attention KV is kept in transformers' cache rows rather than recomputed over each request's history:
attention at layer ``i`` needs the keys of every earlier token at layer ``i``, which depend on every
layer below it, Mamba layers included, so recomputing them means recomputing the whole prefix from
token 0 and would leave the store's Mamba rows unused. Kept in the rows, a prefix-cache copy
(``CopyFrom``) copies the Mamba state and the prefix's KV through the same ledger op, and a
snapshot takes both. The plan's ``kv_locs`` (batchc's token-granular KV locations) are not used: the
engine's KV allocator still bounds how many tokens are live, and ``share_prefix`` has nothing to do
(the copy carries the prefix's KV). Before each forward every row's KV length is checked against the
plan (an extend row holds exactly ``prefix_len`` positions, a decode row ``seq_len - 1``):
a row whose state does not belong to the tokens the plan continues is a ``PlanExecutionError``,
raised inside the claim (the rows the plan's init wrote are put back, its tickets stay outstanding).

Refused, each with one line (``PlanExecutionError`` before the ledger or the store sees the plan):
speculative plans (draft, verify, commits, draft extend) and a draft head's plans (this backend
serves a target at ``k = 0`` only), a plan that keeps hidden states for a head (``keep_hidden``), a
pipelined decode naming its inputs by sample (``inputs_from``: this backend is not concurrent, so an
engine never builds one), sampling rows with penalties (they need per-slot token counts, which
this backend does not keep), and a snapshot inside a chunk (``StateOps.applying`` refuses it: the
engine asks for none, since ``TransformersModel`` captures no inner states). The transport refuses a
draft model, a target that is not a ``TransformersModel`` and an engine with ``penalties``.
transformers is imported when a model is built, not with this module.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import numpy as np
import torch

from backend.allocator import SlotAllocator
from backend.boundary import InProcessGroup, Pending, run_now
from backend.ledger import Ledger
from backend.logprobs import logprobs_of
from backend.model import HeadHook, ServingModelHook
from backend.plan_sampling import penalised, sample_logits
from backend.pool import MambaLayerSpec, MambaStatePool, PoolLayout
from backend.state_store import StateOps
from ir.columns import frozen_i64
from ir.errors import PlanExecutionError, PreconditionError, short_repr
from ir.ids import TARGET_POOL, PoolId
from ir.linear import consumes
from ir.nodes import Plan
from ir.plan import DecodePlan, ExtendPlan, IdlePlan, MixedPlan
from ir.results import Ran, Result, Sampled
from ir.sampling import rows_joined

__all__ = [
    "CacheShapes",
    "TransformersBackend",
    "TransformersBackends",
    "TransformersModel",
    "TransformersStore",
    "TransformersTransport",
    "transformers_transport",
]

_FIRST_ALLOC: Final = 64
"""Positions of KV each attention row holds at first (the allocation doubles as sequences grow)."""


@attrs.frozen(kw_only=True)
class CacheShapes:
    """What one row of a model's transformers cache holds, per layer, as the probe forward found it:
    ``mamba[i] = (conv shape, conv dtype, SSM shape, SSM dtype)`` for each Mamba layer ``i`` (shapes
    without the batch dimension), ``attn[i] = (kv_heads, head_dim, dtype)`` for each attention layer
    ``i``; the other layers (Nemotron-H's MLPs) hold nothing; ``layers``: the cache's layer count."""

    mamba: Mapping[int, tuple[tuple[int, ...], torch.dtype, tuple[int, ...], torch.dtype]]
    attn: Mapping[int, tuple[int, int, torch.dtype]]
    layers: int

    def pool_layout(self) -> PoolLayout:
        """The Mamba state of one row as batchc's ``PoolLayout``, for the engine's memory bounds
        (batchc's conv state keeps one position fewer than transformers' ``conv_kernel``: the layout
        is that much smaller than the store's row, and counts no KV)."""
        specs = []
        for conv, conv_dtype, ssm, ssm_dtype in self.mamba.values():
            specs.append(MambaLayerSpec(conv_dim=conv[0], kernel_width=conv[1], nheads=ssm[0], head_dim=ssm[1], d_state=ssm[2],
                                        conv_dtype=conv_dtype, ssm_dtype=ssm_dtype))
        return PoolLayout(layers=specs)


def _import_transformers() -> Any:
    """transformers, loaded by importlib rather than an import statement: it is an optional
    dependency (``batchc[transformers]``), and a user's strict mypy over batchc's modules, where it is
    not installed, would report an import it cannot find inside batchc."""
    try:
        return importlib.import_module("transformers")
    except ImportError as exc:
        raise PreconditionError("TransformersModel", f"needs transformers installed (pip install 'batchc[transformers]'): {exc}") from None


class TransformersModel:
    """A transformers causal LM of a hybrid family, served with its own modeling code (see the
    module). ``model``: a transformers ``BambaForCausalLM``, ``GraniteMoeHybridForCausalLM`` or
    ``NemotronHForCausalLM`` (put in eval mode); ``from_pretrained`` loads one from a checkpoint
    directory. Refused (``PreconditionError``): another model type, a cache layer this backend does
    not keep (sliding window, hybrid layers), a model whose probe forward leaves no state."""

    FAMILIES: Final = ("bamba", "granitemoehybrid", "nemotron_h")
    """The ``model_type`` values served."""

    def __init__(self, model: Any) -> None:
        transformers = _import_transformers()
        try:
            kind = model.config.model_type if isinstance(model, transformers.PreTrainedModel) and model.lm_head is not None else None
        except AttributeError:  # no language-model head: not a causal LM
            kind = None
        if kind is None:
            raise PreconditionError("TransformersModel", f"model must be a transformers causal LM, got {short_repr(model)}")
        if kind not in self.FAMILIES:
            raise PreconditionError("TransformersModel", f"model_type {kind!r} is not one of {list(self.FAMILIES)}")
        self.model: Any = model.eval()
        self.config: Any = model.config
        self.family: str = str(kind)
        self.seconds = 0.0
        """Seconds spent in the model's forwards so far (every backend built on this model adds)."""
        self.shapes = self._probe()

    @classmethod
    def from_pretrained(cls, directory: str | Path, *, dtype: torch.dtype = torch.float32) -> TransformersModel:
        """The checkpoint in ``directory`` (``config.json`` and safetensors weights), loaded by
        transformers itself in ``dtype``, from local files only (without transformers' progress
        bar, which is put back as it was)."""
        transformers = _import_transformers()
        logging = transformers.utils.logging
        shown = logging.is_progress_bar_enabled()
        logging.disable_progress_bar()
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype, local_files_only=True)
        finally:
            if shown:
                logging.enable_progress_bar()
        return cls(model)

    def _probe(self) -> CacheShapes:
        """One token through a fresh ``DynamicCache(config=...)``: the cache transformers builds for
        this model, and the shape and dtype of every state it keeps."""
        transformers = _import_transformers()
        cache_utils = transformers.cache_utils
        cache = transformers.DynamicCache(config=self.config)
        device = self.device
        with torch.no_grad():
            self.model(input_ids=torch.zeros((1, 1), dtype=torch.int64, device=device), position_ids=torch.zeros((1, 1), dtype=torch.int64, device=device),
                       past_key_values=cache, use_cache=True)
        mamba: dict[int, tuple[tuple[int, ...], torch.dtype, tuple[int, ...], torch.dtype]] = {}
        attn: dict[int, tuple[int, int, torch.dtype]] = {}
        for i, layer in enumerate(cache.layers):
            if type(layer) is cache_utils.LinearAttentionLayer:
                if layer.number_of_states != 1:
                    raise PreconditionError("TransformersModel", f"layer {i} keeps {layer.number_of_states} conv states; this backend keeps one")
                conv, ssm = layer.conv_states[0], layer.recurrent_states[0]
                if conv is None and ssm is None:
                    continue  # an MLP or MoE layer: transformers' placeholder, no state
                if conv is None or ssm is None:
                    raise PreconditionError("TransformersModel", f"layer {i} keeps a conv state or an SSM state but not both")
                mamba[i] = (tuple(conv.shape[1:]), conv.dtype, tuple(ssm.shape[1:]), ssm.dtype)
            elif type(layer) is cache_utils.DynamicLayer:
                keys = layer.keys
                attn[i] = (int(keys.shape[1]), int(keys.shape[3]), keys.dtype)
            else:
                raise PreconditionError("TransformersModel", f"layer {i}'s cache is a {type(layer).__name__}; this backend keeps full attention and Mamba layers only")
        if not mamba and not attn:
            raise PreconditionError("TransformersModel", "the model's cache keeps no state")
        return CacheShapes(mamba=mamba, attn=attn, layers=len(cache.layers))

    @property
    def device(self) -> torch.device:
        """Where the model's weights are."""
        return torch.device(next(self.model.parameters()).device)

    @property
    def vocab(self) -> int:
        """Token ids are ``[0, vocab)`` (``config.vocab_size``)."""
        return int(self.config.vocab_size)

    def pool_layout(self) -> PoolLayout:
        """The per-slot Mamba state (``CacheShapes.pool_layout``), for the engine's memory bounds."""
        return self.shapes.pool_layout()

    def new_pool(self, capacity: int, *, pool_id: PoolId) -> MambaStatePool:
        """Refused: the state lives in transformers' cache (``TransformersStore``), which only
        ``TransformersTransport`` serves."""
        raise PreconditionError("TransformersModel", "its state lives in transformers' cache: serve it with backend.hf.transformers_backend.transformers_transport()")

    def serving_hook(self, *, capacity: int, kv_capacity: int, max_len: int) -> ServingModelHook[Any] | HeadHook:
        """Refused, as ``new_pool``: batchc's executor cannot run transformers' forward."""
        raise PreconditionError("TransformersModel", "batchc's executor cannot run it: serve it with backend.hf.transformers_backend.transformers_transport()")

    def new_store(self, capacity: int, *, pool_id: PoolId = TARGET_POOL, max_len: int = 1 << 20) -> TransformersStore:
        """A zeroed ``TransformersStore`` of ``capacity`` slots for this model."""
        return TransformersStore(self, capacity, pool_id=pool_id, max_len=max_len)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: Any, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """transformers' forward over ``input_ids [B, T]`` at ``position_ids [B, T]`` continuing
        ``cache`` (a ``DynamicCache``, updated in place): float32 logits at each row's last
        position, ``[B, vocab]``."""
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                out = self.model(input_ids=input_ids, position_ids=position_ids, past_key_values=cache, attention_mask=attention_mask,
                                 use_cache=True, logits_to_keep=1)
            logits: torch.Tensor = out.logits[:, -1, :].float()
            return logits
        finally:
            self.seconds += time.perf_counter() - t0

    def __repr__(self) -> str:
        return f"TransformersModel({type(self.model).__name__}, {self.shapes.layers} layers, vocab {self.vocab})"


class TransformersStore:
    """A ``RestorableStore`` over one transformers ``DynamicCache`` whose batch rows are slots
    ``0..capacity`` (see the module): ``cache`` is that object, ``lengths[s]`` the KV positions row
    ``s`` holds. ``capacity`` in ``[1, 2**20]`` and ``max_len >= 1`` (the longest sequence a row
    holds), else ``PreconditionError``."""

    def __init__(self, model: TransformersModel, capacity: int, *, pool_id: PoolId = TARGET_POOL, max_len: int = 1 << 20) -> None:
        args: tuple[object, object, object, object] = (model, capacity, max_len, pool_id)  # typed; checked because callers need not be typed
        if not isinstance(args[0], TransformersModel):
            raise PreconditionError("TransformersStore", f"model must be a TransformersModel, got {short_repr(model)}")
        if type(args[1]) is not int or not 1 <= args[1] <= 1 << 20:
            raise PreconditionError("TransformersStore", f"capacity must be an int in [1, 2**20], got {short_repr(capacity)}")
        if type(args[2]) is not int or args[2] < 1:
            raise PreconditionError("TransformersStore", f"max_len must be a positive int, got {short_repr(max_len)}")
        if not isinstance(args[3], str) or not args[3]:
            raise PreconditionError("TransformersStore", f"pool_id must be a non-empty str, got {short_repr(pool_id)}")
        transformers = _import_transformers()
        self.model = model
        self._pool_id = PoolId(pool_id)
        self._capacity = capacity
        self.max_len = max_len
        device = model.device
        self._alloc = min(_FIRST_ALLOC, max_len)
        self.cache: Any = transformers.DynamicCache(config=model.config)
        """transformers' own cache object, its batch dimension the slot."""
        rows = capacity + 1
        for i, (conv, conv_dtype, ssm, ssm_dtype) in model.shapes.mamba.items():
            layer = self.cache.layers[i]
            _set_linear(layer, torch.zeros((rows, *conv), dtype=conv_dtype, device=device),
                        torch.zeros((rows, *ssm), dtype=ssm_dtype, device=device), previous=True)
        for i, (heads, dim, dtype) in model.shapes.attn.items():
            layer = self.cache.layers[i]
            empty = torch.zeros((rows, heads, 0, dim), dtype=dtype, device=device)
            layer.lazy_initialization(empty, empty)
            layer.keys = torch.zeros((rows, heads, self._alloc, dim), dtype=dtype, device=device)
            layer.values = torch.zeros((rows, heads, self._alloc, dim), dtype=dtype, device=device)
        self.lengths = np.zeros(rows, dtype=np.int64)
        """KV positions each row holds (row ``s``: ``keys[s, :, :lengths[s]]``)."""

    @property
    def pool_id(self) -> PoolId:
        """The pool the plans' tickets for this store are addressed to."""
        return self._pool_id

    @property
    def capacity(self) -> int:
        """Rows ``1..capacity`` are slots; row 0 is padding."""
        return self._capacity

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        """The indices of the layers with a Mamba state."""
        return tuple(self.model.shapes.mamba)

    @property
    def attn_layers(self) -> tuple[int, ...]:
        """The indices of the attention layers."""
        return tuple(self.model.shapes.attn)

    def _tensors(self) -> list[torch.Tensor]:
        """Every Mamba state tensor (conv, then SSM, per layer)."""
        out = []
        for i in self.mamba_layers:
            layer = self.cache.layers[i]
            out += [layer.conv_states[0], layer.recurrent_states[0]]
        return out

    def _kv(self) -> list[Any]:
        return [self.cache.layers[i] for i in self.attn_layers]

    def _index(self, slots: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(slots), dtype=torch.int64, device=self.model.device)

    def _check(self, what: str, slots: Sequence[int]) -> list[int]:
        out = [int(s) for s in slots]
        bad = [s for s in out if not 0 <= s <= self._capacity]
        if bad:
            raise PlanExecutionError(f"TransformersStore.{what}: slot {bad[0]} out of range [0, {self._capacity}]")
        return out

    def reserve(self, length: int) -> None:
        """Make every attention row hold at least ``length`` positions (``PlanExecutionError`` past
        ``max_len``); rows keep what they hold."""
        if length <= self._alloc:
            return
        if length > self.max_len:
            raise PlanExecutionError(f"TransformersStore: a sequence of {length} tokens is longer than max_len {self.max_len}")
        new = min(max(length, 2 * self._alloc), self.max_len)
        for layer in self._kv():
            layer.keys, layer.values = (_grown(t, new, self._alloc) for t in (layer.keys, layer.values))
        self._alloc = new

    def clear_rows(self, slots: Sequence[int]) -> None:
        """Zero the rows' Mamba states; their KV length becomes 0."""
        rows = self._check("clear_rows", slots)
        idx = self._index(rows)
        for t in self._tensors():
            t.index_fill_(0, idx, 0)
        self.lengths[rows] = 0

    def copy_rows(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Row ``dst[i]`` becomes row ``src[i]``: Mamba states, KV and KV length (every source read
        before any write)."""
        s, d = self._check("copy_rows", src), self._check("copy_rows", dst)
        if len(s) != len(d):
            raise PlanExecutionError(f"TransformersStore.copy_rows: {len(s)} sources for {len(d)} destinations")
        if not s:
            return
        si, di = self._index(s), self._index(d)
        for t in self._tensors():
            t.index_copy_(0, di, t.index_select(0, si))
        n = int(self.lengths[s].max())
        for layer in self._kv():
            for t in (layer.keys, layer.values):
                t[:, :, :n].index_copy_(0, di, t[:, :, :n].index_select(0, si))
        self.lengths[d] = self.lengths[s].copy()

    def save_rows(self, slots: Sequence[int]) -> object:
        """Copies of the rows' states: Mamba states, KV up to the longest row's length, lengths
        (the scratch past a row's length is not kept: see the module)."""
        rows = self._check("save_rows", slots)
        idx = self._index(rows)
        n = int(self.lengths[rows].max()) if rows else 0
        kv = [(layer.keys[:, :, :n].index_select(0, idx), layer.values[:, :, :n].index_select(0, idx)) for layer in self._kv()]
        return _Saved(rows=tuple(rows), states=[t.index_select(0, idx) for t in self._tensors()], kv=kv, lengths=self.lengths[rows].copy())

    def restore_rows(self, slots: Sequence[int], saved: object) -> None:
        """Put back the rows' states ``save_rows(slots)`` returned (``PlanExecutionError`` for
        anything else)."""
        rows = self._check("restore_rows", slots)
        if not isinstance(saved, _Saved) or list(saved.rows) != rows:
            raise PlanExecutionError(f"TransformersStore.restore_rows: saved must be what save_rows({rows}) returned, got {short_repr(saved)}")
        idx = self._index(rows)
        for t, old in zip(self._tensors(), saved.states, strict=True):
            t.index_copy_(0, idx, old)
        for layer, (k, v) in zip(self._kv(), saved.kv, strict=True):
            n = k.shape[2]
            layer.keys[:, :, :n].index_copy_(0, idx, k)
            layer.values[:, :, :n].index_copy_(0, idx, v)
        self.lengths[rows] = saved.lengths

    def row_state(self, slot: int) -> dict[str, torch.Tensor]:
        """Copies of row ``slot``: ``conv.{i}`` and ``ssm.{i}`` per Mamba layer ``i``, ``keys.{i}``
        and ``values.{i}`` (its ``lengths[slot]`` positions) per attention layer ``i``."""
        (s,) = self._check("row_state", [slot])
        out: dict[str, torch.Tensor] = {}
        for i in self.mamba_layers:
            layer = self.cache.layers[i]
            out[f"conv.{i}"] = layer.conv_states[0][s].clone()
            out[f"ssm.{i}"] = layer.recurrent_states[0][s].clone()
        n = int(self.lengths[s])
        for i in self.attn_layers:
            layer = self.cache.layers[i]
            out[f"keys.{i}"] = layer.keys[s, :, :n].clone()
            out[f"values.{i}"] = layer.values[s, :, :n].clone()
        return out

    # -- the per-forward caches transformers' model runs on -------------------------------------

    def _row_cache(self, slots: list[int], lengths: list[int]) -> tuple[Any, list[torch.Tensor]]:
        """A ``DynamicCache`` of batch ``len(slots)`` continuing those rows from ``lengths``
        positions (one row: views of the store's Mamba rows, written in place; several: gathered
        copies, written back by ``_write_back``), and the valid-position mask of its KV."""
        transformers = _import_transformers()
        cache = transformers.DynamicCache(config=self.model.config)
        one = len(slots) == 1
        idx = self._index(slots)
        previous = min(lengths) > 0
        if previous != (max(lengths) > 0):
            raise PlanExecutionError("TransformersStore: rows that start at token 0 and rows that continue cannot share a forward")
        for i in self.mamba_layers:
            src = self.cache.layers[i]
            conv, ssm = src.conv_states[0], src.recurrent_states[0]
            if one:
                s = slots[0]
                _set_linear(cache.layers[i], conv[s : s + 1], ssm[s : s + 1], previous=previous)
            else:
                _set_linear(cache.layers[i], conv.index_select(0, idx), ssm.index_select(0, idx), previous=previous)
        top = max(lengths)
        valid: list[torch.Tensor] = []
        if top:
            lens = torch.tensor(lengths, dtype=torch.int64, device=idx.device)
            mask = torch.arange(top, device=idx.device)[None, :] < lens[:, None]  # [B, top]
            valid = [mask]
            for i in self.attn_layers:
                src = self.cache.layers[i]
                if one:
                    s = slots[0]
                    k, v = src.keys[s : s + 1, :, :top], src.values[s : s + 1, :, :top]
                else:
                    keep = mask[:, None, :, None]
                    k = torch.where(keep, src.keys[:, :, :top].index_select(0, idx), 0)
                    v = torch.where(keep, src.values[:, :, :top].index_select(0, idx), 0)
                layer = cache.layers[i]
                layer.lazy_initialization(k[:, :, :0], v[:, :, :0])
                layer.keys, layer.values = k, v
        return cache, valid

    def _write_back(self, cache: Any, slots: list[int], lengths: list[int], new: int) -> None:
        """After a forward of ``new`` tokens per row on ``_row_cache(slots, lengths)``: each row's
        Mamba state (unless it was written in place) and its ``new`` keys and values into the store,
        and its length."""
        idx = self._index(slots)
        one = len(slots) == 1
        top = max(lengths)
        for i in self.mamba_layers:
            src, ran = self.cache.layers[i], cache.layers[i]
            for mine, theirs in ((src.conv_states[0], ran.conv_states[0]), (src.recurrent_states[0], ran.recurrent_states[0])):
                if one and theirs.data_ptr() == mine[slots[0]].data_ptr():
                    continue  # transformers wrote the store's row in place
                mine.index_copy_(0, idx, theirs.to(mine.dtype))
        ends = [n + new for n in lengths]
        self.reserve(max(ends))
        for i in self.attn_layers:
            src, ran = self.cache.layers[i], cache.layers[i]
            if ran.keys is None or ran.keys.shape[2] != top + new:
                got = None if ran.keys is None else tuple(ran.keys.shape)
                raise PlanExecutionError(f"TransformersStore: attention layer {i} came back with keys {got}, expected {top + new} positions")
            if one:
                s, n = slots[0], lengths[0]
                src.keys[s, :, n : n + new] = ran.keys[0, :, top : top + new]
                src.values[s, :, n : n + new] = ran.values[0, :, top : top + new]
            else:
                pos = torch.tensor(lengths, dtype=torch.int64, device=idx.device)
                for j in range(new):
                    src.keys[idx, :, pos + j] = ran.keys[:, :, top + j]
                    src.values[idx, :, pos + j] = ran.values[:, :, top + j]
        self.lengths[slots] = ends

    def __repr__(self) -> str:
        return (f"TransformersStore(pool={self._pool_id!r}, capacity={self._capacity}, mamba layers {list(self.mamba_layers)}, "
                f"attention layers {list(self.attn_layers)}, KV allocated {self._alloc})")


@attrs.frozen(eq=False)
class _Saved:
    """What ``TransformersStore.save_rows`` returns."""

    rows: tuple[int, ...]
    states: list[torch.Tensor]
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    lengths: np.ndarray[Any, np.dtype[np.int64]]


def _set_linear(layer: Any, conv: torch.Tensor, ssm: torch.Tensor, *, previous: bool) -> None:
    """Give a transformers ``LinearAttentionLayer`` its conv and SSM state tensors (as its own lazy
    initialisation would, without allocating), ``previous``: whether they hold a sequence's state."""
    layer.conv_states[0] = conv
    layer.recurrent_states[0] = ssm
    layer.is_conv_states_initialized[0] = True
    layer.is_recurrent_states_initialized[0] = True
    layer.conv_kernel_size[0] = int(conv.shape[-1])
    layer.has_previous_state[0] = previous
    layer.dtype, layer.device = conv.dtype, conv.device


class TransformersBackend:
    """The driver (see the module): runs batchc's plans with transformers' forward on a
    ``TransformersStore``, every one-shot op through ``StateOps(ledger).applying``. A
    ``backend.boundary.Backend``: ``submit`` runs the plan at once (a refusal, a ``BatchcError``, is
    raised there with nothing run; any other failure at ``wait``)."""

    def __init__(self, model: TransformersModel, store: TransformersStore, ledger: Ledger) -> None:
        given: object = store  # typed; checked because callers need not be typed
        if not isinstance(given, TransformersStore) or given.model is not model:
            raise PreconditionError("TransformersBackend", f"store must be a TransformersStore of this model, got {short_repr(store)}")
        self.model = model
        self.store = store
        self.ledger = ledger
        self.ops = StateOps(ledger)

    @property
    def pool_id(self) -> PoolId:
        """The store's pool."""
        return self.store.pool_id

    @property
    def usable(self) -> bool:
        """Always: nothing to lose (no process, no group)."""
        return True

    @consumes
    def submit(self, plan: Plan) -> Pending:
        """Run ``plan`` now (``backend.boundary.Backend.submit``)."""
        return run_now(self.execute, plan)

    def wait(self, pending: Pending) -> Result:
        """The result of a plan ``submit`` ran, or what failed raised."""
        return pending.outcome()

    def forget_verifies(self) -> None:
        """Nothing kept: this backend runs no verify or draft."""

    @consumes
    def execute(self, plan: Plan) -> Result:
        """Run ``plan`` (see the module for what is refused) and give back its ``Sampled`` tokens
        (``Ran`` for an ``IdlePlan``)."""
        match plan:
            case ExtendPlan() | MixedPlan() | DecodePlan():
                return self.run(plan)
            case IdlePlan():
                return Ran(rids=plan.rids)
            case _:
                raise PlanExecutionError(
                    f"{type(plan).__name__}: the transformers backend runs prefills, decodes and mixed forwards only "
                    "(no speculative decoding, no draft head)"
                )

    @consumes
    def run(self, plan: ExtendPlan | MixedPlan | DecodePlan) -> Sampled:
        """One forward: claim and apply the plan's ops around transformers' model over its rows,
        then choose each row's token (extend rows first)."""
        ext = plan if isinstance(plan, ExtendPlan) else plan.extend if isinstance(plan, MixedPlan) else None
        dec = plan if isinstance(plan, DecodePlan) else plan.decode if isinstance(plan, MixedPlan) else None
        what = type(plan).__name__
        if ext is not None and ext.keep_hidden is not None:
            raise PlanExecutionError(f"{what}: keeps hidden states for a draft head, which the transformers backend does not serve")
        if dec is not None and dec.inputs_from is not None:
            raise PlanExecutionError(f"{what}: a pipelined decode (inputs from sample #{dec.inputs_from}) needs a concurrent backend")
        rows = _sampling(plan)
        if penalised(rows):
            raise PlanExecutionError(f"{what}: sampling penalties need per-slot token counts, which the transformers backend does not keep")
        with self.ops.applying(plan, self.store):
            logits = self._forward(ext, dec)
        positions = []
        if ext is not None:
            positions += (ext.prefix_lens + ext.extend_lens).tolist()
        if dec is not None:
            positions += dec.seq_lens.tolist()
        tokens = sample_logits(logits, rows, frozen_i64(positions))
        return Sampled(rids=plan.rids, tokens=tokens, logprobs=logprobs_of(logits, tokens, rows))

    def _forward(self, ext: ExtendPlan | None, dec: DecodePlan | None) -> torch.Tensor:
        """Logits ``[rows, vocab]``: each extend row's chunk on its own, then the decode rows in one
        batch. Each row's KV length is checked against the plan first (see the module)."""
        store, device = self.store, self.model.device
        out: list[torch.Tensor] = []
        if ext is not None:
            starts = np.concatenate(([0], np.cumsum(ext.extend_lens)))
            for j, (slot, prefix, n) in enumerate(zip(ext.slots.tolist(), ext.prefix_lens.tolist(), ext.extend_lens.tolist(), strict=True)):
                self._check_length(slot, prefix, "ExtendPlan row with prefix_len")
                store.reserve(prefix + n)
                ids = torch.from_numpy(ext.input_ids[starts[j] : starts[j + 1]].copy()).to(device)[None, :]
                pos = torch.arange(prefix, prefix + n, dtype=torch.int64, device=device)[None, :]
                cache, _ = store._row_cache([slot], [prefix])
                out.append(self.model.forward(ids, pos, cache))
                store._write_back(cache, [slot], [prefix], n)
        if dec is not None and dec.num_requests:
            slots = dec.slots.tolist()
            lengths = [int(n) - 1 for n in dec.seq_lens.tolist()]
            for slot, n in zip(slots, lengths, strict=True):
                self._check_length(slot, n, "DecodePlan row at position")
            store.reserve(max(lengths) + 1)
            ids = torch.from_numpy(dec.input_ids.copy()).to(device)[:, None]
            pos = torch.tensor(lengths, dtype=torch.int64, device=device)[:, None]
            cache, valid = store._row_cache(slots, lengths)
            mask = None
            if len(slots) > 1 and valid and not bool(valid[0].all()):
                mask = torch.cat((valid[0], torch.ones((len(slots), 1), dtype=torch.bool, device=device)), dim=1).to(torch.int64)
            out.append(self.model.forward(ids, pos, cache, attention_mask=mask))
            store._write_back(cache, slots, lengths, 1)
        if not out:
            return torch.zeros((0, self.model.vocab))
        return torch.cat(out, dim=0) if len(out) > 1 else out[0]

    def _check_length(self, slot: int, expected: int, what: str) -> None:
        held = int(self.store.lengths[slot])
        if held != expected:
            raise PlanExecutionError(
                f"{what} {expected}: slot {slot} holds the state of {held} tokens (a copy from a slot of another length, or rows out of step with the plan)"
            )


def _sampling(plan: ExtendPlan | MixedPlan | DecodePlan) -> Any:
    """The plan's sampling rows, aligned with its rows (``None``: every row greedy)."""
    if isinstance(plan, MixedPlan):
        return rows_joined(plan.extend.sampling, plan.extend.num_requests, plan.decode.sampling, plan.decode.num_requests)
    return plan.sampling


class TransformersBackends(InProcessGroup):
    """``backend.boundary.Backends`` of a ``TransformersTransport``: one ``TransformersBackend`` (the
    target's), in this process."""

    def __init__(self, backend: TransformersBackend) -> None:
        super().__init__([backend])
        self.backend = backend

    def share_prefix(self, src: int, dst: int, length: int) -> None:
        """Nothing to do: the ``CopyFrom`` that starts ``dst`` copies ``src``'s prefix KV with its
        Mamba state (the store's rows hold both)."""

    def cancel_outstanding(self, reason: str) -> None:
        """Nothing to cancel: the engine's ledger is the only one."""

    def close(self) -> None:
        """Nothing to stop."""


class TransformersTransport:
    """A ``backend.boundary.Transport`` that serves a ``TransformersModel`` target in this process
    (``TransformersBackend`` on a fresh ``TransformersStore`` of the engine's capacity and
    ``max_len``, under the engine's ledger). Refuses a draft, any other target, and penalties."""

    def __repr__(self) -> str:
        return "TransformersTransport()"

    def refusal(self, models: Mapping[PoolId, Any], *, retries: int) -> str | None:
        """Why these models cannot be served (one line), or ``None``: the target only, a
        ``TransformersModel`` (any ``retries``: the store restores a failed forward's rows)."""
        if set(models) != {TARGET_POOL}:
            return "the transformers backend serves a target alone (k = 0): no draft model, no speculative decoding"
        if not isinstance(models[TARGET_POOL], TransformersModel):
            return f"the transformers transport serves a TransformersModel, not a {type(models[TARGET_POOL]).__name__}"
        return None

    def open(
        self, models: Mapping[PoolId, Any], *, ledger: Ledger, slots: SlotAllocator, capacity: int, kv_capacity: int,
        max_len: int, retries: int, penalties: bool = False,
    ) -> TransformersBackends:
        """The target's ``TransformersBackend`` (``PreconditionError`` with ``penalties``, or for
        models ``refusal`` refuses)."""
        refusal = self.refusal(models, retries=retries)
        if refusal is not None:
            raise PreconditionError("TransformersTransport", refusal)
        if penalties:
            raise PreconditionError("TransformersTransport", "penalties need per-slot token counts, which the transformers backend does not keep")
        model = models[TARGET_POOL]
        assert isinstance(model, TransformersModel)  # (refusal)
        store = model.new_store(capacity, pool_id=TARGET_POOL, max_len=max_len)
        return TransformersBackends(TransformersBackend(model, store, ledger))


def transformers_transport() -> TransformersTransport:
    """The transport an engine serving a ``TransformersModel`` is built with."""
    return TransformersTransport()


def _grown(t: torch.Tensor, length: int, kept: int) -> torch.Tensor:
    """``t`` (``[rows, kv_heads, positions, head_dim]``) with room for ``length`` positions, its first
    ``kept`` positions copied."""
    grown = torch.zeros((t.shape[0], t.shape[1], length, t.shape[3]), dtype=t.dtype, device=t.device)
    grown[:, :, :kept] = t[:, :, :kept]
    return grown
