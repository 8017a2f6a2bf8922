# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""VLLM_GFX936_SPARSE_VALIDATE: finite checks of the gfx936 Sparse MLA
reference decode (the field report's validation checklist turned into assertions)."""

import pytest
import torch
from fp8_ds_mla_writer import random_fp8_ds_mla_cache, swa_only_decode_args
from torch.utils._python_dispatch import TorchDispatchMode
from vllm.v1.attention.ops.gfx936_sparse_mla_reference import (
    SparseMLAValidationError,
    gather_fp8_ds_mla_bytes,
    sparse_mla_decode_reference,
)

H = 4
SCALE = 512**-0.5
LAYER = "model.layers.7.self_attn"


def _q(b=1):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(b, H, 512, generator=gen) * 0.5).to(torch.bfloat16)


def _cache(seed=0):
    cache, _, slots = random_fp8_ds_mla_cache(32, num_blocks=1, seed=seed)
    return cache, slots[None, :].to(torch.int64)


def _poke(cache, slot, nope_byte=None, rope_bf16=None, scale_byte=None):
    """Overwrite bytes of one slot through the reader's own views' addresses
    (block-packed layout) to poison one value."""
    bs = cache.shape[1]
    flat = cache.as_strided((cache.shape[0], bs * 584), (cache.stride(0), 1))
    blk, pos = slot // bs, slot % bs
    if nope_byte is not None:
        flat[blk, pos * 576 + 3] = nope_byte
    if rope_bf16 is not None:
        t = torch.tensor([rope_bf16], dtype=torch.bfloat16).view(torch.uint8)
        flat[blk, pos * 576 + 448 + 10 : pos * 576 + 448 + 12] = t
    if scale_byte is not None:
        flat[blk, bs * 576 + pos * 8 + 2] = scale_byte


def _run(cache, slots, validate, extra=None, layer_name=LAYER, q=None):
    valid = slots >= 0
    kw = {}
    if extra is not None:
        kw = dict(extra_cache=extra[0], extra_slots=extra[1], extra_valid=extra[1] >= 0)
    return sparse_mla_decode_reference(
        _q() if q is None else q,
        cache,
        slots,
        valid,
        SCALE,
        None,
        validate=validate,
        layer_name=layer_name,
        **kw,
    )


@pytest.mark.parametrize(
    "poison,tensor",
    [
        (dict(nope_byte=0x7F), "k_nope"),
        (dict(rope_bf16=float("inf")), "k_rope"),
        (dict(scale_byte=0xFF), "k_nope"),
    ],
)
def test_poisoned_main_cache_raises_with_layer_stage_tensor(poison, tensor):
    cache, slots = _cache()
    victim = int(slots[0, 5])
    _poke(cache, victim, **poison)
    with pytest.raises(SparseMLAValidationError) as exc:
        _run(cache, slots, validate=True)
    msg = str(exc.value)
    assert LAYER in msg and "'main_cache'" in msg and f"'{tensor}'" in msg
    assert f"slot {victim}" in msg
    # Off: no error, the poison simply reaches the output.
    out = _run(cache, slots, validate=False)
    assert not torch.isfinite(out).all()


def test_poisoned_extra_cache_names_extra_stage():
    cache, slots = _cache(1)
    extra, eslots = _cache(2)
    _poke(extra, int(eslots[0, 0]), nope_byte=0xFF)
    with pytest.raises(SparseMLAValidationError, match="'extra_cache'.*'k_nope'"):
        _run(cache, slots, validate=True, extra=(extra, eslots))


def test_non_finite_logits_are_named_and_huge_finite_logits_pass():
    """K finite but q infinite: logits are not finite -> stage 'attention',
    tensor 'logits'. Huge but finite logits overflow nothing (the softmax is
    shifted by its max), so probs pass their check."""
    cache, slots = _cache(3)
    q = _q()
    q[0, 1, 0] = float("inf")
    with pytest.raises(SparseMLAValidationError, match="'attention'.*'logits'"):
        _run(cache, slots, validate=True, q=q)
    q = _q() * 1e4  # huge but finite logits
    out = _run(cache, slots, validate=True, q=q.to(torch.bfloat16))
    assert torch.isfinite(out).all()


