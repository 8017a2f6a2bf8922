"""A tiny random Llama in real Hugging Face layout, made on the fly with no hub access.

What `make demo` and tests/serve/ serve: config.json, model.safetensors (seeded random weights),
a byte-level BPE tokenizer trained in-process with `tokenizers` (tokenizer.json), and a
tokenizer_config.json carrying a chat template. About 2 MB.

Head size 64: vLLM's CPU attention rejects 16 (it supports 32, 64, 80, 96, 112, 128, ...).

    python tools/tiny_model.py DEST          # or: from tools.tiny_model import make_tiny_model
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
# Minimal chat template: roles as plain text markers, the assistant turn opened on request.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Corpus for the BPE merges: enough distinct English-ish text that common words get tokens.
CORPUS = [
    "The fork serves a tiny random model on the CPU through the real V1 engine.",
    "Hello! How are you today? I am a small language model with random weights.",
    "vLLM is a fast and easy-to-use library for LLM inference and serving.",
    "DeepSeek V4 Flash runs on Hygon DCU gfx936 with MXFP4 experts and FP8 weights.",
    "<|system|> <|user|> <|assistant|> say hello in one short sentence please",
    "The quick brown fox jumps over the lazy dog. 0123456789 +-*/=()[]{}<>",
]

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "initializer_range": 0.02,
}


def train_tokenizer(vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    return tok


def _weights(cfg: dict, seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * cfg["initializer_range"]).to(torch.bfloat16)

    w = {"model.embed_tokens.weight": rnd(v, h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
         "lm_head.weight": rnd(v, h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        w.update({
            p + "self_attn.q_proj.weight": rnd(q, h),
            p + "self_attn.k_proj.weight": rnd(kv, h),
            p + "self_attn.v_proj.weight": rnd(kv, h),
            p + "self_attn.o_proj.weight": rnd(h, q),
            p + "mlp.gate_proj.weight": rnd(i, h),
            p + "mlp.up_proj.weight": rnd(i, h),
            p + "mlp.down_proj.weight": rnd(h, i),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        })
    return w


def make_tiny_model(dest: str | Path, seed: int = 0) -> Path:
    """Write the tiny model to `dest` (created; existing files overwritten). Returns dest."""
    from safetensors.torch import save_file

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    tok.save(str(dest / "tokenizer.json"))
    cfg = dict(CONFIG, vocab_size=tok.get_vocab_size(), bos_token_id=tok.token_to_id(BOS),
               eos_token_id=tok.token_to_id(EOS), pad_token_id=tok.token_to_id(PAD))
    (dest / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (dest / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
         "pad_token_id": cfg["pad_token_id"]}, indent=2) + "\n")
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
    save_file(_weights(cfg, seed), str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dest", help="folder to write the model into")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(make_tiny_model(args.dest, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
