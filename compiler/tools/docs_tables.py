"""Measurement tables for the docs, generated from the commands' own ``--json`` output.

A measurement is one file ``docs/measurements/NAME.json``: ``{"provenance": {...}, "data": ...}``,
where ``data`` is exactly what the command wrote with ``--json`` and ``provenance`` says where it
comes from: the UTC date, the commit (and whether the working tree had uncommitted changes), the
machine (CPU cores, memory, GPU or none, Python and torch versions), the 1-minute load average
before and after (the machines these are taken on are shared: read the load with the figures), the
wall time, and the command line. Nothing in a table is typed by hand: ``render`` builds it from
``data``, and the docs site inserts it where a page says ``<!-- batchc:measurement NAME -->``
(``compiler.tools.docs_hooks``).

    python -m compiler.tools.docs_tables measure docs/measurements/NAME.json -- run --k 2
    python -m compiler.tools.docs_tables render docs/measurements/NAME.json

``measure`` runs ``python -m compiler.cli ARGS --json TMP`` in this checkout, then writes the file;
the command kinds with a ``--json`` output are ``run`` (``--compare-mutable`` too), ``ab``,
``bench serve`` and ``bench decode``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
MEASUREMENTS = ROOT / "docs" / "measurements"
PROVENANCE_KEYS = (
    "date_utc", "commit", "uncommitted_changes", "cores", "memory_gib", "gpu", "python", "torch",
    "load_average_before", "load_average_after", "wall_s", "command",
)
"""What every measurement file's ``provenance`` holds (``check`` refuses a file without one of them)."""


class MeasurementError(ValueError):
    """A measurement file that cannot be rendered: its kind is unknown or a field is missing."""


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    return None


