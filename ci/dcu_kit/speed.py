# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Speed on the cluster: vLLM's ``vllm bench serve`` result JSON -> one summary, and A/B ratios.

``vllm bench serve --save-result`` (vLLM 0.27.1, ``vllm/benchmarks/serve.py``) writes, among
others, ``completed``, ``failed``, ``duration``, ``output_throughput`` and
``total_token_throughput`` (tok/s), ``request_throughput`` (req/s), and for each metric of
``--percentile-metrics`` ``mean_<m>_ms``, ``median_<m>_ms``, ``std_<m>_ms`` and
``p<P>_<m>_ms`` for each ``--metric-percentiles`` P. This module keeps what users read
(TTFT, TPOT, ITL, E2EL percentiles, tok/s), writes it as JSON and prints one line:

    SPEED_SUMMARY label=kernels prompts=64/64 in=1024 out=128 out_tok_s=812.4 total_tok_s=7311.9
        req_s=6.35 ttft_ms_p50=210.1 ttft_ms_p99=900.2 tpot_ms_p50=21.3 ... itl_ms_p99=40.2

A run with a failed request, no completed request or a missing/non-finite number is not a
measurement: ``SPEED_VERDICT: INVALID (...)``, exit 2. ``compare`` reads two summaries (A: the
default kernels, B: the kernels forced off) and prints ``SPEED_AB`` with B/A for times and A/B
for throughputs, so every ratio above 1 means A is faster.

CLI:
    python -m dcu_kit.speed summarize BENCH.json [--label L] [--json-out S.json]
    python -m dcu_kit.speed compare A_SUMMARY.json B_SUMMARY.json [--json-out AB.json]
    python -m dcu_kit.speed wait --base-url URL [--timeout S] [--serve-pid PID]
Exit codes: 0 ok, 2 invalid result, 3 server unreachable (wait), 64 unreadable input.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

METRICS = ("ttft", "tpot", "itl", "e2el")
# The metrics the job asks vllm bench serve for (--percentile-metrics / --metric-percentiles).
PERCENTILE_METRICS = ",".join(METRICS)
PERCENTILES = "50,90,99"
THROUGHPUTS = (("out_tok_s", "output_throughput"), ("total_tok_s", "total_token_throughput"),
               ("req_s", "request_throughput"))
# Forcing the fast paths on (a kernel that cannot load is an error, never a silent PyTorch run)
# and off (the PyTorch references); values from vllm/envs.py of the applied tree.
KERNELS_ON = {"VLLM_GFX936_W8A16_IMPL": "kernel", "VLLM_GFX936_MXFP4_MOE_IMPL": "kernel",
              "VLLM_GFX936_SPARSE_DECODE": "kernel", "VLLM_GFX936_FUSED_OPS": "triton"}
KERNELS_OFF = {"VLLM_GFX936_W8A16_IMPL": "torch", "VLLM_GFX936_MXFP4_MOE_IMPL": "emulation",
               "VLLM_GFX936_SPARSE_DECODE": "reference", "VLLM_GFX936_FUSED_OPS": "torch"}


class InvalidResult(ValueError):
    pass


def _num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def summarize(bench: dict, label: str = "") -> dict:
    """The summary of one ``vllm bench serve`` result; raises InvalidResult naming every
    reason it is not a measurement."""
    problems = []
    completed, failed = _num(bench.get("completed")), _num(bench.get("failed", 0))
    if completed is None or completed < 1:
        problems.append("no completed request")
    if failed is None or failed > 0:
        problems.append(f"{bench.get('failed')} failed request(s)")
        errors = [e for e in bench.get("errors") or [] if e]
        if errors:
            problems.append(f"first error: {str(errors[0])[:200]}")
    out: dict = {"label": label, "completed": int(completed or 0), "failed": int(failed or 0),
                 "duration_s": _num(bench.get("duration"))}
    n = (completed or 0) + (failed or 0)
    out["num_prompts"] = int(n)
    if completed:
        out["mean_input_len"] = (_num(bench.get("total_input_tokens")) or 0) / completed
        out["mean_output_len"] = (_num(bench.get("total_output_tokens")) or 0) / completed
    for name, key in THROUGHPUTS:
        out[name] = _num(bench.get(key))
    pct: dict = {}
    for m in METRICS:
        row = {}
        for k, v in bench.items():
            g = re.fullmatch(rf"(mean|median|p[\d.]+)_{m}_ms", k)
            if g and _num(v) is not None:
                row[g.group(1)] = float(v)
        if row:
            pct[m] = row
    out["ms"] = pct
    for m in ("ttft", "tpot", "itl"):
        if "median" not in pct.get(m, {}) and "p50" not in pct.get(m, {}):
            problems.append(f"no {m} percentiles (run with --percentile-metrics {PERCENTILE_METRICS})")
    for name, _ in THROUGHPUTS:
        if out[name] is None:
            problems.append(f"no {name}")
    bad = [k for k, v in _flat(out) if isinstance(v, float) and not math.isfinite(v)]
    if bad:
        problems.append(f"non-finite {', '.join(bad)}")
    if completed and not (out["out_tok_s"] or 0) > 0:
        problems.append("output throughput is 0")
    if problems:
        raise InvalidResult("; ".join(problems))
    return out


