"""Independent oracle for DeepSeek V4 on a checkpoint in the native on-disk formats.

transformers' own `DeepseekV4ForCausalLM` (5.25.0, float32, eager, no kernels), fed weights that this
module decodes itself from the checkpoint bytes (FP8 E4M3 + UE8M0 128x128 blocks, MXFP4 E2M1 + UE8M0
per 32, BF16, F32); nothing of vLLM or of the fork is imported. Optionally (on by default) it applies,
through forward hooks, the quantize-dequantize steps vLLM does at run time, re-implemented here from
the formats vLLM writes:

  fp8_ds_mla KV (SWA KV and compressed KV of C4/C128 layers): per token, the 448 NoPE dims rounded to
    BF16, then per 64-dim tile s = 2^ceil(log2(max(amax, 1e-4) / 448)), E4M3 = RNE(clamp(x / s, +-448));
    the 64 RoPE dims stay unquantized here (vLLM stores them as BF16, which this float32 oracle
    does not model).
  Indexer K (C4 layers, 128 dims): after RoPE, BF16, one scale for all 128 dims:
    s = 2^ceil(log2(max(amax, 1e-4) * (1/448))), E4M3 = RNE(clamp(x / s, +-448)).
  Indexer q (per token and head, 128 dims): q rounded to BF16, RoPE on the last 64 dims, those
    rounded to BF16 again, s = 2^ceil(log2(max(amax, 1e-4) / 448)), E4M3 = RNE(x / s).

The oracle always runs the whole sequence in one forward from position 0 without a cache (greedy
decoding recomputes the prefix each step), so a hook knows every position.

CLI (output: a torch.save dict, see `run`):
    python -m tests.e2e.dsv4_oracle --model DIR --ids '[[1, 5, 9], [1, 7]]' --out res.pt \
        [--greedy 8] [--no-quant]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

KV_NOPE, KV_TILE, FP8_MAX = 448, 64, 448.0


# ---- decoders of the on-disk formats --------------------------------------------------------
def _e4m3fn_values() -> torch.Tensor:
    """The 256 E4M3FN codes as float64 from the bit fields: s eeee mmm, bias 7, 0x7f/0xff NaN."""
    vals = []
    for b in range(256):
        s, e, m = b >> 7, (b >> 3) & 0xF, b & 0x7
        if e == 0xF and m == 0x7:
            v = math.nan
        elif e == 0:
            v = m / 8 * 2.0 ** -6
        else:
            v = (1 + m / 8) * 2.0 ** (e - 7)
        vals.append(-v if s else v)
    return torch.tensor(vals, dtype=torch.float64)


E4M3_LUT = _e4m3fn_values()
E2M1_LUT = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6],
                        dtype=torch.float64)


def decode_e8m0(s: torch.Tensor) -> torch.Tensor:
    b = s.view(torch.uint8).to(torch.float64)
    return torch.where(b == 255, torch.full_like(b, math.nan), torch.exp2(b - 127))


def decode_fp8_block(w: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    v = E4M3_LUT[w.view(torch.uint8).long()]
    s = decode_e8m0(scale).repeat_interleave(block, 0).repeat_interleave(block, 1)
    return v * s[: v.shape[0], : v.shape[1]]


def decode_mxfp4(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    u = w.view(torch.uint8).long()
    v = torch.stack([E2M1_LUT[u & 0xF], E2M1_LUT[u >> 4]], dim=-1).flatten(-2)
    return v * decode_e8m0(scale).repeat_interleave(32, -1)


def load_native(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, FP8/MXFP4 pairs decoded to float64 under the `.weight` name."""
    from safetensors.torch import load_file

    raw = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        raw.update(load_file(str(f)))
    out = {}
    for name, t in raw.items():
        if name.endswith(".scale"):
            continue
        sname = name.removesuffix(".weight") + ".scale"
        if name.endswith(".weight") and sname in raw:
            if t.dtype == torch.float8_e4m3fn:
                out[name] = decode_fp8_block(t, raw[sname])
            elif t.dtype in (torch.int8, torch.uint8):
                out[name] = decode_mxfp4(t, raw[sname])
            else:
                raise ValueError(f"{name}: scaled weight of dtype {t.dtype}")
        elif t.is_floating_point():
            out[name] = t.to(torch.float64)
        else:
            out[name] = t
    return out


