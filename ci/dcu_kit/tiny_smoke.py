# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One-DCU smoke run: the project's trained tiny DeepSeek V4 through the real engine, its greedy
tokens against the text it learned (issue #17, item 6).

``models/dsv4-tiny-gpl3`` learned the GPL-3 verbatim (its README; ``corpus.json`` holds the token
stream and the paragraph starts). Greedy decoding from BOS + a passage prefix continues the
passage, so the corpus *is* the expected ids: no oracle, no second machine. The prompts start at
fixed paragraphs and are longer than the 128-token window and the C128 compressor ratio, so
prefill and decode pass the sliding window, the C4 and C128 compressors, the indexer, the sparse
MLA decode, the block-FP8 linears and the MXFP4 experts.

``--kernels force`` (the Slurm job) sets ``VLLM_GFX936_W8A16_IMPL=kernel``,
``VLLM_GFX936_MXFP4_MOE_IMPL=kernel`` and ``VLLM_GFX936_SPARSE_DECODE=kernel`` before vLLM is
imported: a kernel library that is missing or built for another arch stops the run with the
switch's error instead of falling back to PyTorch. ``--kernels auto`` (the CPU test) leaves them.

Output lines: ``TINY_PROMPT p=<para> len=<n>``, ``TINY_EXPECTED p=.. ids=[..]``,
``TINY_GOT p=.. ids=[..]``, ``TINY_MISMATCH p=.. at=<step> want=<id> got=<id>``, then
``TINY_SMOKE_VERDICT: MATCH`` (exit 0) or ``MISMATCH (k/n prompts)`` (exit 2); an error is exit 1.
``rejudge RAW`` reads the ``TINY_GOT`` lines of a raw log and compares them with the corpus again
(the Slurm job does not trust the verdict word alone): ``TINY_REJUDGE_RESULT: MATCH`` exit 0,
``MISMATCH`` exit 2 (also a prompt with no ``TINY_GOT`` line), no ``TINY_GOT`` at all exit 4.
A ``--model`` without ``corpus.json`` is ``TINY_SMOKE_ERROR: ... corpus.json not found`` exit 64
(the job's KIT_RC_USAGE).

CLI:
    python -m dcu_kit.tiny_smoke run --model models/dsv4-tiny-gpl3 [--kernels force|auto]
        [--paras 0,8,16,...] [--prefix-len 200] [--max-tokens 32] [--engine-arg K=V ...]
    python -m dcu_kit.tiny_smoke rejudge RAW --model models/dsv4-tiny-gpl3 [same prompt flags]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

BOS = 0
# 16 prompts, so decode steps carry up to 16 tokens: the dense linears' GEMV up to its eager limit
# (16) and the MoE kernels past their 4-token fold run, not only the batch-1..4 variants
DEFAULT_PARAS = "0,8,16,24,30,41,48,53,62,70,84,90,99,105,113,115"
DEFAULT_PREFIX_LEN = 200   # > window 128 and > the C128 ratio: every attention path runs
DEFAULT_MAX_TOKENS = 32
FORCE_KERNELS = {"VLLM_GFX936_W8A16_IMPL": "kernel", "VLLM_GFX936_MXFP4_MOE_IMPL": "kernel",
                 "VLLM_GFX936_SPARSE_DECODE": "kernel", "VLLM_GFX936_FUSED_OPS": "triton"}
# What tests/e2e/dsv4_vllm_run.py gives the engine on the CPU, where the gfx936 defaults
# (fp8_ds_mla cache, its block size) are not applied by the platform.
CPU_ENGINE_ARGS = {"kv_cache_dtype": "fp8", "block_size": 256, "enforce_eager": True}


class NoCorpusError(ValueError):
    """The model folder has no corpus.json: it is not the project's tiny model (exit 64)."""


def load_corpus(model: Path) -> dict:
    path = Path(model) / "corpus.json"
    if not path.is_file():
        raise NoCorpusError(f"{path} not found: --model must be the project's tiny model "
                            "(models/dsv4-tiny-gpl3; the Slurm job takes TINY_MODEL_PATH), whose "
                            "corpus.json holds the expected ids")
    return json.loads(path.read_text())


def cases(corpus: dict, paras: list[int], prefix_len: int, max_tokens: int
          ) -> list[tuple[int, list[int], list[int]]]:
    """(para, prompt, expected): prompt = BOS + the ``prefix_len - 1`` corpus tokens from
    paragraph start ``para``, expected = the next ``max_tokens`` corpus tokens. Prompt and
    continuation must lie inside one passage (a passage ends in EOS; what follows it is not
    predictable)."""
    stream, starts, spans = corpus["stream"], corpus["para_starts"], corpus["doc_spans"]
    out = []
    for p in paras:
        if not 0 <= p < len(starts):
            raise ValueError(f"paragraph {p} out of range (0..{len(starts) - 1})")
        s = starts[p]
        e = s + prefix_len - 1 + max_tokens
        span = next(((a, b) for a, b in spans if a <= s < b), None)
        if span is None or e > span[1] - 1:
            raise ValueError(f"paragraph {p}: {prefix_len - 1} + {max_tokens} tokens from {s} "
                             f"run past the end of its passage {span}; pick another paragraph "
                             f"or shorter lengths")
        out.append((p, [BOS] + stream[s:s + prefix_len - 1], stream[s + prefix_len - 1:e]))
    return out


def compare(expected: list[int], got: list[int]) -> int | None:
    """The first step where ``got`` differs from ``expected`` (a short answer differs at its
    end); None when equal."""
    for i, w in enumerate(expected):
        if i >= len(got) or got[i] != w:
            return i
    return None if len(got) == len(expected) else len(expected)


def _engine_kwargs(a: argparse.Namespace, on_gpu: bool) -> dict:
    kw: dict = {"model": str(a.model), "seed": 0}
    if not on_gpu:
        kw.update(CPU_ENGINE_ARGS)
    for item in a.engine_arg:
        k, _, v = item.partition("=")
        try:
            kw[k] = json.loads(v)
        except ValueError:
            kw[k] = v
    return kw


def run(a: argparse.Namespace) -> int:
    todo = cases(load_corpus(a.model), a.paras, a.prefix_len, a.max_tokens)
    if a.kernels == "force":
        os.environ.update(FORCE_KERNELS)
    print("TINY_KERNELS: " + " ".join(f"{k}={os.environ.get(k, 'auto')}" for k in FORCE_KERNELS),
          flush=True)
    import torch

    on_gpu = torch.cuda.is_available()
    if a.kernels == "force" and not on_gpu:
        print("TINY_SMOKE_ERROR: --kernels force needs a GPU (torch sees none)", flush=True)
        return 1
    from vllm import LLM, SamplingParams

    kw = _engine_kwargs(a, on_gpu)
    print(f"TINY_ENGINE_ARGS: {json.dumps(kw, sort_keys=True)}", flush=True)
    t0 = time.time()
    llm = LLM(**kw)
    print(f"ENGINE_READY in {time.time() - t0:.1f}s", flush=True)
    sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    for p, prompt, want in todo:
        print(f"TINY_PROMPT p={p} len={len(prompt)}")
        print(f"TINY_EXPECTED p={p} ids={json.dumps(want)}")
    t1 = time.time()
    outs = llm.generate([{"prompt_token_ids": pr} for _, pr, _ in todo], sp, use_tqdm=False)
    print(f"TINY_GENERATE {len(todo)} prompts x {a.max_tokens} tokens in {time.time() - t1:.1f}s")
    got = {p: list(o.outputs[0].token_ids) for (p, _, _), o in zip(todo, outs)}
    for p in got:
        print(f"TINY_GOT p={p} ids={json.dumps(got[p])}")
    return verdict(todo, got)


def verdict(todo, got: dict[int, list[int]], word: str = "TINY_SMOKE_VERDICT") -> int:
    bad = 0
    for p, _, want in todo:
        ids = got.get(p)
        at = 0 if ids is None else compare(want, ids)
        if at is not None:
            bad += 1
            g = "missing" if ids is None or at >= len(ids) else ids[at]
            w = want[at] if at < len(want) else "end"
            print(f"TINY_MISMATCH p={p} at={at} want={w} got={g}")
    if bad:
        print(f"{word}: MISMATCH ({bad}/{len(todo)} prompts differ from the corpus)", flush=True)
        return 2
    print(f"{word}: MATCH ({len(todo)} prompts x {len(todo[0][2])} tokens = the corpus)",
          flush=True)
    return 0


def rejudge(a: argparse.Namespace) -> int:
    todo = cases(load_corpus(a.model), a.paras, a.prefix_len, a.max_tokens)
    got: dict[int, list[int]] = {}
    try:
        text = Path(a.raw).read_text(errors="replace")
    except OSError as e:
        print(f"TINY_REJUDGE_RESULT: NO_TOKENS (cannot read {a.raw}: {e})")
        return 4
    for m in re.finditer(r"^TINY_GOT p=(\d+) ids=(\[[\d, ]*\])\s*$", text, re.M):
        got[int(m.group(1))] = json.loads(m.group(2))
    if not got:
        print("TINY_REJUDGE_RESULT: NO_TOKENS (no TINY_GOT line in the log)")
        return 4
    return verdict(todo, got, word="TINY_REJUDGE_RESULT")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dcu_kit.tiny_smoke",
                                description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the engine run")
    j = sub.add_parser("rejudge", help="compare a raw log's TINY_GOT lines with the corpus")
    j.add_argument("raw")
    for q in (r, j):
        q.add_argument("--model", type=Path, required=True)
        q.add_argument("--paras", type=lambda s: [int(x) for x in s.split(",")],
                       default=DEFAULT_PARAS, help=f"paragraph starts (default {DEFAULT_PARAS})")
        q.add_argument("--prefix-len", type=int, default=DEFAULT_PREFIX_LEN)
        q.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    r.add_argument("--kernels", choices=("force", "auto"), default="force")
    r.add_argument("--engine-arg", action="append", default=[], metavar="K=V",
                   help="extra LLM(...) argument (JSON value or string), e.g. max_model_len=1024")
    a = p.parse_args(argv)
    if isinstance(a.paras, str):
        a.paras = [int(x) for x in a.paras.split(",")]
    try:
        return run(a) if a.cmd == "run" else rejudge(a)
    except ValueError as e:
        print(f"TINY_SMOKE_ERROR: {e}", flush=True)
        return 64 if a.cmd == "rejudge" or isinstance(e, NoCorpusError) else 1


if __name__ == "__main__":
    sys.exit(main())
