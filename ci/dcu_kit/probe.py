# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Staged end-to-end probe: one chat request, greedy, verdict on token ids.

Stages (each prints ``### STAGE: <name>`` first, so a raw log shows how far a
run got; field report section 5):

  env                     python/torch/device/env switches
  config                  model config.json, quantization, shard count
  vllm import + registry  vllm version, architecture registered, applied
                          gfx936 patches (``vllm.gfx936`` if present)
  device check            the devices torch sees cover TP x PP (fails in
                          seconds instead of after weight loading)
  engine init             ``LLM(...)``; prints ``ENGINE_READY in <s>s``
  engine checks           what the seed checked by eye, asked of every worker:
                          the KV cache really is ``fp8_ds_mla`` (DeepSeek V4)
                          and the MoE backend is the expected one
                          (``--expect-moe-backend``, default: ``--moe-backend``
                          or ``emulation``, gfx936's default for MXFP4)
  generate                ``llm.chat`` greedy, ``ignore_eos``, then
                          TOKEN_IDS, FINISH_REASON, TOKEN_DECODE, OUTPUT_REPR,
                          OUTPUT, DSV4_VERDICT (+ per-rule report)

Exit codes: 0 coherent; 1 a stage raised (``PROBE_FAILED_STAGE:`` names it);
2 the verdict is not coherent. A Slurm job must ``exit`` with this code
(``rc=$?; ...; exit $rc``) so scheduler state, exit code and verdict agree.

Seed lessons built in: use the chat template (J11), ``max_tokens >= 32``
because the first token comes from prefill and the bug lived in decode
(J08/J11/J13), ``ignore_eos`` so a short answer is a failure, and verdict on
token ids (special tokens vanish from text, 6.5).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from typing import Any

from dcu_kit.verdict import (
    Verdict,
    filler_ids_from_tokenizer,
    judge,
    special_ids_from_tokenizer,
    verdict_input,
)

DEFAULT_PROMPT = "你好，请介绍一下你自己。"
MIN_MAX_TOKENS = 32
ENV_PREFIXES = ("VLLM_", "DSV4_", "HIP_", "ROCR_", "CUDA_VISIBLE", "HSA_",
                "TRITON_", "TORCHINDUCTOR_", "NCCL_", "RCCL_", "HF_", "SLURM_JOB")

STAGE_ENV = "env"
STAGE_CONFIG = "config"
STAGE_REGISTRY = "vllm import + registry"
STAGE_DEVICES = "device check"
STAGE_ENGINE = "engine init"
STAGE_CHECKS = "engine checks"
DEFAULT_EXPECTED_MOE_BACKEND = "emulation"
STAGE_GENERATE = "generate"


class StageFailed(Exception):
    def __init__(self, stage: str):
        super().__init__(stage)
        self.stage = stage


@contextlib.contextmanager
def stage(name: str, out=None) -> Iterator[None]:
    out = out or sys.stdout
    print(f"### STAGE: {name}", file=out, flush=True)
    try:
        yield
    except Exception as e:
        traceback.print_exc()
        print(f"PROBE_FAILED_STAGE: {name}: {type(e).__name__}: {e}",
              file=out, flush=True)
        raise StageFailed(name) from e


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dcu_kit.probe", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", required=True, help="model directory")
    p.add_argument("--tp", type=int, default=8, help="tensor_parallel_size")
    p.add_argument("--pp", type=int, default=1, help="pipeline_parallel_size")
    # Engine settings default to None = not passed: the engine's own default,
    # what a bare `vllm serve <model>` gets (issue #17).
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: the model's own length")
    p.add_argument("--kv-cache-dtype", default=None,
                   help="default: the engine's (DeepSeek V4 on gfx936: fp8_ds_mla)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--max-tokens", type=int, default=MIN_MAX_TOKENS,
                   help=f">= {MIN_MAX_TOKENS}")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--history", default=None,
                   help="JSON list of earlier chat messages (multi-turn)")
    p.add_argument("--warmup-prompt", default=None,
                   help="chat sent (and judged) before the main prompt, e.g. to "
                        "fill the prefix cache for an A/B run")
    p.add_argument("--prefix-caching", choices=("default", "on", "off"),
                   default="default")
    p.add_argument("--moe-backend", default=None,
                   help="passed as LLM(moe_backend=...) when given")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction,
                   default=None)
    p.add_argument("--trust-remote-code", action=argparse.BooleanOptionalAction,
                   default=None)
    p.add_argument("--distributed-executor-backend", default=None)
    p.add_argument("--logprobs", type=int, default=0,
                   help="top logprobs per token for the finite check; -1 = off")
    p.add_argument("--engine-arg", action="append", default=[],
                   metavar="KEY=JSON", help="extra LLM(...) kwarg, repeatable")
    p.add_argument("--json-out", default=None, help="write results as JSON")
    p.add_argument("--expect-moe-backend", default=None,
                   help="MoE backend the engine must resolve (default: "
                        f"--moe-backend, else {DEFAULT_EXPECTED_MOE_BACKEND}); "
                        "'any' skips the check")
    p.add_argument("--max-identical-run", type=int, default=None)
    p.add_argument("--min-distinct", type=int, default=None)
    return p


