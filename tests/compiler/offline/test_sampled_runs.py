"""``batchc run`` with sampled requests: a seeded workload gives the same outputs (tokens and
logprobs) whatever the serving layout: ``--max-running 1`` and 8, ``--overlap``, ``--tp 2`` and
``--dp 2``; ``--outputs`` lines carry ``logprobs`` as the issue specifies them, and a line with
``n = 3`` gives three lines (``index`` 0 to 2)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import forkserver

ROOT = Path(__file__).resolve().parents[3]

LINES = [
    {"prompt": "def merge(a, b):", "max_new_tokens": 6, "temperature": 2.5, "top_p": 0.95, "logprobs": 2},
    {"prompt": "import os\n", "max_new_tokens": 6, "temperature": 3.0, "top_k": 40, "seed": 99},
    {"prompt": "class Slot:", "max_new_tokens": 6, "logprobs": 0},
    {"prompt": "for x in y:", "max_new_tokens": 6, "temperature": 3.0, "min_p": 0.01},
    {"prompt": "while True:", "max_new_tokens": 5, "temperature": 3.0, "n": 3, "seed": 5, "logprobs": 1},
]


def _start(tmp_path: Path, name: str, *extra: str) -> tuple[subprocess.Popen[str], Path]:
    workload = tmp_path / f"{name}.w.jsonl"  # (one each: the runs read theirs while the next is written)
    workload.write_text("\n".join(json.dumps(line) for line in LINES) + "\n")
    out = tmp_path / f"{name}.jsonl"
    proc = forkserver.Popen(
        [sys.executable, "-m", "compiler.cli", "run", "--workload", str(workload), "--seed", "4", "--outputs", str(out), *extra],
        cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    return proc, out


def _lines(started: tuple[subprocess.Popen[str], Path]) -> list[dict[str, Any]]:
    proc, out = started
    try:
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-2000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def _logprobs(lines: list[dict[str, Any]]) -> list[float]:
    return [v for line in lines for e in line.get("logprobs", ()) for v in (e["logprob"], *(t["logprob"] for t in e["top"]))]


def test_a_seeded_sampled_workload_gives_the_same_outputs_in_every_layout(tmp_path: Path) -> None:
    # the runs are independent processes: started together, they share the machine's cores
    layouts = (("one-overlap", ("--max-running", "1", "--overlap")), ("tp", ("--tp", "2")), ("dp", ("--dp", "2")))
    started = {name: _start(tmp_path, name, *extra) for name, extra in (("base", ("--max-running", "8")), *layouts)}
    try:
        runs = {name: _lines(s) for name, s in started.items()}
    finally:
        for proc, _ in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    base = runs["base"]
    assert len({tuple(line["output_ids"]) for line in base}) == len(base)  # (sampled at high temperatures: no two alike)
    # n = 3: three lines for the last prompt, completions 0 to 2, each its own sample
    assert [(line["rid"], line["index"]) for line in base] == [(0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (4, 1), (4, 2)]
    # (one request at a time with executor processes: both layouts in one run)
    for name, _ in layouts:
        got = runs[name]
        # the tokens are a function of the seeds; the logprobs of the logits, whose last bits depend on
        # what a forward batches together (and on the tensor-parallel split): equal to a tolerance
        strip = [{k: v for k, v in line.items() if k != "logprobs"} for line in got]
        assert strip == [{k: v for k, v in line.items() if k != "logprobs"} for line in base], name
        assert [[(e["id"], [t["id"] for t in e["top"]]) for e in line.get("logprobs", ())] for line in got] == [
            [(e["id"], [t["id"] for t in e["top"]]) for e in line.get("logprobs", ())] for line in base
        ], name
        assert _logprobs(got) == pytest.approx(_logprobs(base), abs=1e-4), name
    # the line format: logprobs where asked, an entry per output id, `top` sorted by logprob
    assert [("logprobs" in line) for line in base] == [True, False, True, False, True, True, True]
    for line, n in ((base[0], 2), (base[2], 0), (base[4], 1), (base[6], 1)):
        entries = line["logprobs"]
        assert isinstance(entries, list) and [e["id"] for e in entries] == line["output_ids"]
        for e in entries:
            assert e["logprob"] <= 0.0 and math.isfinite(e["logprob"]) and len(e["top"]) == n
            tops = [t["logprob"] for t in e["top"]]
            assert tops == sorted(tops, reverse=True)
    # a greedy line's first token is its best alternative's... and with n = 0 there is none to show
    assert base[2]["logprobs"][0]["top"] == []
