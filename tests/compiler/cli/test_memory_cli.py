"""``batchc run`` and ``batchc serve`` sized from the machine's memory: the
defaults kept where they fit, lowered where they do not (and said so), the sizes a user gave never
changed, and the bad input of the issue refused in one line with exit status 2 before anything
starts: ``--device cuda`` where there is none, ``cuda:N`` past the count, ``--memory-fraction``
outside (0, 1] or not a number, a model that does not fit.

The machine's available memory is fixed here (``_machine``: the tests patch the one function that
reads it), so that each budget is the one the test means whatever else runs on the machine."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
import torch

import compiler.offline.budget as budget_module
from backend.hybrid.checkpoint import default_draft, default_target
from compiler.engine.config import ServeConfig
from compiler.offline.memory import memory_estimate, weight_bytes
from compiler.online import engine_process
from compiler.online.messages import Launch
from compiler.workload import ServeError
from tests.helpers import run_cli

AVAILABLE = 1 << 30
"""What the machine has available in these tests (``_machine``)."""
_SHORT = ["--requests", "4", "--max-new-tokens", "4", "--lossless-sample", "2"]


@pytest.fixture
def _machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(budget_module, "_cpu_available", lambda: AVAILABLE)


def _bundled_run(cfg: ServeConfig) -> int:
    """The estimate of ``batchc run`` on the bundled models at ``cfg``, their weights counted."""
    target, draft = default_target(), default_draft()
    return sum(memory_estimate(target.config, draft.config, cfg, weights=weight_bytes([target, draft])).values())


def _halfway() -> str:
    """A ``--memory-fraction`` whose budget lies halfway between the bundled run's estimate at the
    smallest sizes and at the defaults: too small for the defaults, room for more than the least."""
    cfg = ServeConfig()
    low, high = _bundled_run(attrs.evolve(cfg, max_running=1, token_budget=1, cache_entries=1)), _bundled_run(cfg)
    return repr((low + high) / 2 / AVAILABLE)


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = run_cli(args)
    out, err = capsys.readouterr()
    return code, out, err


def _refused(args: list[str], capsys: pytest.CaptureFixture[str], *fragments: str) -> str:
    code, out, err = _run(args, capsys)
    assert code == 2, (code, err[-2000:])
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert out == "", "something started: " + out[:300]
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    return err


def test_the_bundled_default_run_keeps_todays_sizes_and_outputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sized, given = tmp_path / "sized.jsonl", tmp_path / "given.jsonl"
    short = ["--requests", "4", "--max-new-tokens", "4", "--lossless-sample", "0"]
    code, out, err = _run(["run", *short, "--outputs", str(sized)], capsys)
    assert code == 0, err
    assert "sizes: max-running 8 (default), token-budget 2048 (default), cache-entries 16 (default); memory: about " in out
    code, out, err = _run(["run", *short, "--outputs", str(given), "--max-running", "8", "--token-budget", "2048", "--cache-entries", "16"],
                          capsys)
    assert code == 0, err
    assert "sizes: max-running 8 (given), token-budget 2048 (given), cache-entries 16 (given)" in out
    assert sized.read_text() == given.read_text()


@pytest.mark.usefixtures("_machine")
def test_sizes_not_given_are_lowered_to_fit_and_the_run_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    summary = tmp_path / "s.json"
    code, out, err = _run(["run", *_SHORT, "--memory-fraction", _halfway(), "--json", str(summary)], capsys)
    assert code == 0, err
    assert "(lowered from " in out and " to fit)" in out, out[:500]
    assert "of the 1.0 GiB available on cpu)" in out
    assert json.loads(summary.read_text())["lossless_ok"] is True


@pytest.mark.usefixtures("_machine")
def test_sizes_given_that_do_not_fit_are_refused_naming_what_to_lower(capsys: pytest.CaptureFixture[str]) -> None:
    _refused(["run", *_SHORT, "--memory-fraction", _halfway(), "--max-running", "8", "--token-budget", "2048", "--cache-entries", "16"],
             capsys, "batchc: error: the run would need about ", "of the 1.0 GiB available on cpu); lower --max-running (8), "
             "--cache-entries (16), --k (2), --chunk-size (512), --token-budget (2048), --max-len (512), raise --memory-fraction or use a "
             "smaller model")


@pytest.mark.usefixtures("_machine")
def test_a_model_that_cannot_fit_is_refused_before_anything_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    summary = tmp_path / "s.json"
    _refused(["run", "--memory-fraction", "0.05", "--json", str(summary)], capsys,
             "batchc: error: the models alone need about ", "over the budget of 51 MiB (--memory-fraction 0.05 of the 1.0 GiB "
             "available on cpu); raise --memory-fraction or use a smaller model")
    assert not summary.exists()
    # --dp N: each replica holds its own models, in its share of the budget
    _refused(["run", "--dp", "2", "--memory-fraction", "0.2"], capsys, "one of 2 replicas' shares of --memory-fraction 0.2 of the ",
             "or use a smaller model or fewer --dp replicas")


@pytest.mark.parametrize("command", ["run", "serve"])
@pytest.mark.parametrize("value", ["0", "-0.5", "1.5", "x", "nan"])
def test_a_memory_fraction_outside_0_1_is_refused(capsys: pytest.CaptureFixture[str], command: str, value: str) -> None:
    _refused([command, f"--memory-fraction={value}"], capsys,
             f"batchc {command}: error: argument --memory-fraction: expected a finite number in (0, 1], got ")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
@pytest.mark.parametrize("command", ["run", "serve"])
def test_cuda_where_there_is_none_is_refused(capsys: pytest.CaptureFixture[str], command: str) -> None:
    _refused([command, "--device", "cuda"], capsys, f"batchc {command}: error: argument --device: device 'cuda': no CUDA device on this machine")


def _cuda(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    """This machine as one with two CUDA devices of ``free`` bytes free each."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (free, 80 << 30))


