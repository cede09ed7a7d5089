"""Hostile input to ``batchc``: workload files, options, environment, checkpoints. Each is refused
before anything runs, with exactly one line on stderr naming the bad value, line or field, and exit
status 2 (no traceback, no table or progress on stdout, no ``--json`` file). And the honest exit
status: a run in which a failed forward aborted requests exits 1, says why in one line, and counts
the aborts in its summary."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import safetensors.torch

from backend import faults
from backend.hybrid import HybridModel
from backend.hybrid.checkpoint import FORMAT, MAX_CHECKPOINT_BYTES, config_to_json, save_checkpoint
from backend.hybrid.config import HybridConfig, tiny
from backend.hybrid.weights import init_weights
from compiler.cli import main
from compiler.engine import Engine
from compiler.manager import PassManager
from compiler.offline import ServeConfig, WorkloadError, load_workload, memory_estimate
from compiler.offline.budget import available_memory
from compiler.workload import MAX_REQUESTS, MAX_RUNNING, MAX_WORKLOAD_BYTES
from ir.batch import DecodeBatch
from ir.errors import BatchcError, SettingsError
from ir.ids import RequestId
from passes.filter_batch import filter_batch
from tests import forkserver
from tests.helpers import REPO, run_cli

_main = run_cli


def _refused(args: list[str], tmp: Path, capsys: pytest.CaptureFixture[str], *fragments: str) -> str:
    """Run ``batchc`` (``run`` gets a ``--json`` path), expect status 2, one stderr line holding
    every fragment, nothing on stdout and no JSON file; return the line."""
    summary = tmp / "summary.json"
    if args[0] == "run":
        args = [*args, "--json", str(summary)]
    code = _main(args)
    out, err = capsys.readouterr()
    assert code == 2, (code, err)
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert "Traceback" not in err
    assert out == "", "something ran: " + out[:200]
    assert not summary.exists()
    assert not list(tmp.glob(".summary.json.*")), "a temporary --json file was left behind"
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    return err


# ---- workload files ----------------------------------------------------------------------------------


def _workload(tmp: Path, content: str | bytes) -> Path:
    path = tmp / "workload.jsonl"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


GOOD = '{"prompt": "x = 1", "max_new_tokens": 2}\n'


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("[" * 100_000 + "\n", "workload.jsonl:1: bad JSON (nested too deeply)"),
        (GOOD + '{"prompt": "x", "max_new_tokens": 1' + "0" * 5000 + "}\n", "workload.jsonl:2: bad JSON (an integer of more than 4300 digits)"),
        (GOOD.encode() + b'{"prompt": "caf\xff"}\n', "workload.jsonl: cannot read workload file ('utf-8' codec can't decode byte 0xff"),
        (GOOD + '"just a string"\n', "workload.jsonl:2: expected a JSON object, got str"),
        (GOOD + "[1, 2]\n", "workload.jsonl:2: expected a JSON object, got list"),
    ],
    ids=["deeply-nested", "int-past-digit-limit", "invalid-utf8", "string-line", "list-line"],
)
def test_malformed_workload_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | bytes, fragment: str) -> None:
    err = _refused(["run", "--workload", str(_workload(tmp_path, content))], tmp_path, capsys, fragment)
    if "utf-8" in fragment:
        assert "line 2" in err


def test_workload_is_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _refused(["run", "--workload", str(tmp_path)], tmp_path, capsys, f"{tmp_path}: cannot read workload file: a directory, not a regular file")


def test_workload_is_dev_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _refused(["run", "--workload", "/dev/zero"], tmp_path, capsys, "/dev/zero: cannot read workload file: a character device, not a regular file")


def test_workload_over_the_size_bound_is_refused_unread(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "huge.jsonl"
    with path.open("wb") as f:
        f.truncate(MAX_WORKLOAD_BYTES + 1)  # sparse: refused from its stat, never read
    _refused(["run", "--workload", str(path)], tmp_path, capsys,
             f"huge.jsonl: workload file of {MAX_WORKLOAD_BYTES + 1} bytes is over the limit of {MAX_WORKLOAD_BYTES} bytes (64 MiB)")


def test_workload_with_too_many_requests(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _workload(tmp_path, GOOD * (MAX_REQUESTS + 1))
    _refused(["run", "--workload", str(path)], tmp_path, capsys, f"workload.jsonl:{MAX_REQUESTS + 1}: more than {MAX_REQUESTS} requests")


def test_workload_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    # a subprocess with a timeout: opening a FIFO for reading blocks until a writer comes
    fifo = tmp_path / "workload.fifo"
    os.mkfifo(fifo)
    summary = tmp_path / "summary.json"
    result = forkserver.run(
        [sys.executable, "-m", "compiler.cli", "run", "--workload", str(fifo), "--json", str(summary)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"batchc: error: {fifo}: cannot read workload file: a FIFO, not a regular file\n"
    assert result.stdout == "" and not summary.exists()


def test_line_separators_inside_strings_are_not_line_breaks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # str.splitlines would cut these lines at the raw U+2028 / U+0085 and then fail to parse them
    text = '{"prompt": "a\u2028b", "max_new_tokens": 2}\n{"prompt": "c\x85d", "max_new_tokens": 2}\r\n'
    path = _workload(tmp_path, text)
    requests = load_workload(path, max_len=512)
    assert [r.prompt for r in requests] == ["a\u2028b".encode(), "c\x85d".encode()]
    summary = tmp_path / "summary.json"
    code = main(["run", "--workload", str(path), "--k", "0", "--lossless-sample", "0", "--json", str(summary)])
    assert code == 0, capsys.readouterr().err
    assert json.loads(summary.read_text())["requests"] == 2


def test_loader_refuses_what_admission_would_refuse_mid_run(tmp_path: Path) -> None:
    # 501 + 3 + 8 fits the old fixed margin of 8, but with --k 8 admission needs 501 + 3 + 9 <= 512
    path = _workload(tmp_path, GOOD + json.dumps({"prompt": "x" * 501, "max_new_tokens": 3}) + "\n")
    good, long = load_workload(path, max_len=512, reserve=9)
    assert good.refused is None
    assert long.refused == ("workload.jsonl:2: prompt of 501 bytes + 3 new tokens exceeds the context limit 512 (prompt and new "
                            "tokens may fill 503 of its positions; a decode step holds 1 more and 8 positions are reserved for speculation)"
                            ).replace("workload.jsonl", str(path))


@pytest.mark.parametrize("k", [0, 2, 5])
def test_loader_and_admission_agree_at_the_boundary(tmp_path: Path, k: int) -> None:
    model = HybridModel.from_seed(tiny(), seed=0)
    max_len = 64
    for length in range(max_len - k - 6, max_len - k + 1):
        path = _workload(tmp_path, json.dumps({"prompt": "y" * length, "max_new_tokens": 4}) + "\n")
        (loaded,) = load_workload(path, max_len=max_len, reserve=k + 1, vocab=model.config.vocab)
        driver = Engine(model, model if k else None, k=k, max_len=max_len)
        try:
            driver.admit(RequestId(0), list(b"y" * length), max_new_tokens=4)
            admitted = True
        except BatchcError:
            admitted = False
        assert (loaded.refused is None) == admitted, (length, k)


def test_loader_checks_bytes_and_stop_token_ids_against_the_vocabulary(tmp_path: Path) -> None:
    path = _workload(tmp_path, '{"prompt": "az", "max_new_tokens": 2}\n')
    with pytest.raises(WorkloadError, match=r"workload\.jsonl:1: 'prompt' holds byte 122, not below the vocabulary size 100"):
        load_workload(path, max_len=512, vocab=100)
    path = _workload(tmp_path, '{"prompt": "a", "stop_token_ids": [7, 100]}\n')
    with pytest.raises(WorkloadError, match=r"workload\.jsonl:1: 'stop_token_ids' holds id 100, not below the model's vocabulary size 100"):
        load_workload(path, max_len=512, vocab=100)
    path = _workload(tmp_path, '{"prompt": "a", "stop": "z", "stop_token_ids": [99]}\n')  # a stop string is text: any text
    (r,) = load_workload(path, max_len=512, vocab=100)
    assert r.sampling.stop == ("z",) and r.sampling.stop_token_ids == (99,)


# ---- options ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["run", "--requests", str(10**12)], "argument --requests: expected at most 100000, got 1000000000000"),
        (["run", "--k", "-1"], "argument --k: expected a non-negative integer, got -1"),
        (["run", "--k", str(10**6)], "argument --k: expected at most 32, got 1000000"),
        (["run", "--lossless-sample", "-1"], "argument --lossless-sample: expected a non-negative integer, got -1"),
        (["run", "--seed", "1" * 5000], "argument --seed: expected a non-negative integer, got '1111111111111111111111111111111111111111'... (5000 characters): more than 4300 digits"),
        (["run", "--max-running", "8x"], "argument --max-running: expected a positive integer, got '8x'"),
        (["run", "--bogus"], "unrecognized arguments: --bogus"),
        (["ab", "--requests", str(10**12)], "argument --requests: expected at most 100000"),
        (["bench", "pipeline", "--sizes", str(10**9)], "argument --sizes: expected at most 65536, got 1000000000"),
        (["bench", "kernels", "--device", "quantum"], "argument --device: unknown device 'quantum' (expected cpu, cuda or cuda:N)"),
        (["bench", "kernels", "--device", "cuda:99"], "argument --device: device 'cuda:99'"),
        (["bench", "iteration", "--rows", "0"], "argument --rows: expected a positive integer, got 0"),
        (["bench", "iteration", "--rows", "257"], "argument --rows: expected at most 256, got 257"),
        (["bench", "iteration", "--k", "0"], "argument --k: expected a positive integer, got 0"),
        (["bench", "iteration", "--k", "9"], "argument --k: expected at most 8, got 9"),
        (["bench", "iteration", "--repeats", "1.5"], "argument --repeats: expected a positive integer, got '1.5'"),
        (["run", "--threads", "0"], "argument --threads: expected a positive integer, got 0"),
        (["run", "--threads", "two"], "argument --threads: expected a positive integer, got 'two'"),
        (["bench", "serve", "--threads", "-1"], "argument --threads: expected a positive integer, got -1"),
        (["bench", "pipeline", "--threads", str(10**6)], "argument --threads: expected at most 1024, got 1000000"),
        (["bench", "serve", "--repeats", "0"], "argument --repeats: expected a positive integer, got 0"),
        (["bench", "serve", "--sweep", "8", "0"], "argument --sweep: expected a positive integer, got 0"),
    ],
    ids=["requests-1e12", "k-negative", "k-huge", "lossless-negative", "seed-5000-digits", "max-running-not-int",
         "unknown-option", "ab-requests-1e12", "bench-batch-1e9", "device-unknown", "device-cuda-99", "iteration-rows-0",
         "iteration-rows-257", "iteration-k-0", "iteration-k-9", "iteration-repeats-float", "threads-0",
         "threads-not-int", "bench-threads-negative", "bench-threads-1e6", "bench-repeats-0", "sweep-batch-0"],
)
def test_bad_option_value(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], fragment: str) -> None:
    _refused(args, tmp_path, capsys, fragment)


@pytest.mark.parametrize(
    "args",
    [["run", "--workload", ""], ["run", "--model", ""], ["run", "--draft", ""], ["run", "--json", ""], ["ab", "--json", ""]],
    ids=["run-workload", "run-model", "run-draft", "run-json", "ab-json"],
)
def test_empty_path_is_not_a_missing_option(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str]) -> None:
    # an empty path used to mean "not given": the built-in workload, the bundled models, no JSON
    _refused(args, tmp_path, capsys, f"argument {args[1]}: expected a path, got ''")


def test_draft_with_k_0_is_refused_not_ignored(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # k = 0 runs no draft: a --draft next to it (even a missing file) used to be ignored silently
    _refused(["run", "--k", "0", "--draft", "/nonexistent"], tmp_path, capsys,
             "--draft '/nonexistent' with --k 0: k = 0 turns speculative decoding off and runs no draft")


def test_max_running_huge_is_refused_before_allocation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    _refused(["run", "--max-running", str(MAX_RUNNING)], tmp_path, capsys,
             "the run would need about", "over the budget of", f"--max-running ({MAX_RUNNING})")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 512 * 1024  # KiB: nothing of that size was touched


def test_cache_entries_huge_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _refused(["run", "--cache-entries", str(MAX_RUNNING)], tmp_path, capsys, "over the budget of", f"--cache-entries ({MAX_RUNNING})")


def test_max_new_tokens_past_the_builtin_bound(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _refused(["run", "--max-new-tokens", "200"], tmp_path, capsys,
             "--max-new-tokens 200 is over 73: the context limit 512 minus the longest built-in prompt (436 bytes) minus k + 1 = 3")


def test_bench_serve_max_new_tokens_past_the_builtin_bound(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _refused(["bench", "serve", "--max-new-tokens", "100"], tmp_path, capsys, "--max-new-tokens 100 is over 73")


@pytest.mark.parametrize("option", ["--requests", "--chunk-size", "--token-budget", "--prefill-streak", "--cache-entries"])
def test_bench_serve_sweep_refuses_the_builtin_workload_options(tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str) -> None:
    _refused(["bench", "serve", "--sweep", option, "4"], tmp_path, capsys,
             f"{option} 4 with --sweep: the sweep sizes its own workload and engines (B requests of 8 new tokens each")


def test_bench_serve_sweep_new_tokens_past_the_context_bound(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _refused(["bench", "serve", "--sweep", "2", "--max-new-tokens", str(1 << 20)], tmp_path, capsys,
             f"--max-new-tokens {1 << 20} with --sweep: the longest sweep prompt plus {1 << 20} new tokens and k + 1 needs")


def test_bench_serve_sweep_over_the_memory_bound_is_refused_before_allocation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _refused(["bench", "serve", "--sweep", "8", str(10**5)], tmp_path, capsys, "the run would need about", "over the budget of")


@pytest.mark.parametrize("where", ["directory", "missing-parent"])
def test_bench_serve_json_path_is_refused_like_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str) -> None:
    path = tmp_path if where == "directory" else tmp_path / "missing" / "bench.json"
    fragment = "is a directory" if where == "directory" else "no such directory"
    _refused(["bench", "serve", "--requests", "1", "--json", str(path)], tmp_path, capsys, f"--json {str(path)!r}: {fragment}")


def test_json_into_a_missing_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "nope" / "summary.json"
    code = _main(["run", "--json", str(target)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1
    assert f"--json '{target}': no such directory '{target.parent}'" in err
    assert not target.parent.exists()


def test_json_onto_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = _main(["run", "--json", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err == f"batchc: error: --json '{tmp_path}': is a directory\n"


def _json_refused(path: str, tmp: Path, capsys: pytest.CaptureFixture[str], fragment: str) -> None:
    """``--json path`` on a small run: status 2 and one line, before the run printed anything."""
    code = _main(["run", "--requests", "2", "--max-new-tokens", "4", "--k", "0", "--lossless-sample", "0", "--json", path])
    out, err = capsys.readouterr()
    assert code == 2, (code, err)
    assert out == "", "the run happened first: " + out[:200]
    assert err == f"batchc: error: --json {path!r}: {fragment}\n"
    assert not list(tmp.glob(".*.tmp"))


def test_json_onto_a_device(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _json_refused("/dev/full", tmp_path, capsys, "a character device, not a regular file ('-' is stdout)")


@pytest.mark.skipif(not Path("/proc/version").exists(), reason="no procfs")
def test_json_onto_a_proc_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a regular file to stat (and writable for root), but no file can be created next to it
    _json_refused("/proc/version", tmp_path, capsys, "cannot create a file in '/proc' (No such file or directory)")


@pytest.mark.parametrize("dangling", [True, False], ids=["dangling", "to-a-file"])
def test_json_onto_a_symlink(tmp_path: Path, capsys: pytest.CaptureFixture[str], dangling: bool) -> None:
    victim, link = tmp_path / "victim.json", tmp_path / "link.json"
    if not dangling:
        victim.write_text("precious\n")
    link.symlink_to(victim)
    _json_refused(str(link), tmp_path, capsys, "is a symbolic link (links are not followed; '-' is stdout)")
    assert victim.read_text() == "precious\n" if not dangling else not victim.exists()


def test_json_onto_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    # a subprocess with a timeout: writing into a FIFO blocks until a reader comes
    fifo = tmp_path / "summary.fifo"
    os.mkfifo(fifo)
    result = forkserver.run(
        [sys.executable, "-m", "compiler.cli", "run", "--requests", "2", "--max-new-tokens", "4", "--json", str(fifo)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"batchc: error: --json '{fifo}': a FIFO, not a regular file ('-' is stdout)\n"
    assert result.stdout == ""


def test_json_replaces_a_regular_file_keeping_its_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    summary = tmp_path / "summary.json"
    summary.write_text("old " * 1000)
    summary.chmod(0o600)
    code = _main(["run", "--requests", "2", "--max-new-tokens", "4", "--k", "0", "--lossless-sample", "0", "--json", str(summary)])
    assert code == 0, capsys.readouterr().err
    assert json.loads(summary.read_text())["requests"] == 2
    assert summary.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


# ---- environment --------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["3", "yes", "-1", " 1", "1 ", "2.0"])
def test_bad_batchc_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("BATCHC_VERIFY", value)
    err = _refused(["run"], tmp_path, capsys, f"BATCHC_VERIFY must be 0, 1 or 2, got {value!r}")
    assert err == f"batchc: error: BATCHC_VERIFY must be 0, 1 or 2, got {value!r}\n"


def test_dump_dir_that_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "dumps"
    path.write_text("keep me\n")
    monkeypatch.setenv("BATCHC_DUMP_DIR", str(path))
    _refused(["run"], tmp_path, capsys, f"dump folder '{path}' exists and is not a directory")
    assert path.read_text() == "keep me\n"


def test_dump_dir_holding_a_symlink_is_refused_before_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    dumps, victim = tmp_path / "dumps", tmp_path / "victim.txt"
    dumps.mkdir()
    victim.write_text("precious\n")
    (dumps / "00001-prepare_for_extend.txt").symlink_to(victim)
    monkeypatch.setenv("BATCHC_DUMP_DIR", str(dumps))
    _refused(["run"], tmp_path, capsys, f"dump folder '{dumps}' holds a symbolic link '00001-prepare_for_extend.txt'")
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("target", ["dir", "dangling"])
def test_dump_dir_that_is_a_symlink_is_refused_before_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch, target: str) -> None:
    real, link = tmp_path / "real", tmp_path / "dumps"
    if target == "dir":
        real.mkdir()
    link.symlink_to(real)
    monkeypatch.setenv("BATCHC_DUMP_DIR", str(link))
    _refused(["run"], tmp_path, capsys, f"dump folder '{link}' is a symbolic link; dump files are never written through links")
    assert not real.exists() or list(real.iterdir()) == []


def test_nul_byte_in_a_path_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _refused(["run", "--workload", "a\0b"], tmp_path, capsys, "'a\\x00b': cannot read workload file (a path cannot hold a NUL byte)")
    _refused(["run", "--model", "a\0b", "--k", "0"], tmp_path, capsys, "a path cannot hold a NUL byte")


def test_dump_file_never_follows_a_link_planted_during_the_run(tmp_path: Path) -> None:
    dumps, victim = tmp_path / "dumps", tmp_path / "victim.txt"
    victim.write_text("precious\n")
    pm = PassManager(dump_dir=dumps)  # the folder is checked and created here
    empty = DecodeBatch.empty()
    pm.run(filter_batch, empty, [])
    assert (dumps / "00001-filter_batch.txt").read_text().startswith("DecodeBatch")
    (dumps / "00002-filter_batch.txt").symlink_to(victim)  # planted after the check
    with pytest.raises(SettingsError, match=r"dump file '.*00002-filter_batch\.txt': cannot open it as a plain file, links are not followed"):
        pm.run(filter_batch, empty, [])
    os.link(victim, dumps / "00003-filter_batch.txt")  # a hard link is refused too
    with pytest.raises(SettingsError, match=r"00003-filter_batch\.txt' is not a regular file with a single link"):
        pm.run(filter_batch, empty, [])
    assert victim.read_text() == "precious\n"
    # an ordinary stale dump of an earlier run is overwritten
    (dumps / "00004-filter_batch.txt").write_text("stale " * 1000)
    pm.run(filter_batch, empty, [])
    assert (dumps / "00004-filter_batch.txt").read_text() == (dumps / "00001-filter_batch.txt").read_text()


# ---- checkpoints ------------------------------------------------------------------------------------


def _config_fields(**changes: object) -> dict[str, object]:
    fields: dict[str, object] = json.loads(config_to_json(tiny()))
    fields.update(changes)
    return fields


def _checkpoint(tmp: Path, name: str, **changes: object) -> Path:
    """tiny()'s weights under a config with ``changes`` (refused from the config, before the tensors)."""
    path = tmp / name
    safetensors.torch.save_file({k: v.contiguous() for k, v in init_weights(tiny(), 3).items()}, str(path),
                                metadata={"format": FORMAT, "config": json.dumps(_config_fields(**changes))})
    return path


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"rope_theta": 0.0}, "bad config: rope_theta must be a finite number >= 1, got 0.0"),
        ({"rope_theta": 10**400}, "bad config: field 'rope_theta' must be a finite number, got an integer of 401 digits"),
        ({"rope_theta": -10000.0}, "bad config: rope_theta must be a finite number >= 1, got -10000.0"),
        ({"rope_theta": 1e-300}, "bad config: rope_theta must be a finite number >= 1"),
        ({"rms_eps": 1e300}, "bad config: rms_eps must be at most 1"),
        ({"d_model": 1 << 40}, "bad config: d_model must be at most 65536, got 1099511627776"),
        ({"vocab": 10**9}, "bad config: vocab must be at most 262144, got 1000000000"),
        ({"d_state": 1 << 20}, "bad config: d_state must be at most 65536"),
        ({"layers": ["mamba"] * 100_000}, "bad config: layers: at most 256 layers, got 100000"),
    ],
    ids=["rope-theta-zero", "rope-theta-huge-int", "rope-theta-negative", "rope-theta-tiny", "rms-eps-huge", "d-model-huge", "vocab-huge",
         "d-state-huge", "layers-huge"],
)
def test_checkpoint_config_out_of_bounds(tmp_path: Path, capsys: pytest.CaptureFixture[str], changes: dict[str, object], fragment: str) -> None:
    path = _checkpoint(tmp_path, "bad.safetensors", **changes)
    _refused(["run", "--model", str(path), "--k", "0"], tmp_path, capsys, f"{path}: {fragment}")