def machine() -> dict[str, Any]:
    """The machine a measurement runs on (cores, memory, GPU, versions)."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cores": os.cpu_count(), "memory_gib": _memory_gib(), "gpu": gpu,
        "python": platform.python_version(), "torch": torch.__version__,
    }


def kind_of(command: Sequence[str]) -> str:
    """``run``, ``ab``, ``bench serve`` or ``bench decode``: the commands whose ``--json`` output a table is built from."""
    words = [w for w in command if not w.startswith("-")]
    if words[:1] in (["run"], ["ab"]):
        return words[0]
    if words[:2] in (["bench", "serve"], ["bench", "decode"]):
        return " ".join(words[:2])
    raise MeasurementError(f"no table for the command {' '.join(command)!r}: run, ab, bench serve and bench decode write --json")


def measure(out: Path, args: Sequence[str]) -> dict[str, Any]:
    """Run ``batchc ARGS --json TMP`` here and write ``out`` with the output and its provenance."""
    kind_of(args)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "out.json"
        before = os.getloadavg()[0]
        start = time.perf_counter()
        date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        subprocess.run([sys.executable, "-m", "compiler.cli", *args, "--json", str(raw)], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - start
        after = os.getloadavg()[0]
        data = json.loads(raw.read_text())
    provenance = {
        "date_utc": date, "commit": _git("rev-parse", "HEAD"), "uncommitted_changes": bool(_git("status", "--porcelain", "--untracked-files=no")),
        **machine(), "load_average_before": round(before, 2), "load_average_after": round(after, 2), "wall_s": round(wall, 1),
        "command": " ".join(["batchc", *args]),
    }
    record = {"provenance": provenance, "data": data}
    out.write_text(json.dumps(record, indent=2) + "\n")
    return record


def _need(obj: dict[str, Any], key: str, where: str) -> Any:
    if key not in obj:
        raise MeasurementError(f"{where}: no field {key!r}")
    return obj[key]


def provenance_line(p: dict[str, Any]) -> str:
    """One sentence: when, on what commit, on what machine, under what load, with what command."""
    for key in PROVENANCE_KEYS:
        _need(p, key, "provenance")
    commit = p["commit"][:12] + (" plus uncommitted changes" if p["uncommitted_changes"] else "")
    gpu = f"GPU {p['gpu']}" if p["gpu"] else "no GPU"
    return (
        f"Measured {p['date_utc']} on commit `{commit}`; {p['cores']} CPU cores, {p['memory_gib']} GiB memory, {gpu}; "
        f"Python {p['python']}, torch {p['torch']}; 1-minute load average {p['load_average_before']} before and "
        f"{p['load_average_after']} after (a shared machine: other work ran beside it); {p['wall_s']} s for the command "
        f"`{p['command']}`."
    )


def _f(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _x(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _run_table(d: dict[str, Any]) -> str:
    rows = [
        ["compiled", _f(d["acceptance_rate"], 3), _f(d["mean_accepted_length"]), str(d["replays_blocked"]), "0", str(d["steps"]),
         _f(d["tokens_per_s"], 1), _f(d.get("model_s")), _f(d.get("host_ms_per_step"))],
    ]
    for key, name in (("mutable_baseline", "mutable, pre-fix"), ("mutable_baseline_fixed", "mutable + upstream fix")):
        m = d.get(key)
        if m is not None:
            rows.append([name, _f(m["acceptance_rate"], 3), _f(m["mean_accepted_length"]), str(m["replays"]), str(m["stale_ops_run"]),
                         str(m["steps"]), _f(m["tokens_per_s"], 1), _f(m["model_s"]), _f(m["host_ms_per_step"])])
    header = ["run", "acceptance", "mean accepted length", "replays", "stale init ops run", "steps", "tokens/s", "model s", "host ms/step"]
    summary = (
        f"{d['requests']} requests, {d['prompt_tokens']} prompt tokens, {d['generated_tokens']} generated tokens, k = {d['k']}, "
        f"steps {d['steps_by_kind']}; prefix cache hit rate {_f(d['prefix_cache_hit_rate'], 3)} "
        f"({d['prefix_cache_hit_tokens']} prompt tokens reused); clears / COWs / snapshots minted/consumed: target "
        f"{d['target_clears_minted_consumed']}, {d['target_cows_minted_consumed']}, {d['target_snapshots_minted_consumed']}"
    )
    if d.get("draft_clears_minted_consumed") is not None:
        summary += (f"; draft {d['draft_clears_minted_consumed']}, {d['draft_cows_minted_consumed']}, "
                    f"{d['draft_snapshots_minted_consumed']}")
    summary += f"; outstanding tickets {d['outstanding_tickets']}; lossless check: {d.get('lossless_check')}."
    ratio = d.get("tokens_per_s_vs_mutable_fixed")
    if ratio is not None:
        summary += f" Tokens/s, compiled / mutable + upstream fix: {_x(ratio)}."
    return _table(header, rows) + "\n\n" + summary


def _ab_table(d: dict[str, Any]) -> str:
    names = {"compiled": "compiled", "mutable_baseline": "mutable baseline (pre-fix)", "mutable_baseline_fixed": "mutable baseline (fixed)"}
    header = ["k", "run", "acceptance", "mean accepted length", "init ops target", "init ops draft", "replays", "output == greedy"]
    rows = [
        [str(d["k"]), names.get(name, name), _f(r["acceptance_rate"], 3), _f(r["mean_accepted_length"]), str(r["init_ops_target"]),
         str(r["init_ops_draft"]), str(r["replays"]), "yes" if r["equals_greedy"] else "no"]
        for name, r in _need(d, "runs", "ab").items()
    ]
    drafting = "the bundled target's draft head" if d.get("draft") == "mtp" else f"draft noise {d['draft_noise']}"
    return (_table(header, rows) + f"\n\n{d['requests']} requests, {d['max_new_tokens']} new tokens each, {drafting}. "
            f"The pre-fix baseline with a ledger on its runners: `{d['ledger_on_baseline']}`")


def _bench_serve_table(rows: list[dict[str, Any]]) -> str:
    """The rows of ``bench serve --json``; records from before the arrival patterns, latencies,
    sampling settings, acceptance, accepted lengths and step costs were measured lack those columns (``-``).
    A record of ``--replay`` has one more: the host ms/step with the forwards replayed."""
    replayed = any(r.get("host_ms_per_step_replayed") is not None for r in rows)
    header = ["arrivals", "running", "k", "engine", "draft", "sampling", "tokens", "steps", "tokens/s (median)", "tokens/s (min to max)",
              "/ mutable-fixed", "/ k=0", "acceptance", "acc len", "it/dec", "model s", "host ms/step",
              *(["host ms/step, forwards replayed"] if replayed else []), "TTFT ms (p50)", "TPOT ms (p50)"]
    body = []
    for r in rows:
        tps = [run["tokens_per_s"] for run in r["runs"]]
        engine = r["engine"] + (" + overlap" if r["overlap"] else "")
        draft = str(r.get("draft", "model" if r["k"] else "none"))  # (records from before the draft heads: the separate draft)
        body.append([str(r.get("arrivals", "-")), str(r["running"]), str(r["k"]), engine, draft, str(r.get("sampling", "-")), str(r["tokens"]),
                     str(r["steps"]), _f(r["tokens_per_s"], 1), f"{min(tps):.1f} to {max(tps):.1f}", _x(r["tokens_per_s_vs_mutable_fixed"]),
                     _x(r["tokens_per_s_vs_k0"]), _f(r.get("acceptance"), 3), _f(r.get("accepted_length")), _f(r.get("iteration_decodes")),
                     _f(r["model_s"]), _f(r["host_ms_per_step"]), *([_f(r.get("host_ms_per_step_replayed"))] if replayed else []),
                     _f(r.get("ttft_ms_p50"), 1), _f(r.get("tpot_ms_p50"), 1)])
    repeats = sorted({r["repeats"] for r in rows})
    return _table(header, body) + f"\n\nMedians of {', '.join(map(str, repeats))} interleaved repeats per row."


def _threads(n: int) -> str:
    return f"{n} thread" + ("" if n == 1 else "s")


def _bench_decode_table(d: dict[str, Any]) -> str:
    """The cases of ``bench decode --json`` and, when it was measured, the split of a decode step."""
    rows = d["rows"]
    header = ["dtype", "threads", "batch", "prompt tokens/s", "decode ms/step (median)", "decode ms/step (min to max)", "model ms",
              "sampler ms", "host ms", "copy GB/s", "weight-read bound ms", "/ bound", "weights + state bound ms"]
    body = [[r["dtype"], str(r["threads"]), str(r["batch"]), _f(r["prompt_tokens_per_s"], 1), _f(r["decode_ms_per_step"]),
             f"{_f(r['decode_ms_per_step_min'])} to {_f(r['decode_ms_per_step_max'])}", _f(r["model_ms_per_step"]),
             _f(r["sampler_ms_per_step"], 3), _f(r["host_ms_per_step"]), _f(r["copy_gb_per_s"], 1), _f(r["weight_bound_ms"]),
             _x(r["decode_ms_per_step"] / r["weight_bound_ms"]), _f(r["traffic_bound_ms"])] for r in rows]
    weights = ", ".join(f"{dtype} {n / 1e9:.3f} GB" for dtype, n in d["weight_bytes"].items())
    text = _table(header, body) + (
        f"\n\n{d['model']}: {d['prompt_len']}-token prompts, {d['new_tokens']} new tokens per request, k = 0; medians of "
        f"{d['repeats']} interleaved rounds. Weights read per decode step: {weights}. Copy bandwidth (bytes read plus written, "
        f"one {d.get('copy_bytes', 256 << 20) >> 20} MiB copy, the fastest of each round's copies; the median of the rounds): "
        + ", ".join(f"{_threads(c['threads'])} {_f(c['median'], 1)} GB/s" for c in d["copy_gb_per_s"]) + "."
    )
    split = [r for r in rows if r.get("split") is not None]
    if split:
        header = ["part, ms per decode step", *(f"{r['dtype']}, {_threads(r['threads'])}, batch {r['batch']}" for r in split)]
        body = [[part, *(_f(r["split"][part], 3) for r in split)] for part in d["split_parts"]]
        timed = all("clock_ms_per_step" in r for r in split)  # (earlier records: the split came from one more round)
        body.append(["decode step (mean)" if timed else "decode step (mean, profiled round)", *(_f(r["split_step_ms"], 3) for r in split)])
        if timed:
            body.append(["of which the clock, estimated", *(_f(r["clock_ms_per_step"], 3) for r in split)])
        text += "\n\n" + _table(header, body) + (
            "\n\nThe split is the mean over the timed rounds' decode steps, with the parts' clock running through them "
            "(`backend.parts`); its entries add up to the mean step." if timed else
            "\n\nThe split is the mean over one more round's decode steps, after the timed ones, with the parts' clock on "
            "(`backend.parts`; the bench then measured it so); its entries add up to that round's mean step.")
    agreement = d.get("agreement") or {}
    if agreement:
        header = ["weights", "greedy match", "first divergence per prompt", "top-1 fed float32's tokens", "max abs logit diff",
                  "mean abs logit diff", "float32 logit std", "product"]
        body = [[label, f"{a['greedy_match']:.1%}", " ".join("none" if i is None else str(i) for i in a["first_divergence"]),
                 f"{a['forced_top1']:.1%}", _f(a["logit_max_abs_diff"], 4), _f(a["logit_mean_abs_diff"], 5), _f(a["logit_std"], 3),
                 f"`{a['kernel']}`"] for label, a in agreement.items()]
        first = next(iter(agreement.values()))
        text += "\n\n" + _table(header, body) + (
            f"\n\n16-bit weights against float32, each through its own prefill and decode, on {first['prompts']} prompts of "
            f"{d['prompt_len']} tokens and {first['new_tokens']} greedy tokens each: the share of float32's greedy tokens the "
            "16-bit model repeats, and, fed float32's tokens, its argmax agreement and logit difference.")
    return text


RENDERERS: dict[str, Callable[[Any], str]] = {
    "run": _run_table, "ab": _ab_table, "bench serve": _bench_serve_table, "bench decode": _bench_decode_table,
}


def _gpu_check(record: dict[str, Any]) -> str:
    """``scripts/gpu-check``'s file (``compiler.tools.gpu_check``): its sections, kernels, engine rows and host time."""
    p = _need(record, "provenance", "gpu-check")
    sections = _need(record, "sections", "gpu-check")
    parts = [_table(("section", "status", "s", "error"), [(n, s["status"], _f(s["seconds"], 1), s["error"] or "") for n, s in sections.items()])]
    kernels = (sections.get("kernels") or {}).get("data")
    if kernels:
        parts.append(f"Copy bandwidth {_f(kernels['copy']['gb_s'], 1)} GB/s; state row {kernels['state_row_bytes']} bytes ({kernels['shape']}).")
        parts.append(_table(("kernel", "size", "path", "GB/s", "of copy", "torch GB/s", "torch of copy"), [
            (r["kernel"], r["size"], r["path"], _f(r["gb_s"], 1), _f(r["share_of_copy"]), _f(r["torch_gb_s"], 1), _f(r["torch_share_of_copy"]))
            for r in kernels["rows"]]))
    engine = (sections.get("engine") or {}).get("data")
    if engine:
        parts.append(_table(("batch", "k", "engine", "tok/s", "vs fixed", "vs k=0", "accept", "it/dec", "TTFT ms", "TPOT ms"), [
            (str(r["max_running"]), str(r["k"]), r["engine"], _f(r["tokens_per_s"], 0), _x(r["tokens_per_s_vs_mutable_fixed"]), _x(r["tokens_per_s_vs_k0"]),
             _f(r["acceptance"], 3), _f(r["iteration_decodes"]), _f(r["ttft_ms_p50"], 1), _f(r["tpot_ms_p50"], 1)) for r in engine["rows"]]))
    host = (sections.get("host_time") or {}).get("data")
    if host:
        parts.append(_table(("decode k=0", "wall ms/step", "busy ms/step", "exposed host ms", "share", "readbacks/step"), [
            (b, _f(h["wall_ms_per_step"]), _f(h["busy_ms_per_step"]), _f(h["exposed_host_ms_per_step"]), _f(h["exposed_share"], 3),
             str(h["readbacks_per_step"])) for b, h in host.items()]))
    parts.append(f"{p['label']}. Measured {p['date']} on commit `{str(p['commit'])[:12]}`{' plus uncommitted changes' if p['dirty'] else ''}; "
                 f"{p['device_name']}; torch {p['torch']}, Triton {p['triton']}; `{p['command']}`.")
    return "\n\n".join(parts) + "\n"