@pytest.mark.parametrize("command", ["run", "serve"])
def test_a_cuda_device_past_the_count_is_refused(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], command: str) -> None:
    _cuda(monkeypatch, 8 << 30)
    _refused([command, "--device", "cuda:2"], capsys, f"batchc {command}: error: argument --device: device 'cuda:2': this machine has 2 CUDA devices")


def test_a_run_on_a_cuda_device_is_sized_by_its_memory_then_refused(monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # the device's memory sizes the run: too little of it is the memory refusal, naming the device
    _cuda(monkeypatch, 64 << 20)
    _refused(["run", "--device", "cuda:1"], capsys, "the models alone need about ", "of the 64 MiB available on cuda:1)")
    # enough: the run places its models on the device; this torch has no CUDA (the device above is faked), and the run says so
    # in one line instead of serving on the CPU
    _cuda(monkeypatch, 8 << 30)
    _refused(["run", "--device", "cuda:1"], capsys, "batchc: error: --device cuda:1: the models cannot be placed there (")


def _launch(**changes: object) -> Launch:
    cfg = ServeConfig()
    fields: dict[str, object] = dict(model=None, draft=None, k=0, dtype="float32", max_running=cfg.max_running, max_len=None, overlap=False,
                                     threads=1, chunk_size=cfg.chunk_size, token_budget=cfg.token_budget, cache_entries=cfg.cache_entries)
    return Launch(**{**fields, **changes})  # (the fields by name, checked by attrs)


def test_the_servers_engine_is_sized_from_the_memory_it_was_given() -> None:
    target = default_target()
    weights = weight_bytes([target])
    cfg = ServeConfig(k=0, penalties=True)  # (the server's engine keeps token counts)
    low = sum(memory_estimate(target.config, None, attrs.evolve(cfg, max_running=1, token_budget=1, cache_entries=1), weights=weights).values())
    high = sum(memory_estimate(target.config, None, cfg, weights=weights).values())
    available = (low + high) // 2
    _, ready, got, _ = engine_process.build(_launch(sized=("max_running", "token_budget", "cache_entries"), memory_available=available,
                                                    memory_fraction=1.0))
    sizes = (got.max_running, got.token_budget, got.cache_entries)
    assert sizes != (8, 2048, 16) and all(1 <= n <= d for n, d in zip(sizes, (8, 2048, 16), strict=True)), sizes
    assert "(lowered to fit)" in ready.sizes and f"of the {budget_module.gib(available)} available on cpu)" in ready.sizes
    with pytest.raises(ServeError, match=r"^the run would need about .* lower --max-running \(8\), --cache-entries \(16\)"):
        engine_process.build(_launch(memory_available=available, memory_fraction=1.0))
