"""Host readbacks: the k = 0 step reads the device back once (the sampled tokens), greedy or sampled
(temperature, top-k, top-p, min-p, penalties and seeds: the sampler reads the rows' parameters and
positions from the host columns it was built from), plus one for logprobs when rows ask for them; a
speculative iteration at most three times on the CPU's count (the proposals, two counted for one
readback on a device, and the verified tokens), on the CPU counted by ``backend.readback.HostReadbacks``; on a CUDA device (tests marked ``cuda``) the same is checked
with torch's own sync debug mode, and the engine's tokens equal the CPU run's."""

from __future__ import annotations

import warnings

import attrs
import numpy as np
import pytest
import torch

from backend.hybrid.head import HeadConfig, HeadModel
from backend.hybrid.model import HybridModel
from backend.hybrid.weights import perturb
from backend.readback import HostReadbacks, host_values, staged
from compiler.engine import Engine
from compiler.offline.models import on_device
from ir.ids import RequestId
from ir.sampling import SamplingParams
from tests.helpers import tiny_model

PROMPTS = [list(b"hello world %d, a prompt" % i) for i in range(4)]


SAMPLED = [
    SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=1),
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(temperature=1.0, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, seed=5),
]


def _engine(device: str = "cpu") -> Engine:
    # (at BATCHC_VERIFY=2, the suite's level, the executor's mutation detector hashes the pool each
    # forward, a readback by design: the steps counted here run as a served engine does, at level 0)
    model, _ = on_device(tiny_model(), None, device)
    engine = Engine(model, None, k=0, capacity=8, kv_capacity=1024, max_len=96, chunk_size=8)
    for i, prompt in enumerate(PROMPTS):
        engine.admit(RequestId(i), prompt, max_new_tokens=6)
    return engine


def test_a_staged_tensor_gives_its_host_values_without_a_readback() -> None:
    values = np.array([3, 1, 2], dtype=np.int64)
    t = staged(torch.from_numpy(values.copy()), values)
    with HostReadbacks() as seen:
        assert host_values(t).tolist() == [3, 1, 2]
        assert host_values(t + 0).tolist() == [3, 1, 2]  # a new tensor: read back, and counted
    assert seen.count == 1
    with pytest.raises(ValueError, match=r"host values of shape \(2,\) for a tensor of shape \(3,\)"):
        staged(t, values[:2])


def test_every_k0_step_reads_back_once_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHC_VERIFY", "0")
    engine = _engine()
    kinds: list[tuple[str, int, dict[str, int]]] = []
    while engine.live:
        with HostReadbacks() as seen:
            report = engine.step()
        kinds.append((report.kind.value, seen.count, dict(seen.sites)))
    assert {k for k, _, _ in kinds} >= {"extend", "decode"}
    assert all(n <= 1 for _, n, _ in kinds), kinds  # prefill and decode steps alike: the sampled tokens only
    assert sum(n for _, n, _ in kinds) >= len(kinds) - 1  # (the counter sees the one readback there is)


@pytest.mark.parametrize("kind", ["model", "mtp"])
def test_a_speculative_iteration_reads_back_a_bounded_count(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    # greedy at k = 2: the proposals (.cpu() then .numpy(): one readback on a device, two counted here) and the
    # verified tokens; none per row or per layer (the kernels' checks read the staged plans' host values)
    monkeypatch.setenv("BATCHC_VERIFY", "0")
    target = tiny_model()
    draft = (HybridModel(target.config, perturb(target.weights, 0.05, seed=1)) if kind == "model"
             else HeadModel.from_seed(HeadConfig.for_target(target.config, "mamba"), target, 2))
    engine = Engine(target, draft, k=2, capacity=8, kv_capacity=1024, max_len=96, chunk_size=32)
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.admit(RequestId(i), prompt, max_new_tokens=5)
    counts = []
    while engine.live:
        with HostReadbacks() as seen:
            report = engine.step()
        if report.kind.value == "spec":
            counts.append((seen.count, dict(seen.sites)))
    assert counts and all(n <= 3 for n, _ in counts), counts


@pytest.mark.cuda
def test_the_k0_step_synchronises_once_on_the_device_and_serves_the_cpu_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHC_VERIFY", "0")
    cpu = _engine()
    cpu.run_until_done()
    dev = _engine("cuda")
    while dev.live:
        with HostReadbacks(device_only=True) as seen:
            report = dev.step()
        assert seen.count <= 1, (report.kind, dict(seen.sites))
    assert dev.outputs == cpu.outputs
    # torch's own count: with sync debug mode "warn", every synchronisation of a decode step warns
    again = _engine("cuda")
    while again.live:
        decoding = all(r.state.name == "RUNNING" for r in again.requests)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                again.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        if decoding:
            assert len(syncs) <= 1, [str(w.message) for w in syncs]
    assert again.outputs == cpu.outputs


@pytest.mark.parametrize("k", [0, 2])
def test_a_sampled_step_reads_back_once_and_logprobs_once_more(monkeypatch: pytest.MonkeyPatch, k: int) -> None:
    # greedy, sampled and penalised rows in one batch; at k = 2 with a draft head, sampled verification
    # (rejection sampling decides on the device, the verified tokens are read back once)
    monkeypatch.setenv("BATCHC_VERIFY", "0")
    target = tiny_model()
    draft = HeadModel.from_seed(HeadConfig.for_target(target.config, "mamba"), target, 2) if k else None
    engine = Engine(target, draft, k=k, capacity=8, kv_capacity=1024, max_len=96, chunk_size=8 if k == 0 else 32, penalties=True)
    for i, prompt in enumerate(PROMPTS):
        logprobs = 2 if i == 3 else None
        engine.admit(RequestId(i), prompt, max_new_tokens=2 if i == 3 else 6 - 2 * (k > 0), sampling=attrs.evolve(SAMPLED[i % 3], logprobs=logprobs))
    without_logprobs = set()
    while engine.live:
        asks = any(r.rid == RequestId(3) for r in engine.requests)
        with HostReadbacks() as seen:
            report = engine.step()
        bound = (1 if k == 0 else 3) + asks  # (the tokens; the proposals too at k = 2; the logprobs)
        assert seen.count <= bound, (report.kind, dict(seen.sites))
        if not asks:
            without_logprobs.add(report.kind.value)
    assert without_logprobs >= ({"decode"} if k == 0 else {"spec"})
    assert len(engine.outputs) == len(PROMPTS)