_BUDGET_BYTES = 4 << 30
"""The memory budget the runs below are refused against (their estimates are 5.5 and 13 GiB): about
4 GiB whatever the machine, through ``--memory-fraction`` (``_about_4_gib``)."""


def _about_4_gib() -> list[str]:
    """``--memory-fraction`` for a budget of about ``_BUDGET_BYTES`` on this machine now (all of it
    when less is available: the runs are refused all the more)."""
    return ["--memory-fraction", repr(min(1.0, _BUDGET_BYTES / available_memory()))]


def test_small_checkpoint_asking_for_gigabytes_is_refused_before_allocation(tmp_path: Path) -> None:
    # 0.7 MB of weights whose Mamba state is 256 MB per slot: the pools alone would be about 10 GB
    # (the sizes given: the defaults would be lowered to fit the budget, and the run would start)
    cfg = HybridConfig(d_model=1, layers=("mamba",), nheads=1, head_dim=8192, d_state=8192, attn_heads=1,
                       attn_head_dim=2, mlp_hidden=1)
    path = tmp_path / "hostile.safetensors"
    save_checkpoint(path, cfg, init_weights(cfg, 0))
    assert path.stat().st_size < 800_000
    out, err, peak = tmp_path / "out", tmp_path / "err", tmp_path / "peak"
    # The peak is measured by a small launcher process: a child forked straight from this test process
    # inherits its high-water mark at exec (Linux carries the old memory's peak into ru_maxrss), and
    # the test process holds every model the suite has built so far.
    launcher = (
        "import os, subprocess, sys\n"
        "with open(sys.argv[1], 'wb') as o, open(sys.argv[2], 'wb') as e:\n"
        "    child = subprocess.Popen(sys.argv[4:], stdout=o, stderr=e)\n"
        "    _, status, usage = os.wait4(child.pid, 0)\n"
        "open(sys.argv[3], 'w').write(str(usage.ru_maxrss))\n"
        "sys.exit(os.waitstatus_to_exitcode(status))\n"
    )
    code = subprocess.call([sys.executable, "-c", launcher, str(out), str(err), str(peak),
                            sys.executable, "-m", "compiler.cli", "run", "--model", str(path), "--k", "0", "--max-running", "8",
                            "--cache-entries", "16", "--token-budget", "2048", *_about_4_gib()], cwd=REPO)
    stderr = err.read_text()
    assert code == 2 and out.read_text() == "", stderr
    assert stderr.count("\n") == 1
    # 8 running + 16 cache entries + 2 spare slots + the padding row: 27 x 256 MiB = 6.75 GiB of target pool alone
    assert "the run would need about 13.0 GiB (largest part: target, 6.8 GiB), over the budget of" in stderr
    maxrss = int(peak.read_text())
    assert maxrss < 1024 * 1024, f"the child reached {maxrss} KiB"


