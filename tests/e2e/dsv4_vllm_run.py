"""Run DeepSeek V4 through vLLM's real V1 engine (the fork's CPU wheel) and dump what the e2e test
compares with the oracle. Runs in the CPU-wheel venv (tests/conftest.py `cpu_venv`), not in the
test process: the CPU wheel's compiled ops must not be imported beside the faked-ROCm tests.

    python dsv4_vllm_run.py --model DIR --ids @prompts.json --out out.json \
        [--max-tokens 128] [--logprobs 5] [--batch-ids @more.json --batch 8 --batch 16] \
        [--hidden out.pt]

Output JSON:
  prompt_logprobs[i][t]  {token id: logprob} at prompt position t (None at t = 0): the actual
                         token plus the top --logprobs (teacher-forced over the prompt, prefill path)
  greedy[i]              greedy token ids (temperature 0, ignore_eos), one request at a time
  step_logprobs[i][s]    {token id: logprob} of generated step s (decode path)
  batch[B][j]            greedy ids of request j when B requests run together: the first B prompts
                         of --batch-ids (different lengths), else the --ids prompts cycled
--hidden: in-process forward hooks on every decoder layer record, for the one-at-a-time runs, the
hidden streams after each layer ([T, hc_mult, hidden]) and the attention and MoE outputs inside it
([T, hidden]), prompt (prefill) and generated positions (decode steps) alike, as float32:
  torch.save({"layer.L" | "attn.L" | "ffn.L": [float32 [positions, ...] per prompt]}).
and, for each C4 layer L, the indexer's choice at every position: "indexer.L": int32
[positions, index_topk], the selected compressed entries (request-local, -1 = unused).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path


def _lp(d) -> dict[str, float]:
    return {str(k): (v.logprob if math.isfinite(v.logprob) else repr(v.logprob))
            for k, v in d.items()}


class HiddenRecorder:
    """Forward hooks on the decoder layers of the engine's model (same process: V1
    multiprocessing off). Each forward appends its rows with their positions; `take()` returns
    the rows of the forwards since the last call, ordered by position (one request at a time)."""

    def __init__(self):
        self.rows: dict[str, list] = defaultdict(list)

    def install(self, model) -> int:
        layers = model.model.layers
        for i, layer in enumerate(layers):
            if not hasattr(layer, "attn"):  # pipeline-parallel placeholder
                continue
            layer.register_forward_hook(self._layer_hook(i))
            layer.attn.register_forward_hook(self._sub_hook(f"attn.{i}"))
            layer.ffn.register_forward_hook(self._sub_hook(f"ffn.{i}"))
        for name, mod in model.named_modules():
            if type(mod).__name__ == "DeepseekV4Indexer":  # C4 layers only
                i = int(name.split("layers.")[1].split(".")[0])
                mod.register_forward_hook(self._indexer_hook(f"indexer.{i}"))
        return len(layers)

    def _indexer_hook(self, name):
        def hook(mod, args, out):
            # out is the shared topk_indices_buffer; its first len(positions) rows are this
            # forward's (read now: the next C4 layer overwrites them)
            n = args[4].shape[0]
            self.rows[name].append((None, out[:n, :mod.topk_tokens].detach().to("cpu").int().clone()))
        return hook

    def _layer_hook(self, i):
        def hook(mod, args, out):
            x = out[0]
            if getattr(mod, "use_fused_mhc", False):  # fused path: the stream is hc_post(...)
                x = mod.hc_post(*out)
            self.rows[f"layer.{i}"].append((args[1].detach().cpu().clone(), x.detach().float().cpu()))
        return hook

    def _sub_hook(self, name):
        def hook(mod, args, out):
            pos = args[0] if name.startswith("attn") else None
            self.rows[name].append((pos, out.detach().float().cpu()))
        return hook

    def take(self):
        import torch

        out = {}
        for name, rows in self.rows.items():
            layer = "layer." + name.split(".", 1)[1]
            x = torch.cat([r for _, r in rows])
            pos = torch.cat([p for p, _ in self.rows[layer]])
            if x.shape[0] != pos.shape[0]:
                raise RuntimeError(f"{name}: {x.shape[0]} rows for {pos.shape[0]} positions")
            order = torch.argsort(pos, stable=True)
            if not torch.equal(pos[order], torch.arange(pos.numel())):
                raise RuntimeError(f"{name}: positions {pos.tolist()[:8]}... are not one request's 0..T-1")
            out[name] = x[order]
        self.rows.clear()
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--ids", required=True, help="JSON list of token id lists, or @file")
    ap.add_argument("--batch-ids", help="prompts of the concurrent runs (JSON or @file)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--logprobs", type=int, default=5)
    ap.add_argument("--batch", type=int, action="append", default=[])
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--hidden", help="torch.save file for the per-layer hidden states")
    a = ap.parse_args(argv)

    def load(s):
        return json.loads(Path(s[1:]).read_text() if s.startswith("@") else s)

    prompts = load(a.ids)
    batch_prompts = load(a.batch_ids) if a.batch_ids else None

    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(model=a.model, kv_cache_dtype="fp8", block_size=256, enforce_eager=True,
              max_model_len=a.max_model_len, max_num_batched_tokens=a.max_model_len,
              max_num_seqs=max([16] + a.batch), max_logprobs=max(a.logprobs, 1), seed=0,
              dtype=a.dtype)
    started = time.time() - t0
    rec = None
    if a.hidden:
        rec = HiddenRecorder()
        llm.apply_model(rec.install)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    greedy = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True,
                            logprobs=a.logprobs, prompt_logprobs=a.logprobs)
    out: dict = {"prompt_logprobs": [], "greedy": [], "step_logprobs": [], "batch": {},
                 "engine_start_s": started}
    hidden: dict = defaultdict(list)
    for inp in inputs:  # one at a time: the batch-1 reference
        r = llm.generate([inp], greedy, use_tqdm=False)[0]
        out["prompt_logprobs"].append([None if d is None else _lp(d) for d in r.prompt_logprobs])
        c = r.outputs[0]
        out["greedy"].append(list(c.token_ids))
        out["step_logprobs"].append([_lp(d) for d in c.logprobs])
        if rec is not None:
            for k, v in rec.take().items():
                hidden[k].append(v)
    if rec is not None:
        import torch

        # the last generated token is sampled but never fed back: T = prompt + max_tokens - 1
        torch.save(dict(hidden), a.hidden)
    out["phase_s"] = {"batch1": time.time() - t0 - started}
    plain = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    for b in a.batch:
        tb = time.time()
        if rec is not None:
            rec.rows.clear()
        src = batch_prompts if batch_prompts else prompts
        batch = [{"prompt_token_ids": src[j % len(src)]} for j in range(b)]
        rs = llm.generate(batch, plain, use_tqdm=False)
        out["batch"][str(b)] = [list(r.outputs[0].token_ids) for r in rs]
        out["phase_s"][f"batch{b}"] = time.time() - tb
    if rec is not None:
        rec.rows.clear()
    out["total_s"] = time.time() - t0
    Path(a.out).write_text(json.dumps(out))
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
