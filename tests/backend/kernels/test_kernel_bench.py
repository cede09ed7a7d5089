"""The kernel benchmark runs end to end at toy sizes (on a CPU through the torch paths)."""

from __future__ import annotations

import torch

from backend.tools.bench_kernels import PEAK_BANDWIDTH, peak_bandwidth, run


def test_small_run_reports_every_kernel() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    text = run(device=device, small=True, repeats=2)
    assert "init_rows" in text and "layer-major" in text and "selective_state_update" in text
    for batch in ("batch 1", "batch 8", "batch 32"):
        assert batch in text
    if device == "cpu":
        assert "need a GPU" in text
        table = text[text.index("torch path") :]
        for name in ("selective_state_update", "selective_state_verify", "causal_conv1d_update", "causal_conv1d_verify", "commit_accepted"):
            assert sum(line.startswith(name) for line in table.splitlines()) == 2  # 8 and 32 rows
        assert "bundled target rows skipped" in table  # the kernel tests send the wrappers to Triton's interpreter


def test_peak_table_prefers_specific_names() -> None:
    keys = [key for key, _ in PEAK_BANDWIDTH]
    assert keys.index("GH200") < keys.index("H200")
    assert keys.index("H100 PCIe") < keys.index("H100")
    assert peak_bandwidth(torch.device("cpu"))[0] is None