def render_record(record: dict[str, Any]) -> str:
    """The table (built from ``data``) and its provenance sentence (a ``scripts/gpu-check`` file: its tables)."""
    if record.get("schema") == "batchc.gpu-check/1":
        try:
            return _gpu_check(record)
        except (KeyError, TypeError) as exc:
            raise MeasurementError(f"gpu-check output without the fields its tables need ({exc})") from None
    p = _need(record, "provenance", "measurement")
    kind = kind_of(str(_need(p, "command", "provenance")).split()[1:])
    try:
        table = RENDERERS[kind](_need(record, "data", "measurement"))
    except (KeyError, TypeError) as exc:
        raise MeasurementError(f"{kind} output without the fields its table needs ({exc})") from None
    return table + "\n\n" + provenance_line(p) + "\n"


def render(name: str) -> str:
    """The table of ``docs/measurements/NAME.json``."""
    path = MEASUREMENTS / f"{name}.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise MeasurementError(f"{path.relative_to(ROOT)}: {exc}") from None
    try:
        return render_record(record)
    except MeasurementError as exc:
        raise MeasurementError(f"{path.relative_to(ROOT)}: {exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m compiler.tools.docs_tables", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="action", required=True)
    m = sub.add_parser("measure", help="run a batchc command with --json and record its output and provenance")
    m.add_argument("out", type=Path)
    m.add_argument("args", nargs=argparse.REMAINDER, help="the batchc arguments after --")
    r = sub.add_parser("render", help="print the markdown table of a measurement file")
    r.add_argument("path", type=Path)
    a = p.parse_args(argv)
    try:
        if a.action == "measure":
            args = a.args[1:] if a.args[:1] == ["--"] else a.args
            record = measure(a.out, args)
            print(render_record(record), end="")
        else:
            print(render_record(json.loads(a.path.read_text())), end="")
    except MeasurementError as exc:
        print(f"docs_tables: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