def test_unknown_layer_name_is_said():
    cache, slots = _cache()
    _poke(cache, int(slots[0, 0]), nope_byte=0x7F)
    with pytest.raises(SparseMLAValidationError, match="'<unknown>'"):
        _run(cache, slots, validate=True, layer_name=None)


def test_skipped_slots_are_not_checked():
    """A poisoned slot that is not attended (-1 in its place) passes."""
    cache, slots = _cache()
    _poke(cache, int(slots[0, 0]), nope_byte=0x7F)
    masked = slots.clone()
    masked[0, 0] = -1
    out = _run(cache, masked, validate=True)
    assert torch.isfinite(out).all()


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def test_validation_off_adds_no_ops_and_no_syncs():
    """validate=False runs no isfinite/any/item (no host sync); the same
    call with validate=True does - so the check would see a difference."""
    cache, slots = _cache()
    with _OpLog() as off:
        _run(cache, slots, validate=False)
    with _OpLog() as on:
        _run(cache, slots, validate=True)
    check_ops = {"isfinite", "_local_scalar_dense", "is_nonzero", "nonzero"}
    assert not check_ops & set(off.ops), set(off.ops) & check_ops
    assert check_ops & set(on.ops)
    assert len(on.ops) > len(off.ops)


def test_hook_reads_env_switch_and_passes_layer_name(monkeypatch):
    """Through upstream's rocm_sparse_attn_decode on (faked) gfx936:
    VLLM_GFX936_SPARSE_VALIDATE=1 raises naming the layer; unset, it runs."""
    import vllm.platforms.gfx936 as gfx936
    from vllm.v1.attention.ops import rocm_aiter_mla_sparse as ops

    monkeypatch.setattr(gfx936, "on_gfx936", lambda: True)
    cache, slots = _cache()
    _poke(cache, int(slots[0, 3]), nope_byte=0x7F)
    q = _q()

    def call():
        out = torch.empty(q.shape, dtype=torch.bfloat16)
        ops.rocm_sparse_attn_decode(
            **swa_only_decode_args(
                q,
                cache,
                slots.to(torch.int32),
                torch.tensor([slots.shape[1]], dtype=torch.int32),
                out,
                scale=SCALE,
            ),
            layer_name=LAYER,
        )
        return out

    # The reference lets the poisoned NaN through (no zeroing), which is what it is for.
    monkeypatch.setenv("VLLM_GFX936_SPARSE_DECODE", "reference")
    monkeypatch.delenv("VLLM_GFX936_SPARSE_VALIDATE", raising=False)
    assert not torch.isfinite(call()).all()
    monkeypatch.setenv("VLLM_GFX936_SPARSE_VALIDATE", "1")
    with pytest.raises(SparseMLAValidationError, match=LAYER):
        call()
    # Validation asked for with a fast path chosen: the checks still run (the fast paths have
    # none, so the dispatch takes the reference rather than silently skipping them).
    monkeypatch.setenv("VLLM_GFX936_SPARSE_DECODE", "auto")
    with pytest.raises(SparseMLAValidationError, match=LAYER):
        call()


def test_poke_helper_hits_the_slot_the_reader_reads():
    """Guard for this file's helper: the poked byte is the one the block-
    packed reader returns for that slot."""
    cache, slots = _cache()
    victim = int(slots[0, 2])
    _poke(cache, victim, nope_byte=0x11, scale_byte=0x22)
    data, scales = gather_fp8_ds_mla_bytes(cache, torch.tensor([victim]))
    assert data[0, 3] == 0x11 and scales[0, 2] == 0x22