def engine_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        model=a.model,
        tensor_parallel_size=a.tp,
        pipeline_parallel_size=a.pp,
    )
    for key in ("max_model_len", "kv_cache_dtype", "gpu_memory_utilization",
                "enforce_eager", "trust_remote_code"):
        if getattr(a, key) is not None:
            kw[key] = getattr(a, key)
    if a.moe_backend:
        kw["moe_backend"] = a.moe_backend
    if a.distributed_executor_backend:
        kw["distributed_executor_backend"] = a.distributed_executor_backend
    if a.prefix_caching != "default":
        kw["enable_prefix_caching"] = a.prefix_caching == "on"
    for item in a.engine_arg:
        if "=" not in item:
            raise SystemExit(f"--engine-arg {item!r}: expected KEY=JSON")
        k, v = item.split("=", 1)
        try:
            kw[k] = json.loads(v)
        except json.JSONDecodeError:
            kw[k] = v
    return kw


def applied_patches() -> tuple[list[str] | None, str]:
    """Applied gfx936 patch list from the ``vllm.gfx936`` module, if any.

    The fork exposes it; older/other builds don't: returns (None, reason).
    """
    try:
        mod = importlib.import_module("vllm.gfx936")
    except Exception as e:  # absent in plain vLLM
        return None, f"vllm.gfx936 not importable ({type(e).__name__}: {e})"
    for name in ("applied_patches", "APPLIED_PATCHES", "PATCHES", "patches"):
        val = getattr(mod, name, None)
        if val is None:
            continue
        try:
            val = val() if callable(val) else val
            return [str(getattr(x, "name", x)) for x in val], f"vllm.gfx936.{name}"
        except Exception as e:
            return None, f"vllm.gfx936.{name} raised {type(e).__name__}: {e}"
    try:
        r = subprocess.run([sys.executable, "-m", "vllm.gfx936", "info"],
                           capture_output=True, text=True, timeout=120)
        if r.returncode == 0:
            return [ln for ln in r.stdout.splitlines() if ln.strip()], (
                "python -m vllm.gfx936 info")
        return None, f"python -m vllm.gfx936 info exited {r.returncode}"
    except Exception as e:
        return None, f"python -m vllm.gfx936 info failed: {e}"


def stage_env(out=None) -> dict[str, Any]:
    out = out or sys.stdout
    info: dict[str, Any] = {"python": sys.version.split()[0],
                            "host": platform.node()}
    env = {k: v for k, v in sorted(os.environ.items())
           if k.startswith(ENV_PREFIXES)}
    info["env"] = env
    try:
        import torch
        info["torch"] = torch.__version__
        info["hip"] = getattr(torch.version, "hip", None)
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        info["device_count"] = n
        if n:
            props = torch.cuda.get_device_properties(0)
            info["device0"] = props.name
            info["arch"] = getattr(props, "gcnArchName", None)
    except Exception as e:
        info["torch_error"] = f"{type(e).__name__}: {e}"
    for k, v in info.items():
        if k != "env":
            print(f"ENV {k}: {v}", file=out)
    for k, v in env.items():
        print(f"ENV {k}={v}", file=out)
    return info


