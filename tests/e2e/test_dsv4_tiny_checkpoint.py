"""Self-check of the tiny DeepSeek V4 checkpoint (tools/dsv4_tiny.py) and of the oracle's loading.

References are written here: a float64 decode of the bytes that shares no code with the oracle's
decoders (torch's own float8 casts, E2M1 from its bit fields), and DeepSeek-V4-Flash's tensor-name
patterns as listed in its model.safetensors.index.json (one name per pattern, digits as 0).
"""
import hashlib
import json
import re
from pathlib import Path

import pytest
import torch

from tools.dsv4_tiny import CONFIG, make_dsv4_tiny

# DeepSeek-V4-Flash model.safetensors.index.json: every distinct name pattern (layer/expert ids -> 0).
FLASH_PATTERNS = {
    "embed.weight", "head.weight", "norm.weight", "hc_head_base", "hc_head_fn", "hc_head_scale",
    *(f"layers.0.{s}" for s in (
        "attn.attn_sink", "attn.compressor.ape", "attn.compressor.norm.weight",
        "attn.compressor.wgate.weight", "attn.compressor.wkv.weight", "attn.indexer.compressor.ape",
        "attn.indexer.compressor.norm.weight", "attn.indexer.compressor.wgate.weight",
        "attn.indexer.compressor.wkv.weight", "attn.indexer.weights_proj.weight",
        "attn.indexer.wq_b.scale", "attn.indexer.wq_b.weight", "attn.kv_norm.weight",
        "attn.q_norm.weight", "attn.wkv.scale", "attn.wkv.weight", "attn.wo_a.scale",
        "attn.wo_a.weight", "attn.wo_b.scale", "attn.wo_b.weight", "attn.wq_a.scale",
        "attn.wq_a.weight", "attn.wq_b.scale", "attn.wq_b.weight", "attn_norm.weight",
        "ffn.experts.0.w0.scale", "ffn.experts.0.w0.weight", "ffn.gate.bias", "ffn.gate.tid2eid",
        "ffn.gate.weight", "ffn.shared_experts.w0.scale", "ffn.shared_experts.w0.weight",
        "ffn_norm.weight", "hc_attn_base", "hc_attn_fn", "hc_attn_scale", "hc_ffn_base",
        "hc_ffn_fn", "hc_ffn_scale")),
    *(f"mtp.0.{s}" for s in (
        "attn.attn_sink", "attn.kv_norm.weight", "attn.q_norm.weight", "attn.wkv.scale",
        "attn.wkv.weight", "attn.wo_a.scale", "attn.wo_a.weight", "attn.wo_b.scale",
        "attn.wo_b.weight", "attn.wq_a.scale", "attn.wq_a.weight", "attn.wq_b.scale",
        "attn.wq_b.weight", "attn_norm.weight", "e_proj.scale", "e_proj.weight", "enorm.weight",
        "ffn.experts.0.w0.scale", "ffn.experts.0.w0.weight", "ffn.gate.bias", "ffn.gate.weight",
        "ffn.shared_experts.w0.scale", "ffn.shared_experts.w0.weight", "ffn_norm.weight",
        "h_proj.scale", "h_proj.weight", "hc_attn_base", "hc_attn_fn", "hc_attn_scale",
        "hc_ffn_base", "hc_ffn_fn", "hc_ffn_scale", "hc_head_base", "hc_head_fn", "hc_head_scale",
        "hnorm.weight", "norm.weight")),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_dsv4_tiny(tmp_path_factory.mktemp("dsv4") / "a", seed=0)


@pytest.fixture(scope="module")
def tensors(ckpt):
    from safetensors.torch import load_file

    return load_file(str(ckpt / "model.safetensors"))


def _digests(d: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())}


def test_same_seed_gives_identical_bytes(ckpt, tmp_path):
    again = make_dsv4_tiny(tmp_path / "b", seed=0)
    assert _digests(again) == _digests(ckpt)
    assert sum(f.stat().st_size for f in ckpt.iterdir()) < 20 * 2**20


def test_names_follow_deepseek_v4_flash(tensors):
    """Same name patterns as the real checkpoint, with w1/w2/w3 for Flash's experts/shared w0 slot."""
    ours = {re.sub(r"\.(\d+)\.", ".0.", n) for n in tensors}
    ours = {re.sub(r"\.w[123]\.", ".w0.", n) for n in ours}
    assert ours == FLASH_PATTERNS