_BUDGET_256 = ["--token-budget", "256", "--cache-entries", "8", "--max-running", "8"]


def _wide_scan_config(chunk_size: int = 64) -> HybridConfig:
    """65536 Mamba heads of dimension 1: a few MB of weights, but each ``[Q, Q, nheads]`` tensor of
    the chunked SSD scan is 1 GiB at Q = 64."""
    return HybridConfig(d_model=4, layers=("mamba",), nheads=65536, head_dim=1, d_state=1, attn_heads=1, attn_head_dim=2,
                        mlp_hidden=1, chunk_size=chunk_size)


_WIDE_SCAN_RUNS = {
    # (256 prefill tokens a step: the scan's working memory, not the packed tokens', is what is measured here)
    "chunk-512": ["--chunk-size", "512", *_BUDGET_256],
    "lossless-check-chunks-by-the-context": ["--chunk-size", "8", *_BUDGET_256],
    "chunk-512-no-lossless": ["--chunk-size", "512", "--lossless-sample", "0", *_BUDGET_256],
}


@pytest.fixture(scope="module")
def wide_scan_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, subprocess.Popen[str]]]:
    """``batchc run`` of ``_WIDE_SCAN_RUNS`` on one wide checkpoint, each capped at 6 GiB of address
    space (a regression fails to allocate instead of eating the machine): started together when the
    first test asks, each test reads its own."""
    path = tmp_path_factory.mktemp("wide") / "wide.safetensors"
    save_checkpoint(path, _wide_scan_config(), init_weights(_wide_scan_config(), 0))
    assert path.stat().st_size < 8_000_000
    limit = 6 << 30

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    runs = {
        name: subprocess.Popen([sys.executable, "-m", "compiler.cli", "run", "--model", str(path), "--k", "0", *args, *_about_4_gib()], cwd=REPO,
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=cap)
        for name, args in _WIDE_SCAN_RUNS.items()
    }
    try:
        yield runs
    finally:
        for proc in runs.values():
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