def stage_config(model: str, out=None) -> dict[str, Any]:
    out = out or sys.stdout
    path = os.path.join(model, "config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    shards = glob.glob(os.path.join(model, "*.safetensors"))
    summary = {
        "architectures": cfg.get("architectures"),
        "model_type": cfg.get("model_type"),
        "num_hidden_layers": cfg.get("num_hidden_layers"),
        "sliding_window": cfg.get("sliding_window"),
        "quantization_config": cfg.get("quantization_config"),
        "num_safetensors_shards": len(shards),
    }
    for k, v in summary.items():
        print(f"CONFIG {k}: {v}", file=out)
    return {"config": cfg, "summary": summary}


def stage_registry(architectures: list[str] | None, out=None) -> dict[str, Any]:
    out = out or sys.stdout
    import vllm
    from vllm import ModelRegistry

    print(f"VLLM_VERSION: {vllm.__version__}", file=out)
    supported = set(ModelRegistry.get_supported_archs())
    for arch in architectures or []:
        ok = arch in supported
        print(f"REGISTRY {arch}: {'registered' if ok else 'MISSING'}", file=out)
        if not ok:
            raise RuntimeError(f"architecture {arch} is not registered in vLLM")
    patches, source = applied_patches()
    if patches is None:
        print(f"GFX936_PATCHES: unavailable ({source})", file=out)
    else:
        print(f"GFX936_PATCHES ({source}): {len(patches)}", file=out)
        for name in patches:
            print(f"  {name}", file=out)
    return {"vllm_version": vllm.__version__, "patches": patches,
            "patches_source": source}


class CheckFailed(RuntimeError):
    pass


def device_check(n_visible: int | None, tp: int, pp: int,
                 executor: str | None) -> str:
    """Raise CheckFailed unless this node sees the TP x PP devices the
    engine will ask for (Ray places ranks on other nodes: not checked)."""
    need = tp * pp
    if executor == "ray":
        return f"visible_devices: {n_visible} here; ray places {need} ranks"
    if n_visible is None or n_visible < need:
        raise CheckFailed(
            f"visible_devices: torch sees {n_visible or 0} devices, TP {tp} x "
            f"PP {pp} needs {need}; check --gres, HIP_VISIBLE_DEVICES/"
            "CUDA_VISIBLE_DEVICES/ROCR_VISIBLE_DEVICES and the DTK torch")
    return f"visible_devices: {n_visible} >= TP {tp} x PP {pp}"


def engine_checks(facts: list[dict[str, Any]], architectures: list[str] | None,
                  expected_moe_backend: str) -> list[str]:
    """Check what each worker reports (``worker_facts``); raise CheckFailed
    naming the worker and the value found."""
    if not facts:
        raise CheckFailed("engine checks: no worker answered")
    dsv4 = any("DeepseekV4" in a for a in architectures or [])
    lines = []
    for rank, f in enumerate(facts):
        kv = f.get("kv_cache_dtype")
        if dsv4 and kv != "fp8_ds_mla":
            raise CheckFailed(
                f"kv_cache_dtype: worker {rank} uses {kv!r}, DeepSeek V4 Sparse "
                "MLA needs the fp8_ds_mla cache (--kv-cache-dtype fp8)")
        moe = f.get("moe_backend")
        if expected_moe_backend != "any" and moe != expected_moe_backend:
            raise CheckFailed(
                f"moe_backend: worker {rank} resolved {moe!r}, expected "
                f"{expected_moe_backend!r} (--expect-moe-backend, 'any' to skip)")
    kvs = sorted({str(f.get("kv_cache_dtype")) for f in facts})
    moes = sorted({str(f.get("moe_backend")) for f in facts})
    lines.append(f"kv_cache_dtype: {', '.join(kvs)} on {len(facts)} workers")
    lines.append(f"moe_backend: {', '.join(moes)} on {len(facts)} workers")
    return lines


def worker_facts(worker: Any) -> dict[str, Any]:
    """Run inside each worker (``LLM.collective_rpc``): the resolved config."""
    cfg = worker.vllm_config
    kernel = getattr(cfg, "kernel_config", None)
    return {"kv_cache_dtype": cfg.cache_config.cache_dtype,
            "moe_backend": str(getattr(kernel, "moe_backend", None))}


def _messages(prompt: str, history: list[dict] | None) -> list[dict]:
    return list(history or []) + [{"role": "user", "content": prompt}]


def run_chat(llm: Any, messages: list[dict], max_tokens: int, logprobs: int):
    from vllm import SamplingParams

    sp = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        logprobs=None if logprobs < 0 else logprobs,
    )
    return llm.chat([messages], sp, use_tqdm=False)[0]


