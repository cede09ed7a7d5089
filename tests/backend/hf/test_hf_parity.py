"""Logit parity with transformers (the reference implementation) for every supported family, on
tiny seeded models saved with ``save_pretrained`` and loaded by ``backend.hf.load_hf``: the full
sequence, extend then teacher-forced decode, chunked prefill, a prefix-state copy-on-write, and
verify then commit; and a sensitivity check that each architecture feature matters (removing it
moves the logits by far more than the tolerance), so the parity cannot hold by accident."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from backend.hf import HFModel, load_hf
from backend.hybrid import HybridModel
from backend.hybrid.reference import reference_logits
from tests.backend.hf.builders import FAMILY_NAMES, hf_logits, save_hf_model
from tests.helpers import Backend, grid, ids

TOL = 1e-4
PROMPTS = [[5, 17, 33, 8, 60, 2 + 1, 44, 90, 12, 7, 71, 25, 38, 19, 4, 55, 63, 30, 9],
           [11, 80, 6, 42, 27, 3, 66, 14],
           [50]]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.float() - b.float()).abs().max())


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, HFModel]:
    family = str(request.param)
    d = tmp_path_factory.mktemp(family)
    hf = save_hf_model(family, d, seed=3)
    return hf, load_hf(d)


def test_the_loader_reads_the_family_and_its_switches(pair: tuple[Any, HFModel]) -> None:
    hf, loaded = pair
    c = loaded.model.config
    assert loaded.hf.family == hf.config.model_type
    assert c.vocab == hf.config.vocab_size and c.kv_heads == 2 and c.attn_heads == 4
    assert loaded.hf.eos_ids == (2,) and loaded.hf.bos_id == 1
    expected = {
        "bamba": {"attn_kv_heads", "rotary_dim", "norm_groups"},
        "granitemoehybrid": {"attn_kv_heads", "rotary_dim", "attn_scale", "norm_groups", "tie_embeddings", "embed_scale",
                             "residual_scale", "logit_scale"},
        "nemotron_h": {"block", "attn_kv_heads", "rotary_dim", "mlp_kind", "norm_groups", "dt_min"},
    }[loaded.hf.family]
    assert set(c.switched()) == expected


def test_the_kv_cache_holds_only_the_kv_heads(pair: tuple[Any, HFModel]) -> None:
    _, loaded = pair
    c = loaded.model.config
    kv = loaded.model.new_kv_cache(16)
    assert c.kv_heads == 2 < c.attn_heads == 4
    assert kv.k.shape == kv.v.shape == (c.n_attn, 17, 2, c.attn_head_dim)  # KV heads only, nothing repeated


def test_full_sequence_logits_equal_transformers(pair: tuple[Any, HFModel]) -> None:
    hf, loaded = pair
    for prompt in PROMPTS:
        want = hf_logits(hf, prompt)
        assert max_diff(reference_logits(loaded.model, prompt), want) <= TOL
        be = Backend(loaded.model)
        out = be.extend([(1, prompt, 0)])
        assert max_diff(out.logits[0], want[-1]) <= TOL
    # a batch of prompts in one extend
    be = Backend(loaded.model)
    out = be.extend([(s, p, 0) for s, p in zip((2, 5, 3), PROMPTS, strict=True)])
    for row, prompt in enumerate(PROMPTS):
        assert max_diff(out.logits[row], hf_logits(hf, prompt)[-1]) <= TOL


def test_extend_then_teacher_forced_decode_equals_transformers_at_every_position(pair: tuple[Any, HFModel]) -> None:
    hf, loaded = pair
    seqs = [PROMPTS[0], PROMPTS[1]]
    split = [5, 3]
    want = [hf_logits(hf, s) for s in seqs]
    be = Backend(loaded.model)
    out = be.extend([(s + 1, seq[:n], 0) for s, (seq, n) in enumerate(zip(seqs, split, strict=True))])
    for row in range(2):
        assert max_diff(out.logits[row], want[row][split[row] - 1]) <= TOL
    for step in range(len(seqs[1]) - split[1]):
        rows = [(r + 1, seqs[r][split[r] + step], split[r] + step) for r in range(2)]
        out = be.decode(rows)
        for r in range(2):
            assert max_diff(out.logits[r], want[r][split[r] + step]) <= TOL


@pytest.mark.parametrize("cuts", [(4,), (3, 11), (1, 8, 16)])
def test_chunked_prefill_equals_transformers(pair: tuple[Any, HFModel], cuts: tuple[int, ...]) -> None:
    hf, loaded = pair
    prompt = PROMPTS[0]
    want = hf_logits(hf, prompt)
    be = Backend(loaded.model)
    bounds = [0, *cuts, len(prompt)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        out = be.extend([(1, prompt[a:b], a), (2 + bounds.index(a), PROMPTS[1], 0)])
        assert max_diff(out.logits[0], want[b - 1]) <= TOL
        assert max_diff(out.logits[1], hf_logits(hf, PROMPTS[1])[-1]) <= TOL


def test_a_prefix_state_copied_on_write_equals_transformers(pair: tuple[Any, HFModel]) -> None:
    hf, loaded = pair
    prompt = PROMPTS[0]
    split = 9
    be = Backend(loaded.model)
    be.extend([(1, prompt[:split], 0)])
    be.pool.buffer[4] = be.pool.buffer[1]  # the COW: one row copy
    be.table.copy_prefix(1, 4, split)  # and the prefix's KV locations shared
    out = be.extend([(4, prompt[split:], split)])
    assert max_diff(out.logits[0], hf_logits(hf, prompt)[-1]) <= TOL
    other = prompt[:split] + [70, 71, 72]
    out = be.extend([(1, other[split:], split)])  # the source goes on differently, unaffected
    assert max_diff(out.logits[0], hf_logits(hf, other)[-1]) <= TOL


def test_verify_then_commit_equals_transformers_and_sequential_decode(pair: tuple[Any, HFModel]) -> None:
    hf, loaded = pair
    model: HybridModel = loaded.model
    prompt, window = PROMPTS[1], [9, 31, 47, 3]
    full = prompt + window
    want = hf_logits(hf, full)
    be = Backend(model)
    be.extend([(2, prompt, 0)])
    n = len(prompt)
    out = model.verify(
        be.pool, be.kv, be.table, slots=ids([2]), input_ids=grid([window]),
        positions=grid([[n + j for j in range(len(window))]]), kv_locs=grid([be.alloc(len(window))]),
    )
    for j in range(len(window)):
        assert max_diff(out.logits[0, j], want[n + j]) <= TOL
    model.commit(be.pool, out.states, accept_pos=ids([1]), slots=ids([2]))  # keep window[0], window[1]
    seq = Backend(model)
    seq.extend([(2, prompt, 0)])
    for j in range(2):
        seq.decode([(2, window[j], n + j)])
    assert max_diff(be.pool.buffer[2].view(torch.float32), seq.pool.buffer[2].view(torch.float32)) <= TOL
    after = be.decode([(2, 60, n + 2)])
    assert max_diff(after.logits[0], hf_logits(hf, full[: n + 2] + [60])[-1]) <= TOL


# ---- sensitivity: every feature the parity rests on changes the logits ---------------------------

def _without(model: HybridModel, feature: str) -> HybridModel:
    """``model`` with one architecture feature removed (weights adapted where the shapes need it)."""
    c, w = model.config, dict(model.weights)
    if feature == "gqa":  # query head h reads KV head h % kv instead of h // (heads / kv)
        rep = c.attn_heads // c.kv_heads
        for i in c.attn_layers:
            for name in ("k_proj", "v_proj"):
                t = w[f"layers.{i}.mixer.{name}"].reshape(c.kv_heads, c.attn_head_dim, c.d_model)
                w[f"layers.{i}.mixer.{name}"] = t.repeat(rep, 1, 1).reshape(c.attn_dim, c.d_model)
        return HybridModel(attrs.evolve(c, attn_kv_heads=None), w)
    if feature == "tie":
        w["lm_head"] = w["embed"].flip(0).clone()  # an output projection that is not the embeddings
        return HybridModel(attrs.evolve(c, tie_embeddings=False), w)
    # partial_rotary / no_rotary: rotary over whole heads instead; group_norm: the gated norm over the
    # whole width instead of per group; whole_norm: per group instead of over the whole width
    changes: dict[str, Any] = {
        "embed_scale": {"embed_scale": 1.0}, "residual_scale": {"residual_scale": 1.0},
        "logit_scale": {"logit_scale": 1.0}, "attn_scale": {"attn_scale": None},
        "partial_rotary": {"rotary_dim": None}, "no_rotary": {"rotary_dim": None},
        "group_norm": {"norm_groups": 1}, "whole_norm": {"norm_groups": c.ngroups},
        "dt_floor": {"dt_min": 0.0},
    }[feature]
    return HybridModel(attrs.evolve(c, **changes), w)


FEATURES = {
    "bamba": ("gqa", "partial_rotary", "whole_norm"),
    "granitemoehybrid": ("gqa", "no_rotary", "attn_scale", "embed_scale", "residual_scale", "logit_scale", "tie", "whole_norm"),
    "nemotron_h": ("gqa", "group_norm", "dt_floor"),
}


@pytest.mark.parametrize(("family", "feature"), [(f, x) for f, xs in FEATURES.items() for x in xs])
def test_removing_any_one_feature_moves_the_logits_far_beyond_the_tolerance(
    tmp_path: Path, family: str, feature: str,
) -> None:
    # a dt floor that binds for some tokens (the builder's dt_bias puts dt in [0.01, 0.1])
    changes = {"time_step_min": 0.05} if feature == "dt_floor" else {}
    hf = save_hf_model(family, tmp_path, seed=5, **changes)
    loaded = load_hf(tmp_path)
    prompt = PROMPTS[0]
    want = hf_logits(hf, prompt)
    assert max_diff(reference_logits(loaded.model, prompt), want) <= TOL
    assert max_diff(reference_logits(_without(loaded.model, feature), prompt), want) > 100 * TOL


# hidden_size 68 is not a multiple of the 8 attention heads: with head_dim 16, q/k/v project 68 -> 8 * 16
# (or 2 * 16) and o_proj 128 -> 68, as transformers builds them for every family
HEAD_DIM_SHAPE: dict[str, Any] = dict(hidden_size=68, num_attention_heads=8, num_key_value_heads=2, head_dim=16)


@pytest.mark.parametrize(
    ("family", "changes"),
    [("bamba", {}), ("granitemoehybrid", {}), ("granitemoehybrid", {"position_embedding_type": "rope"}), ("nemotron_h", {})],
    ids=["bamba", "granite-nope", "granite-rope", "nemotron_h"],
)
def test_an_explicit_head_dim_that_does_not_divide_hidden_size_equals_transformers(
    tmp_path: Path, family: str, changes: dict[str, Any],
) -> None:
    hf = save_hf_model(family, tmp_path, seed=5, **HEAD_DIM_SHAPE, **changes)
    loaded = load_hf(tmp_path)
    c = loaded.model.config
    assert (c.d_model, c.attn_heads, c.kv_heads, c.attn_head_dim) == (68, 8, 2, 16) and c.attn_dim != c.d_model
    prompt = PROMPTS[0]
    assert max_diff(reference_logits(loaded.model, prompt), hf_logits(hf, prompt)) <= TOL
    # greedy decoding through the serving forwards (extend, then one decode per token) equals generate
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)[0, len(prompt) :].tolist()
    be = Backend(loaded.model)
    token = int(be.extend([(1, prompt, 0)]).logits[0].argmax())
    got = [token]
    for pos in range(len(prompt), len(prompt) + 11):
        token = int(be.decode([(1, token, pos)]).logits[0].argmax())
        got.append(token)
    assert got == want and len(set(want)) > 3, (got, want)