def test_dtypes_and_shapes_are_the_native_formats(tensors):
    c = CONFIG
    d, hd, ql = c["hidden_size"], c["head_dim"], c["q_lora_rank"]
    for name, t in tensors.items():
        if name.endswith(".scale"):
            assert t.dtype == torch.float8_e8m0fnu, name
            w = tensors[name.removesuffix(".scale") + ".weight"]
            if ".experts." in name and ".shared_experts." not in name:
                assert w.dtype == torch.int8 and t.shape == (w.shape[0], w.shape[1] * 2 // 32), name
            else:
                assert w.dtype == torch.float8_e4m3fn, name
                assert t.shape == (-(-w.shape[0] // 128), -(-w.shape[1] // 128)), name
    fp32 = ("attn_sink", "ape", "gate.bias", "hc_")
    for name, t in tensors.items():
        if any(k in name for k in fp32):
            assert t.dtype == torch.float32, name
        elif name.endswith("tid2eid"):
            assert t.dtype == torch.int32 and t.shape == (c["vocab_size"], c["num_experts_per_tok"])
        elif not name.endswith(".scale") and (name.removesuffix(".weight") + ".scale") not in tensors:
            assert t.dtype == torch.bfloat16, name
    assert tensors["layers.0.attn.wq_b.weight"].shape == (c["num_attention_heads"] * hd, ql)
    assert tensors["layers.2.attn.compressor.ape"].shape == (4, 2 * hd)      # C4: overlapping Ca|Cb
    assert tensors["layers.3.attn.compressor.ape"].shape == (128, hd)        # C128
    assert tensors["layers.2.attn.indexer.compressor.wkv.weight"].shape == (2 * c["index_head_dim"], d)
    assert tensors["layers.0.ffn.experts.0.w1.weight"].shape == (c["moe_intermediate_size"], d // 2)


def test_vllm_weights_mapper_sends_every_tensor_to_a_deepseek_v4_param(tensors):
    """vLLM's own DeepSeek V4 mapper (amd/model.py): dense .scale -> .weight_scale_inv, expert .scale
    -> .weight_scale, top-level names under model.; what it cannot map would fail the load."""
    amd = pytest.importorskip("vllm.models.deepseek_v4.amd.model")
    mapper = amd.DeepseekV4ForCausalLM.hf_to_vllm_mapper
    for name in tensors:
        mapped = mapper._map_name(name)
        assert mapped is not None, name
        if name.startswith(("layers.", "embed.", "norm.", "hc_head", "mtp.")):
            assert mapped.startswith("model."), (name, mapped)
        if name.endswith(".scale"):
            want = ".weight_scale" if re.search(r"\.experts\.\d+\.w[123]\.scale$", name) else ".weight_scale_inv"
            assert mapped.endswith(want), (name, mapped)
    assert mapper._map_name("head.weight") == "lm_head.weight"
    assert mapper._map_name("layers.3.ffn.gate.bias").endswith(".ffn.gate.e_score_correction_bias")


def _fp8_f64(w, s):  # torch's own float8 casts, block-broadcast by index arithmetic
    v, sc = w.to(torch.float64), s.to(torch.float64)
    r = torch.arange(v.shape[0]) // 128
    k = torch.arange(v.shape[1]) // 128
    return v * sc[r][:, k]


def _mxfp4_f64(w, s):  # E2M1 from its bit fields: s ee m, bias 1, e == 0 subnormal (m * 0.5)
    u = w.view(torch.uint8).to(torch.int64)
    n = torch.stack([u & 0xF, u >> 4], -1).flatten(-2)
    sign, e, m = (n >> 3) & 1, (n >> 1) & 3, n & 1
    mag = torch.where(e == 0, m * 0.5, (1 + m * 0.5) * torch.pow(2.0, (e - 1).double()))
    val = torch.where(sign == 1, -mag, mag)
    return val * s.to(torch.float64)[:, torch.arange(val.shape[1]) // 32]


def test_oracle_weights_equal_an_independent_decode(ckpt, tensors):
    pytest.importorskip("transformers.models.deepseek_v4")
    from tests.e2e.dsv4_oracle import Dsv4Oracle

    o = Dsv4Oracle(ckpt, runtime_quant=False)
    p = dict(o.model.named_parameters())
    t = tensors
    checks = {
        "model.layers.2.self_attn.q_b_proj.weight": _fp8_f64(t["layers.2.attn.wq_b.weight"], t["layers.2.attn.wq_b.scale"]),
        "model.layers.3.self_attn.o_a_proj.weight": _fp8_f64(t["layers.3.attn.wo_a.weight"], t["layers.3.attn.wo_a.scale"]),
        "model.layers.4.self_attn.compressor.indexer.q_b_proj.weight": _fp8_f64(
            t["layers.4.attn.indexer.wq_b.weight"], t["layers.4.attn.indexer.wq_b.scale"]),
        "model.layers.1.mlp.shared_experts.down_proj.weight": _fp8_f64(
            t["layers.1.ffn.shared_experts.w2.weight"], t["layers.1.ffn.shared_experts.w2.scale"]),
        "model.layers.3.self_attn.compressor.kv_proj.weight": t["layers.3.attn.compressor.wkv.weight"].double(),
    }
    for e in range(CONFIG["n_routed_experts"]):
        f = f"layers.0.ffn.experts.{e}"
        gate_up = torch.cat([_mxfp4_f64(t[f"{f}.w1.weight"], t[f"{f}.w1.scale"]),
                             _mxfp4_f64(t[f"{f}.w3.weight"], t[f"{f}.w3.scale"])])
        assert torch.equal(p["model.layers.0.mlp.experts.gate_up_proj"][e], gate_up.float()), e
        down = _mxfp4_f64(t[f"{f}.w2.weight"], t[f"{f}.w2.scale"])
        assert torch.equal(p["model.layers.0.mlp.experts.down_proj"][e], down.float()), e
    for name, ref in checks.items():
        assert torch.equal(p[name], ref.float()), name  # exact: both are float32 of exact products
    assert (o.model.model.layers[0].mlp.gate.tid2eid == t["layers.0.ffn.gate.tid2eid"].long()).all()


def test_oracle_logprobs_are_peaked_and_shaped(ckpt):
    pytest.importorskip("transformers.models.deepseek_v4")
    from tests.e2e.dsv4_oracle import run

    g = torch.Generator().manual_seed(0)
    ids = [1] + torch.randint(8, 1000, (39,), generator=g).tolist()
    res = run(ckpt, [ids], greedy=2)
    lp = res["logprobs"][0]
    assert lp.shape == (40, CONFIG["vocab_size"]) and lp.dtype == torch.float32
    assert torch.allclose(lp.exp().sum(-1), torch.ones(40), atol=1e-4)
    assert lp.exp().max(-1).values.mean() > 0.15  # far from uniform (1/1024)
    assert len(res["greedy"][0]) == 2


def test_transformers_own_loader_dequantizes_to_the_same_weights(ckpt):
    """transformers' from_pretrained (its FP8/MXFP4 quantizer dequantizes on CPU) gives exactly the
    oracle's weights, for every parameter: the checkpoint is in the format transformers expects."""
    pytest.importorskip("transformers.models.deepseek_v4")
    pytest.importorskip("accelerate")  # the FP8 quantizer's environment check asks for it
    from transformers import DeepseekV4ForCausalLM

    from tests.e2e.dsv4_oracle import Dsv4Oracle

    hf = DeepseekV4ForCausalLM.from_pretrained(ckpt, dtype=torch.float32, use_kernels=False)
    ours = dict(Dsv4Oracle(ckpt, runtime_quant=False).model.named_parameters())
    theirs = dict(hf.named_parameters())
    assert theirs.keys() == ours.keys()
    for name, p in theirs.items():
        assert torch.equal(p.float(), ours[name]), name


def test_tokenizer_and_chat_template_load_offline(ckpt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    assert len(tok) == CONFIG["vocab_size"]
    text = tok.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<｜begin▁of▁sentence｜><｜User｜>Hello<｜Assistant｜></think>"
    cfg = json.loads((ckpt / "config.json").read_text())
    assert tok.bos_token_id == cfg["bos_token_id"] and tok.eos_token_id == cfg["eos_token_id"]