def report_generation(
    output: Any,
    tokenizer: Any,
    max_tokens: int,
    out=None,
    judge_kwargs: dict[str, Any] | None = None,
    tag: str = "",
) -> tuple[Verdict, dict[str, Any]]:
    """Print the generation markers for one vLLM ``RequestOutput`` and judge.

    Works with anything shaped like RequestOutput (``.outputs[0]`` having
    ``token_ids``, ``text``, ``finish_reason``, ``logprobs``) so it is
    testable without vLLM.
    """
    out = out or sys.stdout
    comp = output.outputs[0]
    ids = [int(t) for t in comp.token_ids]
    pieces = []
    for t in ids:
        try:
            pieces.append(tokenizer.decode([t], skip_special_tokens=False))
        except Exception as e:  # keep going: the ids are the evidence
            pieces.append(f"<decode error {type(e).__name__}>")
    specials = special_ids_from_tokenizer(tokenizer)
    vocab = None
    with contextlib.suppress(Exception):
        vocab = len(tokenizer)
    eos = getattr(tokenizer, "eos_token_id", None)
    eos_ids = sorted({eos} if isinstance(eos, int) else set(eos or ()))
    kw = dict(special_ids=specials, eos_ids=eos_ids,
              filler_ids=filler_ids_from_tokenizer(tokenizer),
              requested_max_tokens=max_tokens,
              finish_reason=comp.finish_reason, vocab_size=vocab,
              **(judge_kwargs or {}))
    v = judge(ids, logprobs=comp.logprobs, text=comp.text, **kw)
    p = tag
    print(f"{p}TOKEN_IDS: {ids}", file=out)
    print(f"{p}VERDICT_INPUT: {verdict_input(**kw)}", file=out)
    print(f"{p}FINISH_REASON: {comp.finish_reason}", file=out)
    print(f"{p}TOKEN_DECODE: {pieces!r}", file=out)
    print(f"{p}OUTPUT_REPR: {comp.text!r}", file=out)
    print(f"{p}OUTPUT: {comp.text}", file=out)
    for line in v.report().splitlines():
        print(f"{p}{line}", file=out)
    out.flush()
    result = {
        "token_ids": ids,
        "finish_reason": comp.finish_reason,
        "token_decode": pieces,
        "text": comp.text,
        "verdict": v.to_dict(),
    }
    return v, result


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    # engine checks send worker_facts to the workers (collective_rpc pickles
    # the function in V1)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    if a.max_tokens < MIN_MAX_TOKENS:
        print(f"probe: --max-tokens={a.max_tokens} < {MIN_MAX_TOKENS}: the first "
              "token comes from prefill; decode bugs need a long run (seed J08)",
              file=sys.stderr)
        return 2
    history = json.loads(a.history) if a.history else None
    judge_kw = {}
    if a.max_identical_run is not None:
        judge_kw["max_identical_run"] = a.max_identical_run
    if a.min_distinct is not None:
        judge_kw["min_distinct"] = a.min_distinct
    results: dict[str, Any] = {"args": vars(a)}
    rc = 1
    try:
        with stage(STAGE_ENV):
            results["env"] = stage_env()
        with stage(STAGE_CONFIG):
            cfg = stage_config(a.model)
            results["config"] = cfg["summary"]
        with stage(STAGE_REGISTRY):
            results["registry"] = stage_registry(cfg["summary"]["architectures"])
        with stage(STAGE_DEVICES):
            line = device_check(results["env"].get("device_count"), a.tp, a.pp,
                                a.distributed_executor_backend)
            print(f"CHECK {line}", flush=True)
        with stage(STAGE_ENGINE + " (the real test)"):
            from vllm import LLM

            kw = engine_kwargs(a)
            print(f"LLM kwargs: {kw}", flush=True)
            t0 = time.perf_counter()
            llm = LLM(**kw)
            ready = time.perf_counter() - t0
            print(f"ENGINE_READY in {ready:.1f}s", flush=True)
            results["engine_ready_s"] = ready
        with stage(STAGE_CHECKS):
            expected = a.expect_moe_backend or a.moe_backend or (
                DEFAULT_EXPECTED_MOE_BACKEND)
            facts = llm.collective_rpc(worker_facts)
            results["worker_facts"] = facts
            for line in engine_checks(facts, cfg["summary"]["architectures"],
                                      expected):
                print(f"CHECK {line}", flush=True)
        with stage(STAGE_GENERATE):
            tok = llm.get_tokenizer()
            verdicts = []
            if a.warmup_prompt:
                o = run_chat(llm, _messages(a.warmup_prompt, None), a.max_tokens,
                             a.logprobs)
                wv, results["warmup"] = report_generation(
                    o, tok, a.max_tokens, judge_kwargs=judge_kw, tag="WARMUP_")
                verdicts.append(wv)
            t0 = time.perf_counter()
            o = run_chat(llm, _messages(a.prompt, history), a.max_tokens,
                         a.logprobs)
            results["generate_s"] = time.perf_counter() - t0
            v, results["main"] = report_generation(o, tok, a.max_tokens,
                                                   judge_kwargs=judge_kw)
            verdicts.append(v)
            rc = 0 if all(x.coherent for x in verdicts) else 2
    except StageFailed as e:
        results["failed_stage"] = e.stage
        rc = 1
    finally:
        results["rc"] = rc
        if a.json_out:
            with open(a.json_out, "w", encoding="utf-8") as f:
                json.dump(results, f, ensure_ascii=False, indent=1, default=str)
    print(f"PROBE_EXIT={rc}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
