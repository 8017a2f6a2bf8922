"""MTP speculative decoding on gfx936's no-FP8 path (issue #20), through vLLM's real V1 engine on
the CPU, on the trained tiny DeepSeek V4 (models/dsv4-tiny-gpl3): greedy output with
`speculative_config={"method": "mtp", "num_speculative_tokens": k}` is token-for-token the output
without speculation, for k = 1, 2, 3, at batch 1, 8 and 16.

No MTP oracle is needed: greedy speculative decoding must return the target model's own argmax
chain whatever the drafts are, so the reference is the same engine without speculation. Every
verify step runs k + 1 query tokens per request through every op (Sparse MLA decode with query
length > 1, the indexer and the C4/C128 compressors) and must then forget the rejected drafts
(KV cache, compressor state, indexer cache): a trace would change later tokens.

Workload (dsv4_mtp_run.py, one engine per k plus one without speculation): one 250-token prompt
alone (decode crosses block 256 and C128 at 256), then 8 and 16 concurrent requests of 24..399
tokens (prefill and decode cross C4, C128 at 128/256/384 and block 256), MAX_TOKENS each.

The tiny model's MTP layer is trained with the model frozen (tools/dsv4_mtp_train.py; about 60%
of first drafts are accepted here, docs/dsv4-mtp.md), so both paths of the verify step run: drafts
accepted (the tokens the target would have produced anyway) and drafts rejected (rolled back).
The engine's spec-decode counters must be consistent (k drafts per verify step, accepted <=
drafted, per-position acceptance non-increasing) and give >= 1 token per step. A corrupted verify
step (every draft accepted, in a private copy of the installed package) must fail the identity.

Cost (CPU tier): five engines (k = 0..3, the mutant); 11.9 min for the module with 64 tokens per
request on the shared 2-core box under load (2026-12-04), hence 32 tokens per request.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.e2e import dsv4_check as C  # noqa: E402
from tests.e2e.dsv4_mutations import ENGINE_THREADS  # noqa: E402

RUNNER = Path(__file__).with_name("dsv4_mtp_run.py")
MAX_TOKENS = 32
KS = (1, 2, 3)
BATCHES = (8, 16)
RUN_TIMEOUT_S = 1800


def batch1_prompts() -> list[list[int]]:
    return [C.passage_prompt(C.corpus(), 0, 250)]


def batch_prompts() -> list[list[int]]:
    """16 requests of 24..399 tokens from different paragraphs (as the e2e check's)."""
    c = C.corpus()
    return [C.passage_prompt(c, 3 + 7 * j, 24 + 25 * j) for j in range(max(BATCHES))]


def run_engine(venv_bin: Path, tmp: Path, k: int, *, max_tokens: int = MAX_TOKENS,
               batches=BATCHES, pythonpath: str | None = None, method: str = "mtp") -> dict:
    ids, bids, out = tmp / "prompts.json", tmp / "batch.json", tmp / f"{method}-k{k}.json"
    ids.write_text(json.dumps(batch1_prompts()))
    bids.write_text(json.dumps(batch_prompts()))
    cmd = [str(venv_bin / "python"), str(RUNNER), "--model", str(C.MODEL), "--ids", f"@{ids}",
           "--batch-ids", f"@{bids}", "--out", str(out), "--max-tokens", str(max_tokens),
           "--k", str(k), "--method", method]
    for b in batches:
        cmd += ["--batch", str(b)]
    env = {k_: v for k_, v in os.environ.items() if k_ != "TRITON_INTERPRET"}
    # the mutation suite's threads per run: the module's runs go two at a time as its do
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               OMP_NUM_THREADS=str(ENGINE_THREADS))
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, f"engine run (k={k}) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    res = json.loads(out.read_text())
    res["wall_s"] = time.time() - t0
    return res


