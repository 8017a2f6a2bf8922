"""Greedy DeepSeek V4 through vLLM's real V1 engine (the fork's CPU wheel), with or without MTP
speculative decoding, and dump the ids and the engine's spec-decode counters. Runs in the
CPU-wheel venv (tests/conftest.py `cpu_venv`), like dsv4_vllm_run.py.

    python dsv4_mtp_run.py --model DIR --ids @prompts.json --out out.json [--k 0|1|2|3] [--method mtp] \
        [--max-tokens 64] [--batch-ids @more.json --batch 8 --batch 16]

Output JSON:
  greedy[i]        greedy ids (temperature 0, ignore_eos) of prompt i run alone (batch 1)
  batch[B][j]      greedy ids of request j when the first B prompts of --batch-ids run together
  spec[phase]      for k > 0, the engine's counters over that phase ("batch1", "batch8", ...):
                   drafts (verify steps that carried drafts, per request), draft_tokens,
                   accepted_tokens, accepted_per_pos[k]
  engine_start_s, phase_s, total_s
--capture PATH (in-process global forward hooks, V1 multiprocessing off): torch.save of the MTP
layer's first call (the drafter's pass over the first prompt) and of the drafter's first logits:
  input_ids [T], positions [T], previous_hidden_states [T, hc_mult * hidden], out [T, hc_mult *
  hidden] (DeepSeekV4MultiTokenPredictorLayer.forward's arguments and result), logits_in [R, hidden]
  and logits [R, vocab] (the drafter's LogitsProcessor: its hidden rows and its logits).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}


def spec_counters(llm) -> dict:
    from vllm.v1.metrics.reader import Counter, Vector

    out: dict = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_pos": []}
    for m in llm.get_metrics():
        if m.name in COUNTERS and isinstance(m, Counter):
            out[COUNTERS[m.name]] += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos" and isinstance(m, Vector):
            out["accepted_per_pos"] = list(m.values)
    return out


def delta(after: dict, before: dict) -> dict:
    d = {k: after[k] - before[k] for k in COUNTERS.values()}
    bp = before["accepted_per_pos"] or [0] * len(after["accepted_per_pos"])
    d["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], bp)]
    return d


class MtpCapture:
    """Global forward hooks that keep the first call of vLLM's DeepSeek V4 MTP layer and the first
    logits of the drafter (the LogitsProcessor owned by DeepSeekV4MultiTokenPredictor)."""

    def __init__(self):
        import torch

        self.data: dict = {}
        self.drafter_lp: set[int] = set()
        self.handles = [torch.nn.modules.module.register_module_forward_pre_hook(self._pre),
                        torch.nn.modules.module.register_module_forward_hook(self._post)]

    @staticmethod
    def _cpu(t):
        return t.detach().to("cpu").clone()

    def _pre(self, mod, args):
        name = type(mod).__name__
        if name == "DeepSeekV4MultiTokenPredictor":
            self.drafter_lp.add(id(mod.logits_processor))
        elif name == "DeepSeekV4MultiTokenPredictorLayer" and "input_ids" not in self.data:
            for k, v in zip(("input_ids", "positions", "previous_hidden_states", "inputs_embeds"), args):
                self.data[k] = self._cpu(v)
        elif id(mod) in self.drafter_lp and "logits_in" not in self.data:
            self.data["logits_in"] = self._cpu(args[1])

    def _post(self, mod, args, out):
        name = type(mod).__name__
        if name == "DeepSeekV4MultiTokenPredictorLayer" and "out" not in self.data:
            self.data["out"] = self._cpu(out)
        elif id(mod) in self.drafter_lp and "logits" not in self.data:
            self.data["logits"] = self._cpu(out)

    def save(self, path: str) -> None:
        import torch

        for h in self.handles:
            h.remove()
        missing = {"input_ids", "positions", "previous_hidden_states", "out", "logits_in",
                   "logits"} - set(self.data)
        if missing:
            raise RuntimeError(f"--capture: the MTP layer / drafter logits were not seen ({sorted(missing)})")
        torch.save(self.data, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--ids", required=True, help="JSON list of token id lists, or @file")
    ap.add_argument("--batch-ids", help="prompts of the concurrent runs (JSON or @file)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--k", type=int, default=0, help="draft tokens per step (0: no speculation)")
    ap.add_argument("--method", default="mtp", help="speculative method: mtp (DeepSeek V4's MTP "
                    "layer) or ngram (prompt lookup: drafts that get accepted)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, action="append", default=[])
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--capture", help="torch.save file for the MTP layer's first call (see above)")
    a = ap.parse_args(argv)

    def load(s):
        return json.loads(Path(s[1:]).read_text() if s.startswith("@") else s)

    prompts = load(a.ids)
    batch_prompts = load(a.batch_ids) if a.batch_ids else prompts

    from vllm import LLM, SamplingParams

    cap = MtpCapture() if a.capture else None
    t0 = time.time()
    spec = {"method": a.method, "num_speculative_tokens": a.k} if a.k else None
    if spec and a.method == "ngram":
        spec.update(prompt_lookup_min=2, prompt_lookup_max=5)
    llm = LLM(model=a.model, kv_cache_dtype="fp8", block_size=256, enforce_eager=True,
              max_model_len=a.max_model_len, max_num_batched_tokens=a.max_model_len,
              max_num_seqs=max([16] + a.batch), seed=0, dtype="bfloat16",
              speculative_config=spec, disable_log_stats=False)
    out: dict = {"k": a.k, "greedy": [], "batch": {}, "spec": {}, "phase_s": {},
                 "engine_start_s": time.time() - t0}
    greedy = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)

    def phase(name, reqs):
        before = spec_counters(llm) if a.k else None
        tp = time.time()
        rs = llm.generate([{"prompt_token_ids": p} for p in reqs], greedy, use_tqdm=False)
        out["phase_s"][name] = time.time() - tp
        if a.k:
            out["spec"][name] = delta(spec_counters(llm), before)
        return [list(r.outputs[0].token_ids) for r in rs]

    # one at a time: the batch-1 runs share one counter phase
    before = spec_counters(llm) if a.k else None
    tb = time.time()
    for p in prompts:
        out["greedy"] += phase("_one", [p])
    out["phase_s"]["batch1"] = time.time() - tb
    if cap is not None:
        cap.save(a.capture)
    out["phase_s"].pop("_one")
    if a.k:
        out["spec"].pop("_one")
        out["spec"]["batch1"] = delta(spec_counters(llm), before)
    for b in a.batch:
        out["batch"][str(b)] = phase(f"batch{b}", batch_prompts[:b])
    out["total_s"] = time.time() - t0
    Path(a.out).write_text(json.dumps(out))
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