# ---- native names -> transformers' DeepseekV4ForCausalLM ------------------------------------
_LAYER_RENAMES = [  # (native suffix, transformers suffix), first match wins
    ("attn_norm.weight", "input_layernorm.weight"), ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("hc_attn_fn", "attn_hc.fn"), ("hc_attn_base", "attn_hc.base"), ("hc_attn_scale", "attn_hc.scale"),
    ("hc_ffn_fn", "ffn_hc.fn"), ("hc_ffn_base", "ffn_hc.base"), ("hc_ffn_scale", "ffn_hc.scale"),
    ("attn.attn_sink", "self_attn.sinks"),
    ("attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"),
    ("attn.indexer.compressor.wkv.weight", "self_attn.compressor.indexer.kv_proj.weight"),
    ("attn.indexer.compressor.wgate.weight", "self_attn.compressor.indexer.gate_proj.weight"),
    ("attn.indexer.compressor.norm.weight", "self_attn.compressor.indexer.kv_norm.weight"),
    ("attn.indexer.wq_b.weight", "self_attn.compressor.indexer.q_b_proj.weight"),
    ("attn.indexer.weights_proj.weight", "self_attn.compressor.indexer.scorer.weights_proj.weight"),
    ("attn.compressor.ape", "self_attn.compressor.position_bias"),
    ("attn.compressor.wkv.weight", "self_attn.compressor.kv_proj.weight"),
    ("attn.compressor.wgate.weight", "self_attn.compressor.gate_proj.weight"),
    ("attn.compressor.norm.weight", "self_attn.compressor.kv_norm.weight"),
    ("attn.wq_a.weight", "self_attn.q_a_proj.weight"), ("attn.q_norm.weight", "self_attn.q_a_norm.weight"),
    ("attn.wq_b.weight", "self_attn.q_b_proj.weight"), ("attn.wkv.weight", "self_attn.kv_proj.weight"),
    ("attn.kv_norm.weight", "self_attn.kv_norm.weight"), ("attn.wo_a.weight", "self_attn.o_a_proj.weight"),
    ("attn.wo_b.weight", "self_attn.o_b_proj.weight"),
    ("ffn.gate.weight", "mlp.gate.weight"), ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    ("ffn.gate.tid2eid", "mlp.gate.tid2eid"),
    ("ffn.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight"),
    ("ffn.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight"),
    ("ffn.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight"),
]
_TOP = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
        "norm.weight": "model.norm.weight", "hc_head_fn": "model.hc_head.hc_fn",
        "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale"}


