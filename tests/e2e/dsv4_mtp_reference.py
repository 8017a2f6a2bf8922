"""Reference of DeepSeek V4's MTP layer (multi-token prediction), independent of vLLM.

Written from DeepSeek's public reference code, `inference/model.py` of DeepSeek-V4-Flash
(`class MTPBlock(Block)`, `ParallelHead.hc_head`, `Transformer.__init__`'s sharing of embed and
head), as published beside the V4 checkpoints and read in two GitHub copies whose MTP code is the
same text: luogantt/LLM-inference-engine:DeepSeek-V4-Flash/inference/model.py (commit 016f20c0, a
Flash copy with A800 kernels added elsewhere in the file) and
Nicooo-Wang/DeepSeek-V4-Pro-code:inference/model.py (commit 0ec3a03c). There the MTP layer is

    e = enorm(embed(input_ids))                      # embed: the main model's (shared)
    x = hnorm(x)                                     # x: the main model's last hidden streams [b,s,hc,d]
    x = e_proj(e).unsqueeze(2) + h_proj(x)           # one e_proj row broadcast over the hc streams
    x = Block.forward(x, start_pos, input_ids)       # a whole V4 block: mHC + attention + MoE
    logits = head(x, hc_head_fn, hc_head_scale, hc_head_base, norm)
           = head.weight @ norm(hc_head(x))          # head: the main model's (shared)
    hc_head(x) = sum_m (sigmoid(fn(x / rms(x)) * scale + base) + hc_eps)[m] * x[m]

so at position t, fed the main model's hidden streams at t and the token at t + 1, it predicts the
token at t + 2. The MTP-specific parts (input norms, the two projections and how they combine, the
hc head, the shared norm and head) are written here from that code, in float64. The block is
transformers' `DeepseekV4DecoderLayer` (the e2e oracle's implementation of a main-model layer,
tests/e2e/dsv4_oracle.py), instantiated as layer `num_hidden_layers` (sliding-window attention
only: Flash's compress ratio of the MTP layer is 0; top-k MoE), in float64 except where
transformers' modules compute in float32 (RMSNorm and the mHC coefficients: 1e-7 relative, far
below BF16's 4e-3).

Two run-time conventions of vLLM are modelled on request (both documented there):
  mask_position0  vLLM's MTP zeroes the token embedding at position 0 before `enorm`
                  (fused_mtp_input_rmsnorm: "mask inputs at position 0"); DeepSeek's code does not.
  runtime_quant   the MTP layer's SWA KV goes through the fp8_ds_mla cache (the oracle's
                  fp8_ds_mla_nope on the kv_norm output, as for every main-model layer).
Activations are not quantized: the fork's no-FP8 path runs FP8 weights as W8A16 (DeepSeek's
reference quantizes activations per 128 for its FP8 GEMM kernels; vLLM's no-FP8 path does not).

The module is differentiable (tools/dsv4_mtp_train.py trains the tiny model's MTP layer with it, in
float32); weights come by native checkpoint name (`mtp.0.*`, `embed.weight`, `head.weight`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Native names of the MTP layer's own tensors, beside the block's (the oracle's rename table).
MTP_OWN = ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight",
           "hc_head_fn", "hc_head_base", "hc_head_scale")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DeepSeek's RMSNorm: x * rsqrt(mean(x^2) + eps) * w, computed in at least float32."""
    ct = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(ct)
    return (weight.to(ct) * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps))).to(x.dtype)


def hc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
            norm_eps: float, hc_eps: float) -> torch.Tensor:
    """ParallelHead.hc_head: [..., hc, d] -> [..., d], weights sigmoid(mix * scale + base) + eps."""
    ct = torch.promote_types(x.dtype, torch.float32)
    flat = x.flatten(-2).to(ct)
    rsqrt = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    mixes = F.linear(flat, fn.to(ct)) * rsqrt
    pre = torch.sigmoid(mixes * scale.to(ct) + base.to(ct)) + hc_eps
    return (pre.unsqueeze(-1) * x.to(ct)).sum(-2).to(x.dtype)


