"""Run DeepSeek V4 through vLLM's real V1 engine (the fork's CPU wheel) and dump what the e2e test
compares with the oracle. Runs in the CPU-wheel venv (tests/conftest.py `cpu_venv`), not in the
test process: the CPU wheel's compiled ops must not be imported beside the faked-ROCm tests.

    python dsv4_vllm_run.py --model DIR --ids @prompts.json --out out.json \
        [--max-tokens 64] [--logprobs 5] [--batch 8 --batch 16]

Output JSON:
  prompt_logprobs[i][t]  {token id: logprob} at prompt position t (None at t = 0): the actual
                         token plus the top --logprobs (teacher-forced over the prompt, prefill path)
  greedy[i]              greedy token ids (temperature 0, ignore_eos), one request at a time
  step_logprobs[i][s]    {token id: logprob} of generated step s (decode path)
  batch[B][j]            greedy ids of request j when B requests (prompts cycled) run together
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path


def _lp(d) -> dict[str, float]:
    return {str(k): (v.logprob if math.isfinite(v.logprob) else repr(v.logprob))
            for k, v in d.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--ids", required=True, help="JSON list of token id lists, or @file")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--logprobs", type=int, default=5)
    ap.add_argument("--batch", type=int, action="append", default=[])
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args(argv)
    prompts = json.loads(Path(a.ids[1:]).read_text() if a.ids.startswith("@") else a.ids)

    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(model=a.model, kv_cache_dtype="fp8", block_size=256, enforce_eager=True,
              max_model_len=a.max_model_len, max_num_batched_tokens=a.max_model_len,
              max_num_seqs=max([16] + a.batch), max_logprobs=max(a.logprobs, 1), seed=0,
              dtype=a.dtype)
    started = time.time() - t0
    inputs = [{"prompt_token_ids": p} for p in prompts]
    greedy = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True,
                            logprobs=a.logprobs, prompt_logprobs=a.logprobs)
    out: dict = {"prompt_logprobs": [], "greedy": [], "step_logprobs": [], "batch": {},
                 "engine_start_s": started}
    for inp in inputs:  # one at a time: the batch-1 reference
        r = llm.generate([inp], greedy, use_tqdm=False)[0]
        out["prompt_logprobs"].append([None if d is None else _lp(d) for d in r.prompt_logprobs])
        c = r.outputs[0]
        out["greedy"].append(list(c.token_ids))
        out["step_logprobs"].append([_lp(d) for d in c.logprobs])
    plain = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    for b in a.batch:
        batch = [inputs[j % len(inputs)] for j in range(b)]
        rs = llm.generate(batch, plain, use_tqdm=False)
        out["batch"][str(b)] = [list(r.outputs[0].token_ids) for r in rs]
    out["total_s"] = time.time() - t0
    Path(a.out).write_text(json.dumps(out))
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
