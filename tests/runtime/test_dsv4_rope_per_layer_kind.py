"""DeepSeek V4 RoPE per layer kind: plain RoPE on sliding-window-only layers, YaRN on compressed ones.

Guards the bug fixed by patch dsv4-rope-plain-on-swa-layers: upstream's build_deepseek_v4_rope applied
YaRN to the sliding-window-only layers (compress_ratio 0) whenever rope_scaling is set, while
DeepSeek's reference inference/model.py ("disable YaRN and use base rope_theta in pure sliding-window
attention") and transformers use plain RoPE with rope_theta there. The references below are
DeepSeek's precompute_freqs_cis formula written out in float64 here.
"""
import math
from types import SimpleNamespace

import pytest
import torch

from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.models.deepseek_v4.common.rope import build_deepseek_v4_rope as _build

ROPE_DIM, HEAD_DIM = 64, 512
YARN = {"type": "yarn", "rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 256,
        "beta_fast": 32, "beta_slow": 1}


def build_deepseek_v4_rope(*args, **kwargs):
    # RotaryEmbedding is a CustomOp: it reads the current vLLM config when built
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        return _build(*args, **kwargs)


def _config(rope_scaling):
    return SimpleNamespace(rope_parameters=dict(rope_scaling) if rope_scaling else {"rope_type": "default"},
                           rope_theta=10000.0, compress_rope_theta=160000.0)


def _reference_inv_freq(base: float, yarn: dict | None) -> torch.Tensor:
    """DeepSeek V4 reference precompute_freqs_cis (YaRN when original_seq_len > 0), float64."""
    dim = ROPE_DIM
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if yarn:
        orig, factor = yarn["original_max_position_embeddings"], yarn["factor"]

        def corr(rot):
            return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr(yarn["beta_fast"])), 0)
        high = min(math.ceil(corr(yarn["beta_slow"])), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 0.001)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return freqs


def _cos_sin(rope, positions):
    cache = rope.cos_sin_cache[positions].double()
    return cache[:, : ROPE_DIM // 2], cache[:, ROPE_DIM // 2:]


@pytest.mark.parametrize("compress_ratio,base,yarn", [
    (1, 10000.0, None),      # sliding-window-only layer (vLLM clamps ratio 0 to 1): plain RoPE
    (4, 160000.0, YARN),     # C4: YaRN with compress_rope_theta
    (128, 160000.0, YARN),   # C128: YaRN with compress_rope_theta
])
def test_rope_matches_deepseek_reference_per_layer_kind(compress_ratio, base, yarn):
    rope = build_deepseek_v4_rope(_config(YARN), head_dim=HEAD_DIM, rope_head_dim=ROPE_DIM,
                                  max_position_embeddings=4096, compress_ratio=compress_ratio)
    positions = torch.tensor([0, 1, 127, 128, 255, 300, 1000, 4095])
    cos, sin = _cos_sin(rope, positions)
    ang = positions.double()[:, None] * _reference_inv_freq(base, yarn)[None, :]
    # the cache forms position * inv_freq in float32: at angles up to ~4e3 rad that is off by up
    # to ~2.5e-4 rad; a wrong RoPE kind is off by O(1)
    torch.testing.assert_close(cos, ang.cos(), atol=3e-4, rtol=0)
    torch.testing.assert_close(sin, ang.sin(), atol=3e-4, rtol=0)


def test_swa_rope_is_plain_in_both_build_orders():
    """The layer order of the real model (SWA, SWA, C4, C128, ...) and the reverse give the same
    SWA RoPE: building a compressed layer's YaRN RoPE must not leak into a later SWA layer."""
    cfg = _config(YARN)
    kw = dict(head_dim=HEAD_DIM, rope_head_dim=ROPE_DIM, max_position_embeddings=4096)
    first = build_deepseek_v4_rope(cfg, compress_ratio=1, **kw)
    build_deepseek_v4_rope(cfg, compress_ratio=4, **kw)
    later = build_deepseek_v4_rope(cfg, compress_ratio=1, **kw)
    positions = torch.arange(0, 4096, 37)
    torch.testing.assert_close(_cos_sin(first, positions), _cos_sin(later, positions), atol=0, rtol=0)
    ang = positions.double()[:, None] * _reference_inv_freq(10000.0, None)[None, :]
    torch.testing.assert_close(_cos_sin(later, positions)[0], ang.cos(), atol=3e-4, rtol=0)