def _flat(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _fmt(v: float) -> str:
    return f"{v:.4g}" if abs(v) < 10 else f"{v:.1f}"


def summary_line(s: dict) -> str:
    parts = [f"label={s['label'] or '-'}", f"prompts={s['completed']}/{s['num_prompts']}",
             f"in={s.get('mean_input_len', 0):.0f}", f"out={s.get('mean_output_len', 0):.0f}"]
    parts += [f"{name}={_fmt(s[name])}" for name, _ in THROUGHPUTS]
    for m in METRICS:
        for p in ("p50", "p90", "p99"):
            v = s["ms"].get(m, {}).get(p, s["ms"].get(m, {}).get("median") if p == "p50" else None)
            if v is not None:
                parts.append(f"{m}_ms_{p}={_fmt(v)}")
    return "SPEED_SUMMARY " + " ".join(parts)


def compare(a: dict, b: dict) -> dict:
    """Ratios with A the default run and B the kernels-off run; > 1 means A is faster:
    throughput A/B, times B/A."""
    r: dict = {"a": a["label"], "b": b["label"]}
    for name, _ in THROUGHPUTS:
        if a.get(name) and b.get(name):
            r[f"{name}_a_over_b"] = a[name] / b[name]
    for m in METRICS:
        for p, va in a["ms"].get(m, {}).items():
            vb = b["ms"].get(m, {}).get(p)
            if vb is not None and va > 0 and p in ("median", "p50", "p90", "p99", "mean"):
                r[f"{m}_ms_{p}_b_over_a"] = vb / va
    return r


def ab_line(r: dict) -> str:
    keys = [k for k in r if k not in ("a", "b")]
    pick = [k for k in keys if k.startswith(("out_tok_s", "total_tok_s"))
            or re.match(r"(ttft|tpot|itl)_ms_(p50|median|p99)_", k)]
    return (f"SPEED_AB a={r['a']} b={r['b']} " + " ".join(f"{k}={r[k]:.3f}" for k in pick)
            + " (ratio > 1: a is faster)")


def _load(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(_usage(f"cannot read {path}: {e}"))


def _usage(msg: str) -> int:
    print(f"SPEED_ERROR: {msg}", file=sys.stderr)
    return 64


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dcu_kit.speed", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summarize", help="vllm bench serve JSON -> summary JSON + SPEED_SUMMARY")
    s.add_argument("bench")
    s.add_argument("--label", default="")
    s.add_argument("--json-out")
    c = sub.add_parser("compare", help="two summaries (A default, B kernels off) -> SPEED_AB")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--json-out")
    w = sub.add_parser("wait", help="wait until the server answers GET /v1/models")
    w.add_argument("--base-url", default="http://127.0.0.1:8000")
    w.add_argument("--timeout", type=float, default=3600)
    w.add_argument("--serve-pid", type=int, default=None)
    w.add_argument("--poll", type=float, default=10.0)
    a = p.parse_args(argv)
    try:
        if a.cmd == "summarize":
            try:
                out = summarize(_load(a.bench), a.label)
            except InvalidResult as e:
                print(f"SPEED_VERDICT: INVALID ({e})")
                return 2
            print(summary_line(out))
            print("SPEED_VERDICT: OK")
        elif a.cmd == "compare":
            out = compare(_load(a.a), _load(a.b))
            print(ab_line(out))
        else:
            from dcu_kit.serve_smoke import ServerError, wait_ready

            try:
                models = wait_ready(a.base_url, a.timeout, poll=a.poll, serve_pid=a.serve_pid)
            except ServerError as e:
                print(f"SERVE_SMOKE_ERROR: {e}")
                return 3
            print(f"SERVE_READY: {[m.get('id') for m in models.get('data', [])]}")
            return 0
    except SystemExit as e:
        return int(e.code or 0)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
