# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Independent reference WRITER of the ``fp8_ds_mla`` KV cache (test utility).

Written from the address formulas and quantization of
``csrc/libtorch_stable/fused_deepseek_v4_qnorm_rope_kv_insert_kernel.cu``
(KV branch), not from the product reader, so tests can check the reader
against it. Imports only torch; runs on CPU or on a GPU (e.g. to build caches
for H200 benchmarks). Not product code.

Per token (``slot = block * bs + pos``, ``base = block * cache.stride(0)``)::

    base + pos*576 + [0, 448)        e4m3fn(clamp(x * 2**-E_g, +-448))
    base + pos*576 + [448, 576)      bf16 RoPE, little endian
    base + bs*576 + pos*8 + g        E_g + 127          (g = 0..6)
    base + bs*576 + pos*8 + 7        0                  (pad)

    E_g = ceil(log2(max(absmax(x[64g:64g+64]), 1e-4) / 448))   (float32)

where ``x`` is the K row rounded to bf16 first (the writer converts the
input to its scalar type and back before quantizing).
"""

import torch

NOPE_DIM = 448
ROPE_DIM = 64
HEAD_DIM = NOPE_DIM + ROPE_DIM
QUANT_BLOCK = 64
NUM_SCALES = NOPE_DIM // QUANT_BLOCK
TOKEN_DATA_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576
SCALE_BYTES = NUM_SCALES + 1  # 8
TOKEN_BYTES = TOKEN_DATA_BYTES + SCALE_BYTES  # 584
FP8_MAX = 448.0

# The block stride the seed observed on gfx936 (bytes), for 37,376 used bytes.
SEED_BLOCK_STRIDE = 1002240


def alloc_fp8_ds_mla_cache(
    num_blocks: int,
    block_size: int = 64,
    block_stride: int | None = None,
    storage_offset: int = 0,
    fill: int | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """A ``uint8 [num_blocks, block_size, 584]`` view with the given stride(0).

    The backing buffer is larger than the view (``block_stride`` bytes per
    block, ``storage_offset`` bytes before block 0) and is filled with random
    bytes (or ``fill``) so that reading the wrong bytes shows.
    """
    block_bytes = block_size * TOKEN_BYTES
    if block_stride is None:
        block_stride = block_bytes
    if block_stride < block_bytes:
        raise ValueError(f"block_stride={block_stride} < block bytes {block_bytes}")
    total = storage_offset + (num_blocks - 1) * block_stride + block_bytes
    if fill is None:
        gen = torch.Generator().manual_seed(seed)
        flat = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=gen)
        flat = flat.to(device)
    else:
        flat = torch.full((total,), fill, dtype=torch.uint8, device=device)
    return flat.as_strided(
        (num_blocks, block_size, TOKEN_BYTES),
        (block_stride, TOKEN_BYTES, 1),
        storage_offset,
    )


def quantize_fp8_ds_mla_tokens(
    k: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K rows ``[n, 512]`` -> (nope e4m3 bytes [n,448], rope bytes [n,128],
    scale bytes [n,8]) exactly as the C++ KV branch computes them."""
    if k.ndim != 2 or k.shape[1] != HEAD_DIM:
        raise ValueError(f"k must be [n, {HEAD_DIM}], got {tuple(k.shape)}")
    x = k.to(torch.bfloat16).to(torch.float32)  # Converter round trip
    nope = x[:, :NOPE_DIM].reshape(-1, NUM_SCALES, QUANT_BLOCK)
    absmax = nope.abs().amax(dim=-1).clamp_min(1e-4)  # fmaxf(.., 1e-4f)
    exponent = torch.ceil(torch.log2(absmax / FP8_MAX))  # float32 like ceilf/log2f
    inv_scale = torch.exp2(-exponent)
    scaled = (nope * inv_scale[..., None]).clamp(-FP8_MAX, FP8_MAX)
    nope_bytes = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    nope_bytes = nope_bytes.reshape(-1, NOPE_DIM)
    encoded = (exponent + 127.0).clamp(0.0, 255.0).to(torch.uint8)
    pad = torch.zeros(encoded.shape[0], 1, dtype=torch.uint8, device=k.device)
    scale_bytes = torch.cat([encoded, pad], dim=1)
    rope_bytes = k[:, NOPE_DIM:].to(torch.bfloat16).contiguous().view(torch.uint8)
    return nope_bytes, rope_bytes, scale_bytes


