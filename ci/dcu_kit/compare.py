# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Layered precision plan (field report 15.3): dump, then compare two runs.

A dump is one safetensors file with:
  ``layers.<i>.out<j>``   tensor j of decoder layer i's output for the
                          prompt (prefill) (DeepSeek V4 layers in vLLM return
                          several tensors: hidden, residual/hyper-connection
                          streams; all are kept)
  ``layers.<i>.out<j>.decode<s>``  the same for decode step s (s = 1 makes
                          the second generated token; the seed's bugs lived
                          in decode, J08/J11/J13)
  ``topk.ids``            [steps, k] int64, top-k token ids per generated step
                          (step 0 = next token after the prompt)
  ``topk.logprobs``       [steps, k] float32, their logprobs
  ``tokens``              [steps] int64, the generated (greedy) ids
Metadata (safetensors header) records the prompt, model and the hook mode.

Recording hidden states (``HiddenStateRecorder``): forward hooks on
``model.model.layers[i]``. Usable:
  * on any ``nn.Module`` with ``.model.layers`` (HF transformers reference,
    a CPU mini-model),
  * inside vLLM workers through ``LLM.apply_model(fn)`` (V1 pickles the
    function: set ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``), see
    ``install_in_vllm`` / ``collect_from_vllm``. Hidden states after each
    decoder layer are replicated across TP ranks; rank 0's copy is used. With
    PP, each stage owns its layers (``PPMissingLayer`` is skipped) and the
    per-rank dicts are merged.
  * The recorder must be *armed* right before the real request: vLLM's
    warmup/profile runs call the layers too (dummy batches), and the seed's
    one-shot debug flag was eaten by warmup (J14). ``match_num_tokens``
    additionally drops calls whose token count differs from the prompt's.

Comparison: cosine (float64) and max_abs per tensor, in layer order; the
first layer under ``--min-cosine`` is named (where the divergence starts);
top-k overlap |A ∩ B| / k per step, argmax agreement and the first step
where greedy tokens differ. MATCH needs every compared tensor over the
threshold, the same tensors in both dumps, at least one tensor, and the same
generated tokens: the first divergent token fails the verdict.

CLI: ``python -m dcu_kit.compare dump --model M --out A.safetensors`` (vLLM
run with hooks armed after warmup), then ``python -m dcu_kit.compare diff
A.safetensors B.safetensors [--min-cosine 0.99] [--json]``; diff exits 1 if
any tensor is under the threshold, shapes differ, a tensor or the tokens are
missing from one dump, or the generated tokens differ.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from dcu_kit.probe import DEFAULT_PROMPT, build_parser, engine_kwargs

LAYER_KEY_RE = re.compile(r"^layers\.(\d+)\.out(\d+)(?:\.decode(\d+))?$")


# ----------------------------------------------------------------- recording
class HiddenStateRecorder:
    """Forward hooks that copy each decoder layer's output tensors to CPU."""

    def __init__(
        self,
        model: torch.nn.Module,
        layers_attr: str = "model.layers",
        match_num_tokens: int | None = None,
        last_token_only: bool = False,
        max_calls_per_layer: int = 1,
        decode_steps: int = 0,
    ):
        self.layers = _resolve(model, layers_attr)
        self.match_num_tokens = match_num_tokens
        self.last_token_only = last_token_only
        self.max_calls = max_calls_per_layer
        # After the matched prefill call, record this many single-token
        # (decode) calls per layer as ``.decode<s>``.
        self.decode_steps = decode_steps
        self.armed = False
        self.records: dict[str, torch.Tensor] = {}
        self._calls: dict[int, int] = {}
        self._decodes: dict[int, int] = {}
        self._handles = []
        for i, layer in enumerate(self.layers):
            if type(layer).__name__ == "PPMissingLayer":
                continue
            self._handles.append(layer.register_forward_hook(self._hook(i)))

    def arm(self) -> None:
        self.records.clear()
        self._calls.clear()
        self._decodes.clear()
        self.armed = True

    def disarm(self) -> None:
        self.armed = False

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, idx: int) -> Callable:
        def hook(_mod, _inp, output):
            if not self.armed:
                return
            tensors = [output] if isinstance(output, torch.Tensor) else [
                t for t in (output if isinstance(output, (tuple, list)) else [])
            ]
            first = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
            if first is None:
                return
            n = self._calls.get(idx, 0)
            if n >= self.max_calls:
                d = self._decodes.get(idx, 0)
                if d >= self.decode_steps or first.shape[0] != 1:
                    return
                self._decodes[idx] = d + 1
                for j, t in enumerate(tensors):
                    if isinstance(t, torch.Tensor) and t.is_floating_point():
                        self.records[f"layers.{idx}.out{j}.decode{d + 1}"] = (
                            t.detach().to("cpu", torch.float32).clone())
                return
            if (self.match_num_tokens is not None
                    and first.shape[0] != self.match_num_tokens):
                return  # warmup / dummy batch
            self._calls[idx] = n + 1
            for j, t in enumerate(tensors):
                if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                    continue
                x = t.detach()
                if self.last_token_only and x.dim() >= 2:
                    x = x[-1:]
                key = f"layers.{idx}.out{j}" + (f".call{n}" if n else "")
                self.records[key] = x.to("cpu", torch.float32).clone()

        return hook


