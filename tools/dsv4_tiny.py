"""A tiny DeepSeek V4 Flash checkpoint in the real on-disk formats, made offline and deterministically.

    python -m tools.dsv4_tiny --out DIR [--seed N]      # same seed -> same bytes

The public Flash config scaled down, every knob kept: 5 layers with compress_ratios [0, 0, 4, 128, 4]
plus one MTP layer (ratio 0, as Flash's 44th entry), the first 3 layers hash-routed MoE (as Flash),
the rest top-k MoE with sqrt-softplus scoring and a score-correction bias, mHC with hc_mult 4, sinks,
grouped output projection, swiglu limit 10, YaRN on the compressed layers. Fixed by vLLM's kernels
and kept at Flash's values: head dim 512 (448 NoPE + 64 RoPE), index head dim 128, window 128.
index_topk 8, so a prompt of a few hundred tokens has more C4 entries than the indexer keeps.
YaRN: factor 16 as Flash, but original_max_position_embeddings 256 (Flash: 65536) so that YaRN
changes most RoPE frequencies within a few hundred tokens and a wrong RoPE shows in the log-probs.

Formats (tensor names, dtypes and scale layout as DeepSeek-V4-Flash's model.safetensors):
  FP8 dense  `<name>.weight` F8_E4M3 [out, in] + `<name>.scale` F8_E8M0 [ceil(out/128), ceil(in/128)]:
             wq_a wq_b wkv wo_a wo_b, indexer.wq_b, shared_experts.w1/w2/w3, mtp e_proj/h_proj
  MXFP4      `experts.E.wN.weight` I8 [out, in/2] (two E2M1 per byte, low nibble first)
             + `.scale` F8_E8M0 [out, in/32]
  BF16       embed, head, every RMSNorm weight, compressor wkv/wgate, indexer weights_proj, gate.weight
  F32        attn_sink, compressor ape, gate.bias, hc_* ; I32: gate.tid2eid
Encoders round to nearest even; scales are UE8M0: 2^ceil(log2(amax / max_code)).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
SPECIALS = [BOS, EOS, PAD, "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<｜latest_reminder｜>"]
VOCAB = 1024
# DeepSeek V4's chat mode (vllm/tokenizers/deepseek_v4_encoding.py, thinking_mode="chat") as Jinja.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜></think>{{ m['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜></think>{% endif %}"
)
CORPUS = [
    "The fork serves a tiny random model on the CPU through the real V1 engine.",
    "Hello! How are you today? I am a small language model with random weights.",
    "vLLM is a fast and easy-to-use library for LLM inference and serving.",
    "DeepSeek V4 Flash runs on Hygon DCU gfx936 with MXFP4 experts and FP8 weights.",
    "Sparse attention keeps a sliding window of recent tokens and a compressed summary of the rest.",
    "The indexer scores compressed blocks and keeps the top few for every query token.",
    "Hyper-connections keep four residual streams and mix them with doubly stochastic matrices.",
    "The quick brown fox jumps over the lazy dog. 0123456789 +-*/=()[]{}<>",
    "Once upon a time there was a little model that learned to count: one two three four five.",
    "Rotary position embeddings rotate pairs of channels by an angle that grows with position.",
]

# Public DeepSeek-V4-Flash config.json, scaled down (comment: the Flash value where it differs).
CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": VOCAB,                       # 129280
    "hidden_size": 256,                        # 4096
    "num_hidden_layers": 5,                    # 43
    "num_nextn_predict_layers": 1,
    "compress_ratios": [0, 0, 4, 128, 4, 0],   # [0, 0, 4, 128, ... 4, 128, 4, 0] (last: MTP)
    "num_hash_layers": 3,
    "num_attention_heads": 4,                  # 64
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 128,                        # 1024
    "o_groups": 2,                             # 8
    "o_lora_rank": 128,                        # 1024
    "sliding_window": 128,
    "index_n_heads": 4,                        # 64
    "index_head_dim": 128,
    "index_topk": 8,                           # 512
    "n_routed_experts": 8,                     # 256
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,                  # 6
    "moe_intermediate_size": 128,              # 2048
    "first_k_dense_replace": 0,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "swiglu_limit": 10.0,
    "hidden_act": "silu",
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "max_position_embeddings": 4096,           # 1048576 = 16 * 65536
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 256,
                     "beta_fast": 32, "beta_slow": 1},
    "expert_dtype": "fp4",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "use_cache": True,
    "torch_dtype": "bfloat16",
}

FP8_MAX = 448.0
HEAD_GAIN = 3.0  # logits std ~ HEAD_GAIN: peaked enough that top-1 is meaningful
EXPERT_OUT_GAIN = 0.1  # w2 gain: an expert's share of the residual stays modest, so one routing
                       # flip moves the hidden state by a few percent rather than tens
GATE_GAIN = 4.0  # router logits std ~ GATE_GAIN: clear top-k margins, few routing flips under noise
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code 0..7; bit 3 is the sign


# ---- encoders (round to nearest even, UE8M0 scales) -----------------------------------------
def encode_fp8_block(w, block: int = 128):
    """[out, in] float -> (E4M3 [out, in], E8M0 [ceil(out/b), ceil(in/b)]), scale = 2^ceil(log2(amax/448))."""
    import torch

    out_f, in_f = w.shape
    so, si = -(-out_f // block), -(-in_f // block)
    pad = torch.zeros(so * block, si * block, dtype=torch.float32)
    pad[:out_f, :in_f] = w.float()
    tiles = pad.view(so, block, si, block)
    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-30)
    exp = torch.ceil(torch.log2(amax / FP8_MAX))
    q = (tiles / torch.exp2(exp)[:, None, :, None]).view(so * block, si * block)[:out_f, :in_f]
    # float32 divided by a power of two is exact; the one rounding is torch's float32 -> e4m3fn
    # cast, nearest even (|q| <= 448 by the scale rule, so it never saturates).
    return q.to(torch.float8_e4m3fn), (exp + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _e2m1_codes(x):
    """|x| <= 6 float64 -> 3-bit magnitude codes, nearest with ties to the even code."""
    import torch

    grid = torch.tensor(E2M1_GRID, dtype=torch.float64)
    a = x.abs()
    hi = torch.searchsorted(grid, a.contiguous(), right=False).clamp(max=7)  # first grid >= a
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return torch.where(take_hi, hi, lo)


def encode_mxfp4(w):
    """[out, in] float -> (I8 [out, in/2] low nibble = even column, E8M0 [out, in/32])."""
    import torch

    out_f, in_f = w.shape
    g = w.float().double().view(out_f, in_f // 32, 32)  # the float32 value is the weight
    amax = g.abs().amax(dim=-1).clamp_min(1e-30)
    exp = torch.ceil(torch.log2(amax / 6.0))
    scaled = (g / torch.exp2(exp)[..., None]).view(out_f, in_f)
    codes = _e2m1_codes(scaled) | ((scaled < 0).long() << 3)
    codes = torch.where(codes == 8, torch.zeros_like(codes), codes)  # -0 -> +0
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return packed.view(torch.int8), (exp + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


# ---- the weights ----------------------------------------------------------------------------
def _draw(cfg: dict, seed: int) -> dict:
    """The seed's weights before encoding: {tensor name: (format, float64 or int tensor)}, format
    one of fp8 / mxfp4 (`.weight`, written with its `.scale`), bf16, f32, i32."""
    import torch

    g = torch.Generator().manual_seed(seed)
    d, nh, hd, rd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"], cfg["qk_rope_head_dim"]
    ql, og, ol = cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"]
    ne, k, inter = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    ih, ihd, hc, v = cfg["index_n_heads"], cfg["index_head_dim"], cfg["hc_mult"], cfg["vocab_size"]
    mix = (2 + hc) * hc

    def randn(*shape, std=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * std

    def uniform(*shape, lo=0.0, hi=1.0):
        return lo + (hi - lo) * torch.rand(*shape, generator=g, dtype=torch.float64)

    w: dict = {}

    def fp8(name, out_f, in_f, gain=1.0):
        w[name + ".weight"] = ("fp8", randn(out_f, in_f, std=gain / math.sqrt(in_f)))

    def mxfp4(name, out_f, in_f, gain=1.0):
        w[name + ".weight"] = ("mxfp4", randn(out_f, in_f, std=gain / math.sqrt(in_f)))

    def bf16(name, t):
        w[name] = ("bf16", t)

    def f32(name, t):
        w[name] = ("f32", t)

    def norm(name, n):
        bf16(name, uniform(n, lo=0.8, hi=1.2))

    def hc_params(prefix, kind):
        f32(f"{prefix}hc_{kind}_fn", randn(mix, hc * d, std=0.5 / math.sqrt(hc * d)))
        f32(f"{prefix}hc_{kind}_base", randn(mix, std=0.5))
        f32(f"{prefix}hc_{kind}_scale", uniform(3, lo=0.5, hi=1.5))

    def compressor(prefix, ratio, head_dim):
        coff = 2 if ratio == 4 else 1  # overlapping windows (Ca | Cb) only at ratio 4
        f32(prefix + "ape", randn(ratio, coff * head_dim, std=0.5))
        bf16(prefix + "wkv.weight", randn(coff * head_dim, d, std=1 / math.sqrt(d)))
        bf16(prefix + "wgate.weight", randn(coff * head_dim, d, std=1 / math.sqrt(d)))
        norm(prefix + "norm.weight", head_dim)

    def block(prefix, ratio, hash_moe):
        a = prefix + "attn."
        f32(a + "attn_sink", randn(nh, std=1.0))
        fp8(a + "wq_a", ql, d)
        norm(a + "q_norm.weight", ql)
        fp8(a + "wq_b", nh * hd, ql)
        fp8(a + "wkv", hd, d)
        norm(a + "kv_norm.weight", hd)
        fp8(a + "wo_a", og * ol, nh * hd // og)
        fp8(a + "wo_b", d, og * ol)
        if ratio:
            compressor(a + "compressor.", ratio, hd)
        if ratio == 4:
            fp8(a + "indexer.wq_b", ih * ihd, ql)
            bf16(a + "indexer.weights_proj.weight", randn(ih, d, std=1 / math.sqrt(d)))
            compressor(a + "indexer.compressor.", ratio, ihd)
        f = prefix + "ffn."
        bf16(f + "gate.weight", randn(ne, d, std=GATE_GAIN / math.sqrt(d)))
        if hash_moe:
            w[f + "gate.tid2eid"] = ("i32", torch.stack(
                [torch.randperm(ne, generator=g)[:k] for _ in range(v)]))
        else:
            f32(f + "gate.bias", randn(ne, std=0.1))
        for e in range(ne):
            # gate/up gain 4: a percent or so of the pre-activations pass swiglu_limit (10)
            mxfp4(f"{f}experts.{e}.w1", inter, d, gain=4.0)
            mxfp4(f"{f}experts.{e}.w3", inter, d, gain=4.0)
            mxfp4(f"{f}experts.{e}.w2", d, inter, gain=EXPERT_OUT_GAIN)
        fp8(f + "shared_experts.w1", inter, d, gain=4.0)
        fp8(f + "shared_experts.w3", inter, d, gain=4.0)
        fp8(f + "shared_experts.w2", d, inter, gain=EXPERT_OUT_GAIN)
        norm(prefix + "attn_norm.weight", d)
        norm(prefix + "ffn_norm.weight", d)
        hc_params(prefix, "attn")
        hc_params(prefix, "ffn")

    def hc_head(prefix):
        f32(prefix + "hc_head_fn", randn(hc, hc * d, std=0.5 / math.sqrt(hc * d)))
        f32(prefix + "hc_head_base", randn(hc, std=0.5))
        f32(prefix + "hc_head_scale", uniform(1, lo=0.5, hi=1.5))

    bf16("embed.weight", randn(v, d))
    ratios, n_layers = cfg["compress_ratios"], cfg["num_hidden_layers"]
    for i in range(n_layers):
        block(f"layers.{i}.", ratios[i], i < cfg["num_hash_layers"])
    norm("norm.weight", d)
    # head gain sets how peaked the next-token distribution is (top-1 must mean something)
    bf16("head.weight", randn(v, d, std=HEAD_GAIN / math.sqrt(d)))
    hc_head("")
    for j in range(cfg["num_nextn_predict_layers"]):
        p = f"mtp.{j}."
        block(p, ratios[n_layers + j], False)
        fp8(p + "e_proj", d, d)
        fp8(p + "h_proj", d, d)
        norm(p + "enorm.weight", d)
        norm(p + "hnorm.weight", d)
        norm(p + "norm.weight", d)
        hc_head(p)
    return w


def float_weights(cfg: dict, seed: int) -> dict:
    """{name: float64 (or integer) tensor}: the seed's weights before FP8/MXFP4/BF16 encoding, under
    the `.weight` name for the scaled formats (tools/dsv4_train.py starts training from them)."""
    return {name: t for name, (_, t) in _draw(cfg, seed).items()}


def _weights(cfg: dict, seed: int, trained: dict | None = None) -> dict:
    """The checkpoint's tensors; a name in `trained` takes that float value instead of the draw."""
    import torch

    trained = trained or {}
    out = {}
    for name, (fmt, t) in _draw(cfg, seed).items():
        t = trained.get(name, t)
        if fmt in ("fp8", "mxfp4"):
            base = name.removesuffix(".weight")
            q, s = (encode_fp8_block if fmt == "fp8" else encode_mxfp4)(t.double())
            out[base + ".weight"], out[base + ".scale"] = q, s
        else:
            out[name] = t.to({"bf16": torch.bfloat16, "f32": torch.float32, "i32": torch.int32}[fmt])
    return out