def write_fp8_ds_mla(
    cache: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Insert K rows ``[n, 512]`` at ``slot_mapping [n]`` (``-1`` skipped).

    Addresses are computed in absolute bytes of the cache's storage from
    ``cache.storage_offset()`` and ``cache.stride(0)``, like the C++ writer's
    ``k_cache + block_idx * kv_block_stride``.
    """
    if cache.dtype != torch.uint8 or cache.ndim != 3 or cache.shape[2] != TOKEN_BYTES:
        raise ValueError(
            f"cache must be uint8 [blocks, bs, {TOKEN_BYTES}], got "
            f"{cache.dtype} {tuple(cache.shape)}"
        )
    block_size = cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].to(torch.int64)
    nope_b, rope_b, scale_b = quantize_fp8_ds_mla_tokens(k[keep.to(k.device)])
    storage = cache.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=cache.device).set_(
        storage, 0, (storage.nbytes(),), (1,)
    )
    block = slots // block_size
    pos = slots % block_size
    block_base = cache.storage_offset() + block * cache.stride(0)
    data_addr = (
        block_base[:, None]
        + pos[:, None] * TOKEN_DATA_BYTES
        + torch.arange(TOKEN_DATA_BYTES, device=cache.device)
    )
    scale_addr = (
        block_base[:, None]
        + block_size * TOKEN_DATA_BYTES
        + pos[:, None] * SCALE_BYTES
        + torch.arange(SCALE_BYTES, device=cache.device)
    )
    flat[data_addr] = torch.cat([nope_b, rope_b], dim=1)
    flat[scale_addr] = scale_b


def dequantize_written_k(k: torch.Tensor) -> torch.Tensor:
    """float64 K ``[n, 512]`` that :func:`write_fp8_ds_mla` stores for ``k``.

    Uses torch's own ``float8_e4m3fn`` and bf16 dtypes (software on CPU), so
    it is independent of the product's bit-level decoder.
    """
    nope_b, rope_b, scale_b = quantize_fp8_ds_mla_tokens(k)
    nope = nope_b.view(torch.float8_e4m3fn).to(torch.float64)
    scale = torch.pow(2.0, scale_b[:, :NUM_SCALES].to(torch.float64) - 127.0)
    nope = nope * scale.repeat_interleave(QUANT_BLOCK, dim=1)
    rope = rope_b.view(torch.bfloat16).to(torch.float64)
    return torch.cat([nope, rope], dim=1)


def random_fp8_ds_mla_cache(
    num_tokens: int,
    num_blocks: int | None = None,
    block_size: int = 64,
    block_stride: int | None = SEED_BLOCK_STRIDE,
    nope_absmax: tuple[float, float] = (0.5, 1.6),
    rope_absmax: float = 5.75,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random written cache: returns ``(cache, k [n,512] float32, slots [n])``.

    Tokens go to distinct random slots. Each 64-element NoPE group gets an
    absmax drawn from ``nope_absmax``; the defaults give the seed's
    magnitudes (scale bytes 118/119, RoPE up to ~5.75).
    """
    if num_blocks is None:
        num_blocks = max(1, -(-2 * num_tokens // block_size))
    if num_tokens > num_blocks * block_size:
        raise ValueError(f"{num_tokens} tokens do not fit {num_blocks} blocks")
    gen = torch.Generator().manual_seed(seed)
    lo, hi = nope_absmax
    group_absmax = lo + (hi - lo) * torch.rand(num_tokens, NUM_SCALES, generator=gen)
    nope = torch.rand(num_tokens, NOPE_DIM, generator=gen) * 2 - 1
    nope = nope * group_absmax.repeat_interleave(QUANT_BLOCK, dim=1)
    rope = (torch.rand(num_tokens, ROPE_DIM, generator=gen) * 2 - 1) * rope_absmax
    k = torch.cat([nope, rope], dim=1)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    cache = alloc_fp8_ds_mla_cache(
        num_blocks,
        block_size,
        block_stride,
        seed=seed + 1,
        device=device,
    )
    k = k.to(device)
    slots = slots.to(device)
    write_fp8_ds_mla(cache, k, slots)
    return cache, k, slots


def swa_only_decode_args(
    q: torch.Tensor,
    cache: torch.Tensor,
    swa_indices: torch.Tensor,
    swa_lens: torch.Tensor,
    output: torch.Tensor,
    *,
    scale: float,
    attn_sink: torch.Tensor | None = None,
    head_dim: int = HEAD_DIM,
    nope_head_dim: int = NOPE_DIM,
    rope_head_dim: int = ROPE_DIM,
) -> dict:
    """Keyword arguments of upstream's ``rocm_sparse_attn_decode`` (and its
    drop-ins) that attend one written cache as the SWA cache alone: dense
    indices, no top-k cache, no ragged indices."""
    return dict(
        q=q,
        kv_cache=None,
        swa_k_cache=cache,
        swa_only=True,
        topk_indices=None,
        topk_lens=None,
        swa_indices=swa_indices,
        swa_lens=swa_lens,
        swa_ragged_indices=None,
        swa_ragged_indptr=None,
        topk_ragged_indices=None,
        topk_ragged_indptr=None,
        attn_sink=attn_sink,
        scale=scale,
        head_dim=head_dim,
        nope_head_dim=nope_head_dim,
        rope_head_dim=rope_head_dim,
        output=output,
    )