def _resolve(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not hasattr(obj, part):
            raise AttributeError(
                f"model has no attribute path {dotted!r} (missing {part!r} on "
                f"{type(obj).__name__}); pass layers_attr=...")
        obj = getattr(obj, part)
    return obj


_VLLM_RECORDER_ATTR = "_dcu_kit_recorder"


def install_in_vllm(llm: Any, match_num_tokens: int | None = None,
                    layers_attr: str = "model.layers",
                    decode_steps: int = 0) -> list[int]:
    """Install (and arm) a recorder on the model in every vLLM worker.

    Needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (V1 pickles the function).
    Call after engine init (so warmup is over), immediately before the
    request you want to record. Returns the hooked layer count per worker.
    """

    def _install(model):
        rec = getattr(model, _VLLM_RECORDER_ATTR, None)
        if rec is None:
            rec = HiddenStateRecorder(model, layers_attr, match_num_tokens)
            setattr(model, _VLLM_RECORDER_ATTR, rec)
        rec.match_num_tokens = match_num_tokens
        rec.decode_steps = decode_steps
        rec.arm()
        return len(rec._handles)

    return llm.apply_model(_install)


def collect_from_vllm(llm: Any) -> dict[str, torch.Tensor]:
    """Disarm and gather the records from all workers (first writer wins:
    TP ranks hold replicated hidden states; PP stages hold disjoint layers).
    """

    def _collect(model):
        rec = getattr(model, _VLLM_RECORDER_ATTR, None)
        if rec is None:
            return {}
        rec.disarm()
        return dict(rec.records)

    merged: dict[str, torch.Tensor] = {}
    for part in llm.apply_model(_collect):
        for k, v in part.items():
            merged.setdefault(k, v)
    return merged


def topk_from_vllm_logprobs(logprobs: list[Mapping[int, Any]], k: int
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM ``CompletionOutput.logprobs`` (request ``logprobs=k``) to tensors.

    Each step maps token id -> Logprob(.logprob, .rank); the sampled token is
    always included, so a step can hold k+1 entries: keep the k best.
    """
    ids, lps = [], []
    for step in logprobs:
        items = sorted(
            ((int(t), float(getattr(lp, "logprob", lp))) for t, lp in step.items()),
            key=lambda x: -x[1],
        )[:k]
        while len(items) < k:
            items.append((-1, float("-inf")))
        ids.append([t for t, _ in items])
        lps.append([p for _, p in items])
    return (torch.tensor(ids, dtype=torch.int64),
            torch.tensor(lps, dtype=torch.float32))


def save_dump(path: str, hidden: Mapping[str, torch.Tensor],
              topk_ids: torch.Tensor | None = None,
              topk_logprobs: torch.Tensor | None = None,
              tokens: torch.Tensor | None = None,
              metadata: Mapping[str, str] | None = None) -> None:
    from safetensors.torch import save_file

    tensors = {k: v.contiguous() for k, v in hidden.items()}
    if topk_ids is not None:
        tensors["topk.ids"] = topk_ids.to(torch.int64).contiguous()
    if topk_logprobs is not None:
        tensors["topk.logprobs"] = topk_logprobs.to(torch.float32).contiguous()
    if tokens is not None:
        tensors["tokens"] = tokens.to(torch.int64).contiguous()
    save_file(tensors, path, metadata={k: str(v) for k, v in (metadata or {}).items()})


def load_dump(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


# ---------------------------------------------------------------- comparing
@dataclass
class TensorDiff:
    key: str
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]
    cosine: float | None
    max_abs: float | None
    finite_a: bool
    finite_b: bool

    @property
    def ok_shape(self) -> bool:
        return self.shape_a == self.shape_b


def cosine_and_max_abs(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """Cosine of the flattened tensors and max |a - b|, in float64.

    Non-finite values make both NaN (a NaN hidden state must not look close).
    Two all-zero tensors have cosine 1; one all-zero tensor gives 0.
    """
    if a.shape != b.shape:
        raise ValueError(
            f"cosine_and_max_abs: shape mismatch {tuple(a.shape)} vs "
            f"{tuple(b.shape)}")
    x = a.detach().reshape(-1).to(torch.float64)
    y = b.detach().reshape(-1).to(torch.float64)
    if not (torch.isfinite(x).all() and torch.isfinite(y).all()):
        return float("nan"), float("nan")
    max_abs = float((x - y).abs().max()) if x.numel() else 0.0
    nx, ny = float(x.norm()), float(y.norm())
    if nx == 0.0 and ny == 0.0:
        return 1.0, max_abs
    if nx == 0.0 or ny == 0.0:
        return 0.0, max_abs
    return float(torch.dot(x, y) / (nx * ny)), max_abs


def _key_order(k: str) -> tuple:
    """Prefill first, then decode step by step; layers in order inside."""
    m = LAYER_KEY_RE.match(k.split(".call")[0])
    if m:
        step = int(m.group(3) or 0)
        return (0, step, int(m.group(1)), int(m.group(2)), k)
    return (1, 0, 0, 0, k)


def compare_hidden(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]
                   ) -> tuple[list[TensorDiff], list[str], list[str]]:
    keys_a = {k for k in a if k.startswith("layers.")}
    keys_b = {k for k in b if k.startswith("layers.")}
    diffs = []
    for k in sorted(keys_a & keys_b, key=_key_order):
        ta, tb = a[k], b[k]
        fa = bool(torch.isfinite(ta).all())
        fb = bool(torch.isfinite(tb).all())
        if ta.shape != tb.shape:
            diffs.append(TensorDiff(k, tuple(ta.shape), tuple(tb.shape), None,
                                    None, fa, fb))
            continue
        cos, mx = cosine_and_max_abs(ta, tb)
        diffs.append(TensorDiff(k, tuple(ta.shape), tuple(tb.shape), cos, mx,
                                fa, fb))
    return (diffs, sorted(keys_a - keys_b, key=_key_order),
            sorted(keys_b - keys_a, key=_key_order))


@dataclass
class TopkDiff:
    steps: int
    k: int
    overlap: list[float]  # per step |A ∩ B| / k
    argmax_agree: list[bool]
    first_token_divergence: int | None  # first step where `tokens` differ
    max_abs_logprob_common: list[float]  # over ids present in both, per step


def compare_topk(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]
                 ) -> TopkDiff | None:
    if "topk.ids" not in a or "topk.ids" not in b:
        return None
    ia, ib = a["topk.ids"], b["topk.ids"]
    la = a.get("topk.logprobs")
    lb = b.get("topk.logprobs")
    steps = min(ia.shape[0], ib.shape[0])
    k = min(ia.shape[1], ib.shape[1])
    overlap, agree, mabs = [], [], []
    for s in range(steps):
        sa = [int(x) for x in ia[s, :k] if int(x) >= 0]
        sb = [int(x) for x in ib[s, :k] if int(x) >= 0]
        overlap.append(len(set(sa) & set(sb)) / k)
        agree.append(bool(sa) and bool(sb) and sa[0] == sb[0])
        if la is not None and lb is not None:
            da = {int(t): float(v) for t, v in zip(ia[s, :k], la[s, :k])}
            db = {int(t): float(v) for t, v in zip(ib[s, :k], lb[s, :k])}
            common = set(da) & set(db) - {-1}
            mabs.append(max((abs(da[t] - db[t]) for t in common), default=math.nan))
    first_div = None
    if "tokens" in a and "tokens" in b:
        ta, tb = a["tokens"].tolist(), b["tokens"].tolist()
        for i, (x, y) in enumerate(zip(ta, tb)):
            if x != y:
                first_div = i
                break
        else:
            if len(ta) != len(tb):
                first_div = min(len(ta), len(tb))
    return TopkDiff(steps, k, overlap, agree, first_div, mabs)


def first_token_divergence(a: Mapping[str, torch.Tensor],
                           b: Mapping[str, torch.Tensor]
                           ) -> tuple[int | None, int | None, int | None]:
    """(step, id in A, id in B) of the first generated token that differs
    (a length difference counts, the missing side is None); all None when
    the token lists are equal."""
    ta, tb = a["tokens"].tolist(), b["tokens"].tolist()
    for i in range(max(len(ta), len(tb))):
        x = ta[i] if i < len(ta) else None
        y = tb[i] if i < len(tb) else None
        if x != y:
            return i, x, y
    return None, None, None


@dataclass
class CompareReport:
    hidden: list[TensorDiff]
    only_a: list[str]
    only_b: list[str]
    topk: TopkDiff | None
    min_cosine: float
    token_divergence: tuple[int | None, int | None, int | None] | None = None

    @property
    def problems(self) -> list[str]:
        """Every reason the two runs cannot be called a MATCH."""
        out = []
        if not self.hidden:
            out.append("no hidden-state tensor in common: nothing was compared")
        if self.bad:
            out.append(f"{len(self.bad)} tensors below min_cosine="
                       f"{self.min_cosine} or of different shape")
        if self.only_a or self.only_b:
            out.append(f"{len(self.only_a)} tensors only in A, "
                       f"{len(self.only_b)} only in B (e.g. decode steps "
                       "recorded on one side only)")
        if self.token_divergence is None:
            out.append("generated tokens missing from a dump: decode was not "
                       "compared")
        elif self.token_divergence[0] is not None:
            s, x, y = self.token_divergence
            out.append(f"generated tokens differ from step {s}: A={x} B={y}")
        return out

    @property
    def bad(self) -> list[TensorDiff]:
        return [d for d in self.hidden
                if not d.ok_shape or d.cosine is None or not (
                    d.cosine >= self.min_cosine)]

    @property
    def first_bad(self) -> TensorDiff | None:
        bad = self.bad
        return bad[0] if bad else None

    @property
    def ok(self) -> bool:
        return not self.problems

    def format(self) -> str:
        bad = self.bad
        out = [f"{'tensor':28} {'shape':>18} {'cosine':>12} {'max_abs':>12}"]
        for d in self.hidden:
            if not d.ok_shape:
                out.append(f"{d.key:28} SHAPE MISMATCH {d.shape_a} vs {d.shape_b}")
                continue
            flag = "  <-- below min_cosine" if d in bad else ""
            nf = "" if d.finite_a and d.finite_b else (
                f"  non-finite in {'A' if not d.finite_a else ''}"
                f"{'B' if not d.finite_b else ''}")
            out.append(f"{d.key:28} {str(d.shape_a):>18} {d.cosine:12.8f} "
                       f"{d.max_abs:12.5g}{flag}{nf}")
        if self.only_a:
            out.append(f"only in A: {', '.join(self.only_a[:8])}"
                       f"{' ...' if len(self.only_a) > 8 else ''}")
        if self.only_b:
            out.append(f"only in B: {', '.join(self.only_b[:8])}"
                       f"{' ...' if len(self.only_b) > 8 else ''}")
        fb = self.first_bad
        out.append("FIRST_DIVERGENT_LAYER: " + (fb.key if fb else "none")
                   + f" (min_cosine={self.min_cosine})")
        if self.topk:
            t = self.topk
            mean = sum(t.overlap) / len(t.overlap) if t.overlap else float("nan")
            out.append(f"TOPK: steps={t.steps} k={t.k} mean_overlap={mean:.3f} "
                       f"step0_overlap={t.overlap[0] if t.overlap else 'n/a'} "
                       f"argmax_agree={sum(t.argmax_agree)}/{t.steps} "
                       f"first_token_divergence={t.first_token_divergence}")
        td = self.token_divergence
        if td is None:
            out.append("FIRST_DIVERGENT_TOKEN: unknown (tokens missing)")
        elif td[0] is None:
            out.append("FIRST_DIVERGENT_TOKEN: none")
        else:
            out.append(f"FIRST_DIVERGENT_TOKEN: step {td[0]}: A={td[1]} B={td[2]}")
        for p in self.problems:
            out.append(f"COMPARE_PROBLEM: {p}")
        out.append(f"COMPARE_VERDICT: {'MATCH' if self.ok else 'DIVERGED'}")
        return "\n".join(out)

    def to_dict(self) -> dict:
        return {
            "hidden": [asdict(d) for d in self.hidden],
            "only_a": self.only_a, "only_b": self.only_b,
            "topk": asdict(self.topk) if self.topk else None,
            "first_bad": self.first_bad.key if self.first_bad else None,
            "token_divergence": self.token_divergence,
            "problems": self.problems,
            "ok": self.ok, "min_cosine": self.min_cosine,
        }


def compare_dumps(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor],
                  min_cosine: float = 0.99) -> CompareReport:
    hidden, only_a, only_b = compare_hidden(a, b)
    tokens = (first_token_divergence(a, b) if "tokens" in a and "tokens" in b
              else None)
    return CompareReport(hidden, only_a, only_b, compare_topk(a, b), min_cosine,
                         tokens)


def dump_engine_kwargs(a: argparse.Namespace) -> dict:
    """LLM(...) arguments of ``dump``. Eager by default: under CUDA/HIP graphs a replayed
    decode step runs no Python, so the layer hooks would record prefill only."""
    probe_args = build_parser().parse_args(
        ["--model", a.model, "--tp", str(a.tp), "--pp", str(a.pp),
         "--max-model-len", str(a.max_model_len),
         "--kv-cache-dtype", a.kv_cache_dtype,
         "--enforce-eager" if a.enforce_eager else "--no-enforce-eager"]
        + [f"--engine-arg={x}" for x in a.engine_arg])
    return engine_kwargs(probe_args)


def dump_with_vllm(a: argparse.Namespace) -> int:
    """Run one greedy chat request with hooks armed and write a dump."""
    import os

    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(**dump_engine_kwargs(a))
    messages = [{"role": "user", "content": a.prompt}]
    tok = llm.get_tokenizer()
    try:
        prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=True)
        if isinstance(prompt_ids, Mapping):
            prompt_ids = prompt_ids["input_ids"]
        n_prompt: int | None = len(prompt_ids)
    except Exception as e:  # custom tokenizers: record the first armed call
        print(f"compare dump: prompt length unknown ({e}); recording the first "
              "call after arming")
        n_prompt = None
    # prefill plus every decode step but the last (its output is never used)
    hooked = install_in_vllm(llm, match_num_tokens=n_prompt,
                             decode_steps=max(0, a.max_tokens - 1))
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0,
                        ignore_eos=True, logprobs=a.topk)
    out = llm.chat([messages], sp, use_tqdm=False)[0].outputs[0]
    hidden = collect_from_vllm(llm)
    ids, lps = topk_from_vllm_logprobs(out.logprobs, a.topk)
    save_dump(a.out, hidden, ids, lps, torch.tensor(list(out.token_ids)),
              {"model": a.model, "prompt": a.prompt, "prompt_tokens": n_prompt,
               "hooked_layers_per_worker": hooked, "tp": a.tp, "pp": a.pp})
    print(f"DUMP_WRITTEN: {a.out} ({len(hidden)} hidden tensors, "
          f"{ids.shape[0]} steps x top-{a.topk})")
    return 0 if hidden else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dcu_kit.compare",
                                description="dump / compare per-layer hidden "
                                "states and top-k logits (seed 15.3)")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("diff", help="compare two dumps")
    d.add_argument("a", help="dump A (e.g. gfx936 run)")
    d.add_argument("b", help="dump B (e.g. reference run)")
    d.add_argument("--min-cosine", type=float, default=0.99)
    d.add_argument("--json", action="store_true")
    w = sub.add_parser("dump", help="run vLLM once with hooks, write a dump")
    w.add_argument("--model", required=True)
    w.add_argument("--out", required=True)
    w.add_argument("--tp", type=int, default=8)
    w.add_argument("--pp", type=int, default=1)
    w.add_argument("--max-model-len", type=int, default=512)
    w.add_argument("--kv-cache-dtype", default="fp8")
    w.add_argument("--prompt", default=DEFAULT_PROMPT)
    w.add_argument("--max-tokens", type=int, default=32)
    w.add_argument("--topk", type=int, default=20)
    w.add_argument("--engine-arg", action="append", default=[])
    w.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True,
                   help="eager engine (default): graph replay skips the hooks on decode "
                        "steps; --no-enforce-eager leaves the mode to the engine (gfx936: "
                        "VLLM_GFX936_GRAPH_MODE, eager by default)")
    args = p.parse_args(argv)
    if args.cmd == "dump":
        return dump_with_vllm(args)
    rep = compare_dumps(load_dump(args.a), load_dump(args.b), args.min_cosine)
    if args.json:
        print(json.dumps(rep.to_dict(), indent=1, default=str))
    else:
        print(rep.format())
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