# ---- tokenizer ------------------------------------------------------------------------------
def train_tokenizer(vocab_size: int = VOCAB, corpus: list[str] | None = None):
    """Byte-level BPE trained in-process on `corpus` (default: the built-in sentences); padded with
    reserved specials to exactly `vocab_size`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus or CORPUS * 20, trainer=trainer)
    n = tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(f"<｜reserved_{i}｜>", special=True) for i in range(vocab_size - n)])
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    return tok


def make_dsv4_tiny(dest: str | Path, seed: int = 0, trained: dict | None = None,
                   tokenizer_json: str | Path | None = None) -> Path:
    """Write the checkpoint into `dest` (created; files overwritten). Returns dest. `trained`:
    float weights by native name replacing the seed's draws (tools/dsv4_train.py), with the
    tokenizer they were trained with (`tokenizer_json`)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(tokenizer_json)) if tokenizer_json else train_tokenizer()
    tok.save(str(dest / "tokenizer.json"))
    cfg = dict(CONFIG, bos_token_id=tok.token_to_id(BOS), eos_token_id=tok.token_to_id(EOS),
               pad_token_id=tok.token_to_id(PAD))
    (dest / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (dest / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
         "do_sample": False}, indent=2) + "\n")
    (dest / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "add_bos_token": False, "add_eos_token": False,
        "model_max_length": cfg["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2) + "\n")
    (dest / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2) + "\n")
    weights = _weights(cfg, seed, trained)
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in weights.values())
    (dest / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total},
         "weight_map": {n: "model.safetensors" for n in sorted(weights)}}, indent=2) + "\n")
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder to write the checkpoint into")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(make_dsv4_tiny(args.out, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
