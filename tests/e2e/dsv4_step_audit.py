"""Launches and host syncs per decoder layer in DeepSeek V4 decode steps, through vLLM's real V1
engine on the CPU (the fork's CPU wheel, in-process: V1 multiprocessing off). Runs in the
CPU-wheel venv (tests/conftest.py), started by tests/e2e/test_dsv4_step_audit.py / `make step-audit`.

    python dsv4_step_audit.py --model DIR --out audit.json [--batch 1 --batch 4 --batch 16]

Each decoder layer's forward pre-hook enters a `StepCounter` (tests/e2e/step_counter.py) and its
post-hook leaves it. For every batch size B, B requests (prompts of 118 + 3j tokens, so that
decode crosses C4 boundaries and position 127, a C128 boundary) are submitted at once; the first
step prefills them all (max_num_batched_tokens covers it), every later step with B tokens is a
pure decode step. A step is a "c128" boundary step if a request's position p has (p+1) % 128 == 0,
else "c4" if (p+1) % 4 == 0, else "plain". Then one batch-1 request runs with an extra `.item()`
in each C128 layer's attention (a pre-hook on `layer.attn`), the counter's fail case.

With ``--mtp K`` (speculative_config method mtp, K drafts) one request runs instead and every
step after the prefill is a verify step (K + 1 query tokens): its counts go to "verify".

Output JSON ("prefill": {"B": {kind: {"launches", "syncs", "sync_sites"}}} is the first step of
batch B, the costliest layer call of each kind): {"kinds": {layer: kind}, "results": {"B": {kind: {"plain"|"c4"|"c128":
{"launches": max, "syncs": max, "steps": n}}}}, "ops": {"B": {kind: {op: count in the costliest
step, "sync_sites": {"op @ file:line": count}, "launch_sites": {"file:line": count}}}}, "inject": the batch-1 results again, with the injected `.item()`}
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_counter as SC  # noqa: E402

SC.capture_custom_op_impls()  # before vLLM registers its ops

PROMPT0, PROMPT_STEP = 118, 3


def _extra_item(mod, args):
    """The injected host sync (a forward pre-hook: returns None, args unchanged)."""
    args[1].float().sum().item()


class Audit:
    def __init__(self, kinds: list[str]):
        self.kinds = kinds
        self.watch = SC.HostCopyWatch()
        self.enabled = False
        self.calls: list[dict] = []  # one per layer forward: layer, positions, counts, ops
        self._open: SC.StepCounter | None = None

    def install(self, model) -> int:
        self.watch.install()
        for i, layer in enumerate(model.model.layers):
            if not hasattr(layer, "attn"):
                continue
            layer.register_forward_pre_hook(self._pre(i))
            layer.register_forward_hook(self._post(i))
        return len(model.model.layers)

    def _pre(self, i):
        def hook(mod, args):
            if not self.enabled:
                return
            pos = args[1]
            c = SC.StepCounter()
            self.calls.append({"layer": i, "positions": pos.tolist(), "counter": c})
            self._open = c
            c.__enter__()
            self.watch.active = c
        return hook

    def _post(self, i):
        def hook(mod, args, out):
            c = self._open
            if c is None:
                return
            self.watch.active = None
            c.__exit__(None, None, None)
            self._open = None
        return hook

    def take_steps(self) -> list[list[dict]]:
        """Group the recorded layer calls into model steps (a step starts at the first layer)."""
        steps: list[list[dict]] = []
        first = min(c["layer"] for c in self.calls) if self.calls else 0
        for c in self.calls:
            if c["layer"] == first or not steps:
                steps.append([])
            steps[-1].append(c)
        self.calls = []
        return steps


def step_class(positions: list[int]) -> str:
    if any((p + 1) % 128 == 0 for p in positions):
        return "c128"
    if any((p + 1) % 4 == 0 for p in positions):
        return "c4"
    return "plain"


def summarize(steps, kinds, batch):
    """Max launches/syncs per layer kind and step class over the pure decode steps of batch B,
    and the ops and sync sites of each kind's costliest layer call."""
    res: dict = {}
    worst: dict = {}
    for k, step in enumerate(steps):
        n = len(step[0]["positions"])
        if k == 0 or n != batch:  # the prefill step (and any mixed step) is not a decode step
            continue
        cls = step_class(step[0]["positions"])
        for call in step:
            kind = kinds[call["layer"]]
            c = call["counter"]
            r = res.setdefault(kind, {}).setdefault(cls, {"launches": 0, "syncs": 0, "steps": 0})
            r["steps"] += 1
            r["launches"] = max(r["launches"], c.counts["launch"])
            r["syncs"] = max(r["syncs"], c.counts["sync"])
            cost = c.counts["launch"] + c.counts["sync"]
            if kind not in worst or cost > worst[kind][0]:
                worst[kind] = (cost, {"ops": dict(c.ops), "sync_sites": dict(c.sites),
                                      "launch_sites": dict(c.launch_sites)})
    return res, {k: v[1] for k, v in worst.items()}