@pytest.mark.parametrize(("name", "gib", "part"), [(name, "5.5", "5.3") for name in _WIDE_SCAN_RUNS], ids=list(_WIDE_SCAN_RUNS))
def test_checkpoint_whose_chunk_scan_asks_for_gigabytes_is_refused(wide_scan_runs: dict[str, subprocess.Popen[str]], name: str, gib: str,
                                                                   part: str) -> None:
    # the estimate used to stop at 0.81 GiB while the scan's [Q, Q, nheads] tensors asked for ~28 GB
    proc = wide_scan_runs[name]
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2 and stdout == "", (proc.returncode, stderr)
    assert stderr.count("\n") == 1
    assert f"the run would need about {gib} GiB (largest part: forward working memory, {part} GiB), over the budget of" in stderr


def test_chunk_scan_estimate_follows_the_models_chunk_length() -> None:
    cfg = _wide_scan_config()
    small_chunks = attrs.evolve(cfg, chunk_size=8)
    runs = ServeConfig(k=0, chunk_size=8, token_budget=256, lossless_sample=0)
    assert sum(memory_estimate(small_chunks, None, runs).values()) < _BUDGET_BYTES  # Q = 8: 64 MiB a tensor
    # Q = min(64, 8) for the served engine, but the lossless check prefills 256 tokens at a time
    assert sum(memory_estimate(cfg, None, attrs.evolve(runs, lossless_sample=1)).values()) > _BUDGET_BYTES
    assert sum(memory_estimate(small_chunks, None, attrs.evolve(runs, lossless_sample=1)).values()) < _BUDGET_BYTES


