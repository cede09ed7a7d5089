"""Sharded forwards over 2 gloo processes equal the unsharded model (max abs diff <= 1e-4): the
bundled architecture and each Hugging Face family, with Mamba groups split and replicated, gated
norms local and across ranks; extend (chunked too), decode and verify."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from backend.tp import check_tp, shard_config
from tests.helpers import ARCHITECTURES

TOL = 1e-4
PROMPT = [5, 17, 33, 8, 60, 3, 44, 90, 12, 7, 71, 25, 38]


def _cases(root: Path) -> list[dict[str, Any]]:
    from backend.tools.hf_random import save_hf_model

    cases: list[dict[str, Any]] = [{"name": f"tiny:{a}", "arch": a} for a in ARCHITECTURES]
    cases += [{"name": "bundled target", "bundled": "target"}, {"name": "bundled draft", "bundled": "draft"}]
    for family, changes in (
        ("bamba", {}), ("granitemoehybrid", {}), ("nemotron_h", {}),
        ("granitemoehybrid", {"mamba_n_groups": 1}),  # one group, replicated on both ranks; norm over the whole width
        ("nemotron_h", {"n_groups": 1}),  # one group and one norm group: both across ranks
        # an explicit head_dim: 8 heads of 16 over a hidden_size of 68 (q/k/v/o are not square)
        ("bamba", {"hidden_size": 68, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16}),
    ):
        d = root / f"{family}-{len(cases)}"
        save_hf_model(family, d, seed=2, **changes)
        cases.append({"name": f"{family}{changes or ''}", "dir": str(d)})
    return cases


def _model(case: dict[str, Any]) -> Any:
    if "arch" in case:
        from tests.helpers import tiny_model

        return tiny_model(seed=3, arch=case["arch"])
    if "bundled" in case:
        from backend.hybrid.checkpoint import default_draft, default_target

        return default_target() if case["bundled"] == "target" else default_draft()
    from backend.hf import load_hf

    return load_hf(case["dir"]).model


def _forwards(model: Any) -> list[torch.Tensor]:
    """Logits of: an extend of the prompt in two chunks (with a second row), decode steps, a verify."""
    from tests.helpers import Backend, grid, ids

    be = Backend(model)
    outs = [be.extend([(1, PROMPT[:5], 0), (3, PROMPT[:9], 0)]).logits]
    outs.append(be.extend([(1, PROMPT[5:], 5)]).logits)
    n = len(PROMPT)
    for j, t in enumerate((4, 50, 21)):
        outs.append(be.decode([(1, t, n + j), (3, t, 9 + j)]).logits)
    window = [7, 8, 9]
    v = model.verify(be.pool, be.kv, be.table, slots=ids([1]), input_ids=grid([window]),
                     positions=grid([[n + 3 + j for j in range(3)]]), kv_locs=grid([be.alloc(3)]))
    outs.append(v.logits)
    return outs


class _NoSum:
    def all_reduce_sum(self, t: torch.Tensor) -> None:
        pass


def _rank_main(rank: int, world: int, store: str, cases: list[dict[str, Any]], out: str) -> None:
    import torch.distributed as dist

    from backend.tp import shard_model
    from backend.tp.dist import ProcessGroupCollective

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        results = {}
        collective = ProcessGroupCollective()
        for case in cases:
            full = _model(case)
            want = _forwards(full)
            got = _forwards(shard_model(full, rank, world, collective))
            results[case["name"]] = max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))
        # the comparison can fail: a shard whose partial sums are not summed is far off
        alone = _forwards(shard_model(_model(cases[0]), rank, world, _NoSum()))
        results["unsummed (must be far)"] = max(float((a - b).abs().max()) for a, b in zip(alone, _forwards(_model(cases[0])), strict=True))
        Path(f"{out}.{rank}").write_text(json.dumps(results))
        if os.environ.get("BATCHC_TP_REPORT"):
            print(rank, json.dumps(results), flush=True)
    finally:
        dist.destroy_process_group()


def test_sharded_logits_equal_the_unsharded_model(tmp_path: Path) -> None:
    cases = _cases(tmp_path)
    out = str(tmp_path / "result")
    ctx = mp.spawn(_rank_main, args=(2, str(tmp_path / "store"), cases, out), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1):  # raises if a rank raised
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the ranks did not finish within 120 s")
    for rank in range(2):
        diffs = json.loads(Path(f"{out}.{rank}").read_text())
        assert diffs.pop("unsummed (must be far)") > 100 * TOL
        assert set(diffs) == {c["name"] for c in cases}
        bad = {k: v for k, v in diffs.items() if not v <= TOL}
        assert not bad, (rank, bad)


def test_bad_shard_arguments_are_refused() -> None:
    from typeguard import suppress_type_checks

    from backend.tp import shard_model, shard_weights
    from tests.helpers import tiny_model

    m = tiny_model()
    with suppress_type_checks():
        for rank in (True, 1.0, "1", None, -1, 2):
            with pytest.raises(ValueError, match="rank must be an int in"):
                shard_weights(m.config, m.weights, rank, 2)  # type: ignore[arg-type]  # deliberately wrong
        with pytest.raises(ValueError, match="collective must have all_reduce_sum"):
            shard_model(m, 0, 2, None)  # type: ignore[arg-type]  # deliberately wrong
        with pytest.raises(ValueError, match="model must be a HybridModel"):
            shard_model(None, 0, 2, _NoSum())  # type: ignore[arg-type]  # deliberately wrong
        with pytest.raises(ValueError, match="config must be a HybridConfig"):
            check_tp(None, 2)  # type: ignore[arg-type]  # deliberately wrong
        with pytest.raises(ValueError, match="weights do not match the config"):
            shard_weights(m.config, {}, 0, 2)


def test_a_shard_holding_nan_or_inf_is_refused_naming_the_weight_and_the_rank() -> None:
    """A model built in memory (no loader checked it) with an infinity in rank 1's columns of an
    output projection: rank 1's shard is refused, rank 0's slice is finite and is cut."""
    from backend.tp import shard_model, shard_weights
    from tests.helpers import tiny_model

    m = tiny_model()
    m.weights["layers.0.mixer.out_proj"][0, -1] = float("inf")
    shard_weights(m.config, m.weights, 0, 2)
    with pytest.raises(ValueError, match="rank 1 of 2: its shard of weight 'layers.0.mixer.out_proj' has 1 non-finite values"):
        shard_model(m, 1, 2, _NoSum())
    m.weights["layers.0.mixer.out_proj"][0, -1] = 0.0
    m.weights["final_norm"][3] = float("nan")  # replicated: every rank refuses it
    for rank in (0, 1):
        with pytest.raises(ValueError, match=f"rank {rank} of 2: its shard of weight 'final_norm' has 1 non-finite values"):
            shard_weights(m.config, m.weights, rank, 2)


def test_a_tp_that_does_not_divide_is_refused() -> None:
    from tests.helpers import tiny_model

    c = tiny_model().config  # 4 Mamba heads, 2 groups, 2 attention heads
    for world, message in ((3, "tp 3 does not divide the 4 Mamba heads"), (4, "tp 4 does not divide the 2 attention heads"),
                           (0, "tp must be a positive int")):
        with pytest.raises(ValueError, match=message):
            check_tp(c, world)
    assert shard_config(c, 2).nheads == 2 and shard_config(c, 2).ngroups == 1