def summarize_prefill(steps, kinds):
    """Launches and syncs per layer kind in the first step (it prefills every prompt at once),
    with the sync sites: a per-request Python loop shows as launches that grow with the batch."""
    res: dict = {}
    if not steps:
        return res
    for call in steps[0]:
        kind = kinds[call["layer"]]
        c = call["counter"]
        r = res.setdefault(kind, {"launches": 0, "syncs": 0, "sync_sites": {}})
        if c.counts["launch"] + c.counts["sync"] >= r["launches"] + r["syncs"]:
            r.update(launches=c.counts["launch"], syncs=c.counts["sync"],
                     sync_sites=dict(c.sites))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, action="append", default=[])
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--mtp", type=int, default=0,
                    help="MTP draft tokens: audit the verify steps of one request instead")
    a = ap.parse_args(argv)
    batches = a.batch or [1, 4, 16]

    cfg = json.loads((Path(a.model) / "config.json").read_text())
    ratios = cfg["compress_ratios"][: cfg["num_hidden_layers"]]
    kinds = [SC.layer_kind(r) for r in ratios]

    from vllm import LLM, SamplingParams

    t0 = time.time()
    max_len = 1024
    tokens = sum(PROMPT0 + PROMPT_STEP * j for j in range(max(batches)))
    spec = ({"speculative_config": {"method": "mtp", "num_speculative_tokens": a.mtp}}
            if a.mtp else {})
    llm = LLM(model=a.model, kv_cache_dtype="fp8", block_size=256, enforce_eager=True,
              max_model_len=max_len, max_num_batched_tokens=max(max_len, tokens),
              max_num_seqs=max(batches), seed=0, dtype="bfloat16", **spec)
    audit = Audit(kinds)
    llm.apply_model(audit.install)
    sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    vocab = cfg["vocab_size"]

    def prompt(j):
        return [3 + (7 * j + 13 * t) % (vocab - 3) for t in range(PROMPT0 + PROMPT_STEP * j)]

    out: dict = {"kinds": {str(i): k for i, k in enumerate(kinds)}, "results": {}, "ops": {},
                 "max_tokens": a.max_tokens, "engine_start_s": time.time() - t0}
    if a.mtp:  # one request; every step after the prefill verifies a.mtp drafts (+1 token)
        audit.enabled = True
        llm.generate([{"prompt_token_ids": prompt(0)}], sp, use_tqdm=False)
        audit.enabled = False
        res, ops = summarize(audit.take_steps(), kinds, a.mtp + 1)
        out["verify"] = {"draft_tokens": a.mtp, "results": res, "ops": ops}
        out["total_s"] = time.time() - t0
        Path(a.out).write_text(json.dumps(out, indent=1))
        print(a.out)
        return 0
    for b in batches:
        audit.enabled = True
        llm.generate([{"prompt_token_ids": prompt(j)} for j in range(b)], sp, use_tqdm=False)
        audit.enabled = False
        steps = audit.take_steps()
        res, ops = summarize(steps, kinds, b)
        out["results"][str(b)] = res
        out.setdefault("prefill", {})[str(b)] = summarize_prefill(steps, kinds)
        out["ops"][str(b)] = ops

    Path(a.out).write_text(json.dumps(out, indent=1))  # kept if the injection run fails
    # the counter's fail case: one extra `.item()` in every C128 layer (its attention's pre-hook)
    handles = []

    def inject(model):
        for i, layer in enumerate(model.model.layers):
            if hasattr(layer, "attn") and kinds[i] == "C128":
                handles.append(layer.attn.register_forward_pre_hook(_extra_item))

    llm.apply_model(inject)
    audit.enabled = True
    llm.generate([{"prompt_token_ids": prompt(0)}], sp, use_tqdm=False)
    audit.enabled = False
    out["inject"], _ = summarize(audit.take_steps(), kinds, 1)
    llm.apply_model(lambda model: [h.remove() for h in handles])
    out["total_s"] = time.time() - t0
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