def test_checkpoint_that_is_dev_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _refused(["run", "--model", "/dev/zero"], tmp_path, capsys, "/dev/zero: no such checkpoint file: a character device, not a regular file")


def test_checkpoint_over_the_size_bound(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "huge.safetensors"
    with path.open("wb") as f:
        f.truncate(MAX_CHECKPOINT_BYTES + 1)  # sparse
    _refused(["run", "--model", str(path)], tmp_path, capsys, f"{path}: file of {MAX_CHECKPOINT_BYTES + 1} bytes is over the limit")


def _vocab_checkpoint(tmp: Path, name: str, vocab: int) -> Path:
    cfg = attrs.evolve(tiny(), vocab=vocab)
    path = tmp / name
    save_checkpoint(path, cfg, init_weights(cfg, 1))
    return path


def test_draft_vocabulary_mismatch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    draft = _vocab_checkpoint(tmp_path, "draft300.safetensors", 300)
    _refused(["run", "--draft", str(draft)], tmp_path, capsys, f"draft {draft}: vocab 300 does not match the vocab 256 of bundled target")


@pytest.mark.parametrize("vocab", [128, 300])
def test_target_vocabulary_other_than_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str], vocab: int) -> None:
    model = _vocab_checkpoint(tmp_path, f"target{vocab}.safetensors", vocab)
    _refused(["run", "--model", str(model), "--k", "0"], tmp_path, capsys,
             f"target {model}: vocab {vocab}; batchc run serves byte prompts and needs vocab 256")


