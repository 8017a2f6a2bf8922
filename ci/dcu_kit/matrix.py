# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prompt builders for the regression matrix (field report 15.1).

The matrix itself is the pytest suite ``tests/cluster/`` (marked
``cluster``); this module holds the pure parts so they are tested on CPU:
boundary prompt lengths from the model geometry and a prompt padder that
hits an exact templated token count.

DeepSeek V4 geometry (vLLM ``models/deepseek_v4``): KV block 64 tokens
(fp8_ds_mla), ``config.sliding_window`` (SWA, default 128) and per-layer
``config.compress_ratios`` (4 -> C4 indexer layers, 128 -> C128 layers).
Bugs live at the edges: a prompt of 63/64/65 tokens puts the first decode
token at the last slot of a block / the first slot of a new one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

KV_BLOCK_SIZE = 64
DEFAULT_SLIDING_WINDOW = 128
DEFAULT_COMPRESS_RATIOS = (4, 128)

# Eight different prompts: Chinese/English, chat, code, math, list, long
# answer - the seed only ever tested one.
PROMPTS_8 = (
    "你好，请介绍一下你自己。",
    "Explain in three sentences why the sky is blue.",
    "用 Python 写一个函数，判断一个整数是否为素数，并解释思路。",
    "What is 17 * 23? Show the steps.",
    "请列出五种常见的排序算法，并简单比较它们的时间复杂度。",
    "Write a short poem about a lighthouse at night.",
    "把下面这句话翻译成英文：今天天气很好，我们去公园散步吧。",
    "Summarize the plot of Romeo and Juliet for a ten-year-old.",
)


@dataclass(frozen=True)
class Geometry:
    block_size: int = KV_BLOCK_SIZE
    sliding_window: int = DEFAULT_SLIDING_WINDOW
    compress_ratios: tuple[int, ...] = DEFAULT_COMPRESS_RATIOS


def geometry_from_config(cfg: Mapping[str, Any]) -> Geometry:
    sw = cfg.get("sliding_window") or DEFAULT_SLIDING_WINDOW
    ratios = sorted({int(r) for r in cfg.get("compress_ratios") or []
                     if int(r) > 1}) or list(DEFAULT_COMPRESS_RATIOS)
    return Geometry(KV_BLOCK_SIZE, int(sw), tuple(ratios))


def _around(points, lo: int, hi: int) -> list[int]:
    out = set()
    for p in points:
        for d in (-1, 0, 1):
            if lo <= p + d <= hi:
                out.add(p + d)
    return sorted(out)


def boundary_lengths(geo: Geometry, max_model_len: int, gen_tokens: int,
                     min_len: int = 8) -> dict[str, list[int]]:
    """Prompt lengths (templated tokens) around each boundary, such that
    prompt + generation fits in max_model_len. A prompt of length L makes
    the decode steps write positions L, L+1, ... so both "prompt ends at the
    edge" and "decode crosses the edge" are covered."""
    hi = max_model_len - gen_tokens
    if hi < min_len:
        raise ValueError(f"max_model_len={max_model_len} leaves no room for "
                         f"gen_tokens={gen_tokens}")
    b = geo.block_size
    res = {
        "kv_block": _around([b, 2 * b, 4 * b], min_len, hi),
        "swa_window": _around([geo.sliding_window, geo.sliding_window - gen_tokens // 2],
                              min_len, hi),
    }
    for r in geo.compress_ratios:
        pts = [r * k for k in (1, 2, 3)] if r >= 64 else [r * 8, r * 16, r * 33]
        res[f"compress_c{r}"] = _around(pts, min_len, hi)
    return {k: v for k, v in res.items() if v}


def pad_prompt_to_length(
    count_tokens: Callable[[str], int],
    target: int,
    base: str = "请复述下面的文字：",
    fillers: tuple[str, ...] = (" 天", " a", "。", " the", "x"),
    max_units: int = 4096,
) -> tuple[str, int]:
    """Find user text whose *templated* token count equals ``target``.

    ``count_tokens(user_text)`` must return the full prompt length (chat
    template applied), e.g. ``len(tok.apply_chat_template([...], ...))``.
    Binary search over the number of filler units (the count is monotone in
    practice), then a final filler to hit the exact value. Raises ValueError
    naming the target when no filler reaches it.
    """
    n0 = count_tokens(base)
    if n0 > target:
        raise ValueError(f"pad_prompt_to_length: base prompt already has {n0} "
                         f"tokens > target {target}")
    for filler in fillers:
        lo, hi = 0, max_units
        while lo < hi:  # largest n with count <= target
            mid = (lo + hi + 1) // 2
            if count_tokens(base + filler * mid) <= target:
                lo = mid
            else:
                hi = mid - 1
        text = base + filler * lo
        if count_tokens(text) == target:
            return text, target
        for tail in fillers:
            if count_tokens(text + tail) == target:
                return text + tail, target
    raise ValueError(f"pad_prompt_to_length: no filler reaches exactly {target} "
                     "tokens; extend `fillers`")