@pytest.fixture(scope="module")
def runs(venv_bin, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("dsv4-mtp")
    ks = (0,) + KS
    for k in ks:
        (tmp / f"k{k}").mkdir()
    # independent runs, one core each: two at a time, each in its own directory
    with ThreadPoolExecutor(max_workers=2) as pool:
        res = dict(zip(ks, pool.map(lambda k: run_engine(venv_bin, tmp / f"k{k}", k), ks)))
    for k, r in res.items():
        print(f"\nengine k={k}: start {r['engine_start_s']:.1f} s, phases "
              + ", ".join(f"{p} {s:.1f} s" for p, s in r["phase_s"].items())
              + f", whole run {r['wall_s']:.1f} s")
    return res


def tokens_per_step(s: dict) -> float:
    """Tokens a request gains per verify step: 1 (the target's own) + accepted drafts."""
    return 1.0 + s["accepted_tokens"] / s["drafts"]


def identical(base: dict, spec: dict) -> list[tuple[str, int]]:
    """(workload, tokens compared) after asserting spec's ids equal base's, request by request."""
    out = []
    assert len(spec["greedy"]) == len(base["greedy"]) == len(batch1_prompts())
    for i, (a, b) in enumerate(zip(base["greedy"], spec["greedy"])):
        assert len(a) == MAX_TOKENS
        assert b == a, f"batch 1 prompt {i}: first difference at step " \
                       f"{next(t for t in range(len(a)) if t >= len(b) or a[t] != b[t])}"
    out.append(("batch1", sum(map(len, base["greedy"]))))
    for bsz in BATCHES:
        ra, rb = base["batch"][str(bsz)], spec["batch"][str(bsz)]
        assert len(ra) == len(rb) == bsz
        for j, (a, b) in enumerate(zip(ra, rb)):
            assert len(a) == MAX_TOKENS
            assert b == a, (f"batch {bsz} request {j} ({len(batch_prompts()[j])}-token prompt): first "
                            f"difference at step {next(t for t in range(len(a)) if t >= len(b) or a[t] != b[t])}")
        out.append((f"batch{bsz}", sum(map(len, ra))))
    return out


def test_the_plain_run_is_the_learned_text(runs):
    """The reference itself is right: alone, the 250-token prompt continues with its passage."""
    c = C.corpus()
    s = c["para_starts"][0] + 250 - 1
    assert runs[0]["greedy"][0] == c["stream"][s:s + MAX_TOKENS]


@pytest.mark.parametrize("k", KS)
def test_greedy_with_mtp_is_identical_to_without(runs, k):
    compared = identical(runs[0], runs[k])
    print(f"\nk={k}: identical over " + ", ".join(f"{w} {n} tokens" for w, n in compared))


@pytest.mark.parametrize("k", KS)
def test_spec_decode_counters_are_sane(runs, k):
    rows = []
    for phase, s in runs[k]["spec"].items():
        assert s["drafts"] > 0, f"k={k} {phase}: no draft was verified (speculation not running)"
        assert s["draft_tokens"] == k * s["drafts"], (k, phase, s)
        assert 0 <= s["accepted_tokens"] <= s["draft_tokens"], (k, phase, s)
        per_pos = s["accepted_per_pos"]
        assert len(per_pos) == k and sum(per_pos) == s["accepted_tokens"], (k, phase, s)
        assert all(a >= b for a, b in zip(per_pos, per_pos[1:])), (k, phase, per_pos)
        tps = tokens_per_step(s)
        assert 1.0 <= tps <= k + 1, (k, phase, tps)
        # the trained drafter is worth running: its first draft is accepted often at batch 8
        # and 16 (measured 62-81%, untrained 0.3%); a drafter computing garbage keeps the
        # identity but fails this. Not at batch 1: its prompt ends in paragraph 0, the part of
        # the corpus the MTP training samples barely cover (9.5% there, docs/dsv4-mtp.md).
        if phase != "batch1":
            assert per_pos[0] >= 0.3 * s["drafts"], (k, phase, per_pos, s["drafts"])
        # a verify step per generated token at most: drafts <= tokens generated after the first
        n_req = 1 if phase == "batch1" else int(phase[5:])
        assert s["drafts"] <= n_req * (MAX_TOKENS - 1), (k, phase, s)
        rows.append(f"{phase}: acceptance {s['accepted_tokens']}/{s['draft_tokens']} "
                    f"({s['accepted_tokens'] / s['draft_tokens']:.3%}), per position {per_pos}, "
                    f"{tps:.3f} tokens per step over {s['drafts']} verify steps")
    assert set(runs[k]["spec"]) == {"batch1"} | {f"batch{b}" for b in BATCHES}
    print(f"\nk={k}: " + "; ".join(rows))


# The verify step corrupted (in a private copy of the installed package, as the mutation suite
# does): the greedy rejection compares each draft with itself instead of the target's argmax, so
# every draft is accepted. The identity check must go red.
ACCEPT_ALL = dict(file="v1/sample/rejection_sampler.py",
                  old="target_argmax = target_logits.argmax(dim=-1)",
                  new="target_argmax = draft_token_ids.clone()")
MUTANT_TOKENS = 16


def test_a_corrupted_verify_step_is_caught(runs, venv_bin, tmp_path):
    from tests.e2e import dsv4_mutations as M

    m = M.Mutation(id="mtp-verify-accepts-every-draft", component="spec-decode",
                   bug="greedy verify accepts every draft", caught_by=("identity",), **ACCEPT_ALL)
    root = M.overlay(venv_bin, tmp_path / "overlay")
    with M.applied(root, m):
        bad = run_engine(venv_bin, tmp_path, 1, max_tokens=MUTANT_TOKENS, batches=(),
                         pythonpath=str(root))
    s = bad["spec"]["batch1"]
    print(f"\nmutant: acceptance {s['accepted_tokens']}/{s['draft_tokens']}, ids {bad['greedy'][0]}")
    assert s["accepted_tokens"] == s["draft_tokens"] > 0  # the mutation took effect
    ref = {"greedy": [g[:MUTANT_TOKENS] for g in runs[0]["greedy"]], "batch": {}}
    with pytest.raises(AssertionError, match="first difference"):
        identical_prefix(ref, bad)


def identical_prefix(base: dict, spec: dict) -> None:
    for i, (a, b) in enumerate(zip(base["greedy"], spec["greedy"])):
        assert b == a, f"batch 1 prompt {i}: first difference at step " \
                       f"{next(t for t in range(len(a)) if t >= len(b) or a[t] != b[t])}"