def _hf_config(cfg: dict):
    """transformers' config with one more layer: the MTP block is layer `num_hidden_layers`."""
    from transformers import DeepseekV4Config

    hf = {k: v for k, v in cfg.items() if k not in ("quantization_config", "expert_dtype")}
    hf["num_hidden_layers"] = cfg["num_hidden_layers"] + 1
    config = DeepseekV4Config(**hf)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return config


def block_state_dict(native: dict, cfg: dict, prefix: str) -> dict:
    """Native `<prefix>` block tensors -> DeepseekV4DecoderLayer names (the oracle's table)."""
    from tests.e2e.dsv4_oracle import _LAYER_RENAMES

    table = dict(_LAYER_RENAMES)
    sd = {}
    for name, t in native.items():
        if not name.startswith(prefix) or ".ffn.experts." in name:
            continue
        rest = name[len(prefix):]
        if rest in MTP_OWN:
            continue
        if rest not in table:
            raise KeyError(f"{name}: no transformers name for this MTP block tensor")
        sd[table[rest]] = t
    ex = range(cfg["n_routed_experts"])
    p = prefix + "ffn.experts"
    sd["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([native[f"{p}.{e}.w1.weight"], native[f"{p}.{e}.w3.weight"]]) for e in ex])
    sd["mlp.experts.down_proj"] = torch.stack([native[f"{p}.{e}.w2.weight"] for e in ex])
    return sd


class MtpReference(nn.Module):
    """The MTP layer `mtp.<j>` of a DeepSeek V4 checkpoint. `forward(ids_next, positions, prev)`:
    ids_next [B, S] (token t + 1 at row t), positions [B, S], prev [B, S, hc, d] (the main model's
    last hidden streams, before its hc head) -> the MTP block's output streams [B, S, hc, d], which
    vLLM's MTP returns too (flattened); `logits(x)` applies the hc head, the norm and the shared
    head. Rows of one batch entry are one causal sequence starting at its first position."""

    def __init__(self, cfg: dict, native: dict, j: int = 0, dtype=torch.float64,
                 mask_position0: bool = True, runtime_quant: bool = True):
        super().__init__()
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
            DeepseekV4DecoderLayer,
            DeepseekV4RotaryEmbedding,
        )

        self.cfg = cfg
        self.eps, self.hc_eps = cfg["rms_norm_eps"], cfg["hc_eps"]
        self.window = cfg["sliding_window"]
        self.mask_position0 = mask_position0
        n = cfg["num_hidden_layers"]
        if cfg["compress_ratios"][n + j] != 0:
            raise ValueError(f"mtp.{j}: compress ratio {cfg['compress_ratios'][n + j]}; this reference "
                             "models the sliding-window-only MTP layer of DeepSeek-V4-Flash (ratio 0)")
        config = _hf_config(cfg)
        torch.manual_seed(0)
        self.block = DeepseekV4DecoderLayer(config, n + j)
        self.rotary = DeepseekV4RotaryEmbedding(config)
        p = f"mtp.{j}."
        sd = {k: v.to(dtype) if v.is_floating_point() else v.long()
              for k, v in block_state_dict(native, cfg, p).items()}
        missing, unexpected = self.block.load_state_dict(sd, strict=False)
        if missing or unexpected:
            raise RuntimeError(f"mtp.{j} does not fit DeepseekV4DecoderLayer: missing {missing}, "
                               f"unexpected {unexpected}")
        self.block.to(dtype)
        d = cfg["hidden_size"]
        self.e_proj = nn.Linear(d, d, bias=False, dtype=dtype)
        self.h_proj = nn.Linear(d, d, bias=False, dtype=dtype)
        with torch.no_grad():
            self.e_proj.weight.copy_(native[p + "e_proj.weight"])
            self.h_proj.weight.copy_(native[p + "h_proj.weight"])
        self.enorm = nn.Parameter(native[p + "enorm.weight"].to(dtype).clone())
        self.hnorm = nn.Parameter(native[p + "hnorm.weight"].to(dtype).clone())
        self.norm = nn.Parameter(native[p + "norm.weight"].to(dtype).clone())
        self.hc_head_fn = nn.Parameter(native[p + "hc_head_fn"].to(dtype).clone())
        self.hc_head_base = nn.Parameter(native[p + "hc_head_base"].to(dtype).clone())
        self.hc_head_scale = nn.Parameter(native[p + "hc_head_scale"].to(dtype).clone())
        # shared with the main model (DeepSeek: mtp.embed = model.embed, mtp.head = model.head)
        self.register_buffer("embed", native["embed.weight"].to(dtype).clone(), persistent=False)
        self.register_buffer("head", native["head.weight"].to(dtype).clone(), persistent=False)
        self._hooks = []
        if runtime_quant:
            from tests.e2e.dsv4_oracle import fp8_ds_mla_nope

            self._hooks.append(self.block.self_attn.kv_norm.register_forward_hook(
                lambda m, a, out: fp8_ds_mla_nope(out)))

    def forward(self, ids_next: torch.Tensor, positions: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        dt = self.e_proj.weight.dtype
        e = F.embedding(ids_next, self.embed)
        if self.mask_position0:
            e = torch.where((positions == 0).unsqueeze(-1), torch.zeros_like(e), e)
        e = rms_norm(e, self.enorm, self.eps)
        x = rms_norm(prev.to(dt), self.hnorm, self.eps)
        x = self.e_proj(e).unsqueeze(-2) + self.h_proj(x)
        pe = {t: self.rotary(x, position_ids=positions, layer_type=t) for t in ("main", "compress")}
        # causal sliding window: query i sees keys j with 0 <= i - j < window (as vLLM's SWA)
        rel = positions[:, :, None] - positions[:, None, :]
        mask = torch.zeros(rel.shape, dtype=dt, device=x.device).masked_fill(
            (rel < 0) | (rel >= self.window), float("-inf"))[:, None]
        return self.block(x, position_embeddings=pe, position_ids=positions, attention_mask=mask,
                          input_ids=ids_next)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        h = hc_head(x, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, self.eps, self.hc_eps)
        return F.linear(rms_norm(h, self.norm, self.eps), self.head)

    def native_state(self, j: int = 0) -> dict:
        """The trained float weights back under their native names (`mtp.<j>.*`), float64."""
        from tests.e2e.dsv4_oracle import _LAYER_RENAMES

        inv = {dst: src for src, dst in _LAYER_RENAMES}
        p, out = f"mtp.{j}.", {}
        inter = self.cfg["moe_intermediate_size"]
        for name, t in self.block.state_dict().items():
            t = t.detach().double().cpu()
            if name == "mlp.experts.gate_up_proj":
                for e in range(t.shape[0]):
                    out[f"{p}ffn.experts.{e}.w1.weight"] = t[e, :inter]
                    out[f"{p}ffn.experts.{e}.w3.weight"] = t[e, inter:]
            elif name == "mlp.experts.down_proj":
                for e in range(t.shape[0]):
                    out[f"{p}ffn.experts.{e}.w2.weight"] = t[e]
            elif name in inv:
                out[p + inv[name]] = t
            elif "inv_freq" not in name:
                raise KeyError(f"block tensor {name}: no native name")
        out[p + "e_proj.weight"] = self.e_proj.weight.detach().double().cpu()
        out[p + "h_proj.weight"] = self.h_proj.weight.detach().double().cpu()
        for k in ("enorm", "hnorm", "norm"):
            out[f"{p}{k}.weight"] = getattr(self, k).detach().double().cpu()
        for k in ("hc_head_fn", "hc_head_base", "hc_head_scale"):
            out[p + k] = getattr(self, k).detach().double().cpu()
        return out

    def to_vllm_dtypes(self) -> "MtpReference":
        """BF16 weights and activations as vLLM runs the layer, float32 where vLLM keeps float32
        (the oracle's VLLM_FP32 list, the hc head): the layer's own BF16 noise floor."""
        from tests.e2e.dsv4_oracle import VLLM_FP32

        self.to(torch.bfloat16)
        for name, t in list(self.named_parameters()) + list(self.named_buffers()):
            if (any(k in name for k in VLLM_FP32) or name.startswith("hc_head")) and t.is_floating_point():
                t.data = t.data.float()
        return self