def to_transformers_state_dict(native: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """Rename (and stack the routed experts) for transformers; the MTP layer is dropped (no MTP there)."""
    sd = {}
    for name, t in native.items():
        if name.startswith("mtp.") or ".ffn.experts." in name:
            continue
        if name in _TOP:
            sd[_TOP[name]] = t
            continue
        _, i, rest = name.split(".", 2)
        for src, dst in _LAYER_RENAMES:
            if rest == src:
                sd[f"model.layers.{i}.{dst}"] = t
                break
        else:
            raise KeyError(f"no transformers name for {name}")
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}.ffn.experts"
        ex = range(cfg["n_routed_experts"])
        sd[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([native[f"{p}.{e}.w1.weight"], native[f"{p}.{e}.w3.weight"]]) for e in ex])
        sd[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack([native[f"{p}.{e}.w2.weight"] for e in ex])
    return sd


# ---- run-time quantization vLLM applies (independent re-implementation) ---------------------
E4M3_POS = E4M3_LUT[:127]  # codes 0..126: the finite non-negative values, increasing


def e4m3_rne(x: torch.Tensor) -> torch.Tensor:
    """Nearest E4M3FN value (|x| <= 448), ties to the even code; float64 in and out."""
    a = x.abs().contiguous()
    hi = torch.searchsorted(E4M3_POS, a).clamp(max=126)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - E4M3_POS[lo], E4M3_POS[hi] - a
    code = torch.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
    return torch.copysign(E4M3_POS[code], x)


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def _pow2_scale(amax: torch.Tensor, reciprocal: bool) -> torch.Tensor:
    """2^ceil(log2(max(amax, 1e-4) / 448)), the ratio formed in float32 as the writer does."""
    a = amax.float().clamp_min(1e-4)
    r = a * torch.tensor(1.0 / FP8_MAX, dtype=torch.float32) if reciprocal else a / FP8_MAX
    return torch.exp2(torch.ceil(torch.log2(r))).double()


def fp8_ds_mla_nope(x: torch.Tensor, reciprocal: bool = False) -> torch.Tensor:
    """[..., 512]: NoPE dims -> BF16 -> E4M3 with a UE8M0 scale per 64 dims -> back; RoPE dims kept.
    `reciprocal`: amax * (1/448) as the compressor's Triton writer forms it (the SWA insert divides)."""
    nope = bf16(x[..., :KV_NOPE].float()).double()
    tiles = nope.unflatten(-1, (KV_NOPE // KV_TILE, KV_TILE))
    s = _pow2_scale(tiles.abs().amax(-1, keepdim=True), reciprocal=reciprocal)
    deq = (e4m3_rne((tiles / s).clamp(-FP8_MAX, FP8_MAX)) * s).flatten(-2)
    return torch.cat([deq.to(x.dtype), x[..., KV_NOPE:]], dim=-1)


def fp8_indexer_k(x: torch.Tensor) -> torch.Tensor:
    """[..., 128] post-RoPE -> BF16 -> one power-of-two scale (fp32 in the cache) -> E4M3 -> back."""
    v = bf16(x.float()).double()
    s = _pow2_scale(v.abs().amax(-1, keepdim=True), reciprocal=True)
    return (e4m3_rne((v / s).clamp(-FP8_MAX, FP8_MAX)) * s).to(x.dtype)


def fp8_indexer_q(x: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """[..., 128] post-RoPE q (NoPE part already BF16): RoPE part -> BF16, per-head scale, E4M3, back."""
    v = torch.cat([x[..., :-rope_dim], bf16(x[..., -rope_dim:].float())], dim=-1).double()
    s = _pow2_scale(v.abs().amax(-1, keepdim=True), reciprocal=False)
    return (e4m3_rne(v / s) * s).to(x.dtype)


def _rope(x: torch.Tensor, inv_freq: torch.Tensor, pos: torch.Tensor, sign: float) -> torch.Tensor:
    """Interleaved (GPT-J) rotation of the last 2*len(inv_freq) dims of x[..., pos, :] (float64)."""
    rd = 2 * inv_freq.numel()
    ang = pos.double()[:, None] * inv_freq.double()[None, :] * sign  # [S, rd/2]
    cos, sin = ang.cos(), ang.sin()
    shape = [1] * (x.dim() - 2) + list(cos.shape)
    cos, sin = cos.view(shape), sin.view(shape)
    r = x[..., -rd:].double().unflatten(-1, (-1, 2))
    e, o = r[..., 0], r[..., 1]
    rot = torch.stack([e * cos - o * sin, e * sin + o * cos], dim=-1).flatten(-2)
    return torch.cat([x[..., :-rd].double(), rot], dim=-1)


class RuntimeQuantHooks:
    """Forward hooks putting vLLM's run-time FP8 steps into a transformers DeepseekV4ForCausalLM."""

    def __init__(self, model, cfg: dict):
        self.handles = []
        rd = cfg["qk_rope_head_dim"]
        for layer in model.model.layers:
            attn = layer.self_attn
            self.handles.append(attn.kv_norm.register_forward_hook(lambda m, a, out: fp8_ds_mla_nope(out)))
            comp = attn.compressor
            if comp is None:
                continue
            self.handles.append(comp.kv_norm.register_forward_hook(
                lambda m, a, out: fp8_ds_mla_nope(out, reciprocal=True)))
            idx = getattr(comp, "indexer", None)
            if idx is None:
                continue
            inv_freq = getattr(idx.rotary_emb, f"{idx.rope_layer_type}_inv_freq")
            assert getattr(idx.rotary_emb, f"{idx.rope_layer_type}_attention_scaling") == 1.0
            ratio, nh, hd = idx.compress_rate, idx.num_heads, idx.head_dim

            def k_hook(m, a, out, inv_freq=inv_freq, ratio=ratio):
                # compressed entry w sits at position w * ratio (whole sequence from position 0)
                pos = torch.arange(out.shape[-2]) * ratio
                q = fp8_indexer_k(_rope(out, inv_freq, pos, 1.0).float())
                return _rope(q, inv_freq, pos, -1.0).to(out.dtype)

            def q_hook(m, a, out, inv_freq=inv_freq, nh=nh, hd=hd):
                q = bf16(out).unflatten(-1, (nh, hd)).transpose(-2, -3)  # [B, H, S, D]
                pos = torch.arange(q.shape[-2])
                q = fp8_indexer_q(_rope(q, inv_freq, pos, 1.0).float(), rd)
                q = _rope(q, inv_freq, pos, -1.0).to(out.dtype)
                return q.transpose(-2, -3).flatten(-2)

            self.handles.append(idx.kv_norm.register_forward_hook(k_hook))
            self.handles.append(idx.q_b_proj.register_forward_hook(q_hook))

    def remove(self):
        for h in self.handles:
            h.remove()


class DecisionMargins:
    """Records, per forward, how close the discrete choices were: for each C4 layer the indexer's
    top-k (and the gap between its k-th and (k+1)-th score, relative to the k-th), for each top-k MoE
    layer the router's gap between the k-th and (k+1)-th biased score. A position whose margin is
    tiny can flip under BF16/FP8 noise in any implementation; compare such positions loosely."""

    def __init__(self, model):
        self.data: dict[str, torch.Tensor] = {}
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            comp = layer.self_attn.compressor
            idx = getattr(comp, "indexer", None) if comp is not None else None
            if idx is not None:
                self.handles.append(idx.scorer.register_forward_hook(self._indexer(i, idx)))
            gate = layer.mlp.gate
            if hasattr(gate, "e_score_correction_bias"):
                self.handles.append(gate.register_forward_hook(self._router(i, gate)))

    def _indexer(self, i, idx):
        def hook(m, args, scores):  # scores [B, S, T], before the causal mask
            s = scores[0].double()
            t = torch.arange(s.shape[0])[:, None]
            s = s.masked_fill(torch.arange(s.shape[1])[None, :] >= (t + 1) // idx.compress_rate, -math.inf)
            k = idx.index_topk
            top = s.topk(min(k + 1, s.shape[1]), dim=-1).values if s.shape[1] else s[:, :0]
            margin = torch.full((s.shape[0],), math.inf, dtype=torch.float64)
            if top.shape[1] > k:
                ok = torch.isfinite(top[:, k])
                margin[ok] = ((top[ok, k - 1] - top[ok, k]) / top[ok, k - 1].abs().clamp_min(1e-30))
            self.data[f"indexer_margin.{i}"] = margin.float()
            self.data[f"indexer_scores.{i}"] = s  # float64 [S, T], -inf where not causal
        return hook

    def _router(self, i, gate):
        def hook(m, args, out):
            logits = out[0].double()
            sc = torch.sqrt(torch.nn.functional.softplus(logits)) + gate.e_score_correction_bias.double()
            top = sc.topk(gate.top_k + 1, dim=-1).values
            self.data[f"router_margin.{i}"] = (top[:, -2] - top[:, -1]).float()
        return hook


class HiddenStates:
    """Forward hooks recording, per forward, the hidden streams after each decoder layer
    ([S, hc_mult, hidden]) and the attention and MoE outputs inside it ([S, hidden]), float32,
    under the names the engine's recorder uses (tests/e2e/dsv4_vllm_run.py)."""

    def __init__(self, model):
        self.data: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(model.model.layers):
            layer.register_forward_hook(self._hook(f"layer.{i}"))
            layer.self_attn.register_forward_hook(self._hook(f"attn.{i}"))
            layer.mlp.register_forward_hook(self._hook(f"ffn.{i}"))

    def _hook(self, name):
        def hook(m, args, out):
            x = out[0] if isinstance(out, tuple) else out
            self.data[name] = x[0].detach().float().clone()
        return hook


# Parameters vLLM keeps in float32 while the rest of the model runs in bfloat16
# (vllm/models/deepseek_v4/amd/model.py: hc_* mixers, router bias, attention sinks; the compressor
# position bias): the noise floor of a layer is this oracle against the float32 one.
VLLM_FP32 = ("attn_hc.", "ffn_hc.", "hc_head.", "e_score_correction_bias", "self_attn.sinks",
             "position_bias")


# ---- the oracle -----------------------------------------------------------------------------
class Dsv4Oracle:
    """`logprobs(ids)`: float32 [len(ids), vocab] log-softmax; row t is the distribution of token t+1.
    `greedy(ids, n)`: n greedy tokens (full recompute each step)."""

    def __init__(self, model_dir: str | Path, runtime_quant: bool = True):
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

        self.cfg = json.loads((Path(model_dir) / "config.json").read_text())
        hf = {k: v for k, v in self.cfg.items() if k not in ("quantization_config", "expert_dtype")}
        config = DeepseekV4Config(**hf)
        config._attn_implementation = "eager"
        torch.manual_seed(0)
        self.model = DeepseekV4ForCausalLM(config).float().eval()
        self.native = load_native(model_dir)
        sd = {k: v.float() if v.is_floating_point() else v.long()
              for k, v in to_transformers_state_dict(self.native, self.cfg).items()}
        missing, unexpected = self.model.load_state_dict(sd, strict=False)
        missing = [m for m in missing if "inv_freq" not in m]
        if missing or unexpected:
            raise RuntimeError(f"checkpoint does not fit transformers: missing {missing}, unexpected {unexpected}")
        self.hooks = RuntimeQuantHooks(self.model, self.cfg) if runtime_quant else None
        self.margins = DecisionMargins(self.model)
        self.hidden = HiddenStates(self.model)

    def to_vllm_dtypes(self) -> "Dsv4Oracle":
        """bfloat16 activations and weights as vLLM runs them, float32 where vLLM keeps float32
        (VLLM_FP32); norms and the HC mixers compute in float32 inside transformers' modules."""
        self.model.to(torch.bfloat16)
        for name, t in list(self.model.named_parameters()) + list(self.model.named_buffers()):
            if any(k in name for k in VLLM_FP32) and t.is_floating_point():
                t.data = t.data.float()
        return self

    @torch.no_grad()
    def logprobs(self, ids: list[int]) -> torch.Tensor:
        x = torch.tensor([ids], dtype=torch.long)
        out = self.model(input_ids=x, use_cache=False)
        return torch.log_softmax(out.logits[0].float(), dim=-1)

    def greedy(self, ids: list[int], n: int) -> list[int]:
        seq = list(ids)
        for _ in range(n):
            seq.append(int(self.logprobs(seq)[-1].argmax()))
        return seq[len(ids):]


def run(model_dir, prompts: list[list[int]], greedy: int = 0, runtime_quant: bool = True) -> dict:
    """{'logprobs': [float32 [T, V] per prompt], 'greedy': [[ids] per prompt], 'runtime_quant': bool,
    'margins': [{'indexer_margin.<layer>': float32 [T], 'router_margin.<layer>': float32 [T]} per
    prompt] (see DecisionMargins), 'transformers': version}.
    Target log-probs: logprobs[i][t, prompts[i][t + 1]]."""
    import transformers

    o = Dsv4Oracle(model_dir, runtime_quant)
    logprobs, margins = [], []
    for p in prompts:
        logprobs.append(o.logprobs(p))
        margins.append(dict(o.margins.data))
    return {"logprobs": logprobs, "margins": margins,
            "greedy": [o.greedy(p, greedy) if greedy else [] for p in prompts],
            "runtime_quant": runtime_quant, "transformers": transformers.__version__}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--ids", required=True, help="JSON list of token id lists, or @file.json")
    ap.add_argument("--out", required=True, help="torch.save file")
    ap.add_argument("--greedy", type=int, default=0, help="greedy tokens to generate per prompt")
    ap.add_argument("--no-quant", action="store_true", help="skip vLLM's run-time FP8 KV / indexer steps")
    a = ap.parse_args(argv)
    ids = json.loads(Path(a.ids[1:]).read_text() if a.ids.startswith("@") else a.ids)
    torch.save(run(a.model, ids, a.greedy, not a.no_quant), a.out)
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