# ---- honest exit status ------------------------------------------------------------------------------


def test_failed_forward_aborts_are_counted_and_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    summary = tmp_path / "summary.json"
    with faults.armed(faults.FaultPoint.MODEL_FORWARD, after=2) as fired:
        # (a prefill budget that splits the eight prompts over several forwards: the third model
        # forward is then one of the served run's, and it carries some requests, not all)
        code = main(["run", "--requests", "8", "--max-new-tokens", "6", "--lossless-sample", "8", "--token-budget", "160", "--json", str(summary)])
    out, err = capsys.readouterr()
    assert fired == {faults.FaultPoint.MODEL_FORWARD: 1}
    assert code == 1
    assert err.count("\n") == 1 and err.startswith("batchc: run failed: ") and "Traceback" not in err
    assert "aborted by 1 failed forwards, first: forward of requests [" in err
    assert "failed: InjectedFault: injected fault at model_forward" in err  # the cause's kind and its own words, not a repr
    s = json.loads(summary.read_text())
    assert s["failed_forwards"] == 1 and 1 <= s["aborted_requests"] <= 8
    assert f"{s['aborted_requests']} requests aborted" in err
    assert "injected fault at model_forward" in s["first_failure"]
    assert s["slots_live_after"] == 0 and s["kv_live_after"] == 0 and s["outstanding_tickets"] == 0
    # the aborted requests' cut-short outputs are not held against the lossless check
    assert s["lossless_ok"] is True, s["lossless_check"]
    assert f"({s['aborted_requests']} aborted requests not compared)" in s["lossless_check"]
    assert "aborted_requests" in out and "failed_forwards" in out
