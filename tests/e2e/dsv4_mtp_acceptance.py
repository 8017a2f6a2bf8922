"""Acceptance of DeepSeek V4 MTP speculative decoding on the tiny model, CPU tier (issue #20 item 4).

    flock /work/engine.lock nice -n 10 python tests/e2e/dsv4_mtp_acceptance.py \
        --python VENV/bin/python --out build/mtp-acceptance.json [--k 1 --k 2 --k 3] [--batch 8]

VENV: a venv with the fork's CPU wheel (tests/conftest.py `venv_bin` builds one). One engine per k
(tests/e2e/dsv4_mtp_run.py, `{"method": "mtp", "num_speculative_tokens": k}`, greedy, 64 tokens)
plus one without speculation; every speculative run's ids must equal the plain run's (greedy
speculative decoding returns the target's own argmax chain), else the script fails. Workload:
batch 1 = three passages of the trained corpus one at a time (prompts of 150, 250 and 120 tokens
from paragraphs 0, 40 and 80); batch B = the first B prompts of the identity test's batch set
(tests/e2e/test_dsv4_mtp_identical.py: 24..399 tokens). Prints and writes, per k and phase,
acceptance = accepted / drafted tokens, per-position acceptance, and tokens per verify step
= 1 + accepted / verify steps (the engine's spec-decode counters).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.e2e import dsv4_check as C  # noqa: E402

RUNNER = Path(__file__).with_name("dsv4_mtp_run.py")
MAX_TOKENS = 64


def batch1_prompts() -> list[list[int]]:
    c = C.corpus()
    return [C.passage_prompt(c, 0, 150), C.passage_prompt(c, 40, 250), C.passage_prompt(c, 80, 120)]


def batch_prompts(n: int) -> list[list[int]]:
    c = C.corpus()
    return [C.passage_prompt(c, 3 + 7 * j, 24 + 25 * j) for j in range(n)]


def run(python: str, work: Path, k: int, batches: list[int]) -> dict:
    ids, bids, out = work / "prompts.json", work / "batch.json", work / f"k{k}.json"
    ids.write_text(json.dumps(batch1_prompts()))
    bids.write_text(json.dumps(batch_prompts(max(batches + [1]))))
    cmd = [python, str(RUNNER), "--model", str(C.MODEL), "--ids", f"@{ids}", "--batch-ids", f"@{bids}",
           "--out", str(out), "--max-tokens", str(MAX_TOKENS), "--k", str(k)]
    for b in batches:
        cmd += ["--batch", str(b)]
    env = {k_: v for k_, v in os.environ.items() if k_ != "TRITON_INTERPRET"}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"engine run k={k} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    res = json.loads(out.read_text())
    res["wall_s"] = time.time() - t0
    return res


def summary(spec: dict) -> dict:
    s = dict(spec)
    s["acceptance"] = s["accepted_tokens"] / s["draft_tokens"] if s["draft_tokens"] else 0.0
    s["tokens_per_step"] = 1.0 + s["accepted_tokens"] / s["drafts"] if s["drafts"] else 1.0
    n = s["drafts"]
    s["acceptance_per_pos"] = [a / n for a in s["accepted_per_pos"]] if n else []
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", required=True, help="python of a venv with the fork's CPU wheel")
    ap.add_argument("--out", required=True)
    ap.add_argument("--k", type=int, action="append", default=[])
    ap.add_argument("--batch", type=int, action="append", default=[])
    a = ap.parse_args(argv)
    ks = a.k or [1, 2, 3]
    work = Path(a.out).resolve().parent / "mtp-acceptance-work"
    work.mkdir(parents=True, exist_ok=True)
    plain = run(a.python, work, 0, a.batch)
    result: dict = {"max_tokens": MAX_TOKENS, "batches": [1] + a.batch, "plain_wall_s": plain["wall_s"],
                    "k": {}}
    for k in ks:
        r = run(a.python, work, k, a.batch)
        if r["greedy"] != plain["greedy"] or r["batch"] != plain["batch"]:
            raise SystemExit(f"k={k}: greedy output differs from plain decoding")
        result["k"][str(k)] = {"identical_to_plain": True, "wall_s": r["wall_s"],
                               "phase_s": r["phase_s"],
                               "spec": {p: summary(s) for p, s in r["spec"].items()}}
        for p, s in result["k"][str(k)]["spec"].items():
            print(f"k={k} {p}: acceptance {s['accepted_tokens']}/{s['draft_tokens']} = {s['acceptance']:.3f}, "
                  f"per position {[round(x, 3) for x in s['acceptance_per_pos']]}, "
                  f"{s['tokens_per_step']:.3f} tokens per verify step ({s['drafts']} steps); "
                  f"identical to plain decoding", flush=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
