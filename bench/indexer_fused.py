# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""H200 tier of the fused Lightning-indexer ops (patch dsv4-indexer-fused-gfx936): the compiled
Triton kernels against their PyTorch twins on the GPU (bitwise: q bytes and weights, logits on
each row's valid keys, top-k indices incl. crafted ties), then eager timings of kernels and twins
(CUDA events around each call, median). Writes indexer_h200.json into $OUT (or the cwd).

The GPU machine has torch and triton but not vLLM's dependencies, so ``--stage DIR`` (run where
the series is applied; stdlib only) copies this script and the modules it imports, byte for byte,
to their package paths under DIR (empty ``__init__.py`` files above them): the two Triton leaf
modules, the KV-insert kernel's integer helpers, the codecs, the layout constants, the q twin and
the logits/top-k twins' module. That last one imports five engine modules it does not use in the
twins (env, forward context, platform, custom-op registration, workspace); the run stubs them.

    python3 bench/indexer_fused.py --stage .device/indexer     # here
    cd .device/indexer && python3 indexer_fused.py             # on the GPU machine
"""
import os
import shutil
import sys
import types
import json
import time
from pathlib import Path

STAGED = [
    "v1/attention/ops/deepseek_v4_cache_layouts.py",
    "v1/attention/ops/gfx936_indexer_topk_triton.py",
    "v1/attention/ops/gfx936_sparse_attn_indexer.py",
    "models/deepseek_v4/common/ops/gfx936_kv_insert_triton.py",
    "models/deepseek_v4/common/ops/gfx936_indexer_q_triton.py",
    "models/deepseek_v4/common/ops/gfx936_indexer_q.py",
    "model_executor/layers/quantization/utils/lowp_codecs_torch.py",
]


def stage(dest: Path) -> None:
    src = Path(__file__).resolve().parents[1] / "vllm" / "vllm"
    if not (src / STAGED[0]).is_file():
        sys.exit(f"--stage: {src} has no applied series (make apply first)")
    for rel in STAGED:
        out = dest / "vllm" / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / rel, out)
    for d in [dest / "vllm", *(dest / "vllm").rglob("*")]:
        if d.is_dir():
            (d / "__init__.py").touch()
    shutil.copyfile(__file__, dest / "indexer_fused.py")
    print(f"staged {len(STAGED)} modules and this script into {dest}")


if len(sys.argv) == 3 and sys.argv[1] == "--stage":
    stage(Path(sys.argv[2]))
    sys.exit(0)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import triton  # noqa: E402


def _stub(name: str, **attrs) -> None:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod


# the twins' module imports these for the engine op, not for the twins themselves
import vllm  # noqa: E402,F401  (the staged empty package)

_stub("vllm.envs", VLLM_SPARSE_INDEXER_MAX_LOGITS_MB=0)
_stub("vllm.forward_context", get_forward_context=lambda: None)
_stub("vllm.platforms", current_platform=None)
_stub("vllm.utils")
_stub("vllm.utils.torch_utils", LayerNameType=str, _encode_layer_name=str,
      _resolve_layer_name=str, direct_register_custom_op=lambda *a, **k: None)
_stub("vllm.v1.worker")
_stub("vllm.v1.worker.workspace", current_workspace_manager=None,
      is_workspace_manager_initialized=lambda: False)
from vllm.models.deepseek_v4.common.ops import gfx936_indexer_q_triton as qtri  # noqa: E402
from vllm.models.deepseek_v4.common.ops.gfx936_indexer_q import (  # noqa: E402
    indexer_q_rope_quant_torch,
)
from vllm.v1.attention.ops import gfx936_indexer_topk_triton as ktri  # noqa: E402
from vllm.v1.attention.ops import gfx936_sparse_attn_indexer as idx  # noqa: E402

DEV = torch.device(os.environ.get("DEV", "cuda"))  # DEV=cpu + TRITON_INTERPRET=1: a smoke run
D, SB = 128, 4  # indexer head dim, scale bytes per key
FLASH_MAX_LEN = (1 << 20) // 4  # max_model_len 1M, compressed by 4


def cos_sin(n: int = 65536) -> torch.Tensor:
    inv = 10000 ** (torch.arange(0, 64, 2, device=DEV).double() / 64)
    ang = torch.arange(n, device=DEV).double()[:, None] / inv
    return torch.cat([ang.cos(), ang.sin()], -1).float()


def no_nan(codes: torch.Tensor) -> torch.Tensor:
    return torch.where((codes & 0x7F) == 0x7F, codes ^ 1, codes)


def make(lens, bs, heads, next_n=1, seed=0):
    """Paged FP8 indexer K cache (random E4M3, power-of-two scales), block table, lengths, q, w."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    need = [max(1, -(-n // bs)) for n in lens]
    nb = sum(need) + 2
    cache = torch.randint(0, 256, (nb, bs, D + SB), dtype=torch.uint8, device=DEV, generator=g)
    blocks = cache.view(nb, -1)
    blocks[:, : bs * D] = no_nan(blocks[:, : bs * D])
    scales = torch.pow(2.0, torch.randint(-12, 3, (nb, bs), device=DEV, generator=g).float())
    blocks[:, bs * D:] = scales.view(torch.uint8).view(nb, bs * SB)
    perm = torch.randperm(nb, device=DEV, generator=g)
    bt = torch.full((len(lens), max(need)), -1, dtype=torch.int32, device=DEV)
    start = 0
    for r, k in enumerate(need):
        bt[r, :k] = perm[start:start + k].int()
        start += k
    seq = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = no_nan(torch.randint(0, 256, (len(lens), next_n, heads, D), dtype=torch.uint8,
                             device=DEV, generator=g))
    w = torch.randn(len(lens) * next_n, heads, device=DEV, generator=g)
    return cache, bt, seq, q, w


def twin(q, w, cache, bt, seq, next_n, top_k, max_len):
    ends = idx.decode_row_ends(seq, next_n)
    logits = idx._paged_decode_logits(q, cache, w, ends, bt, max_len)
    out = torch.full((q.shape[0] * next_n, top_k), 99, dtype=torch.int32, device=DEV)
    idx.top_k_per_row(logits, None, ends.clamp(max=logits.shape[1]), top_k, out)
    return logits, out, ends


def kernels(q, w, cache, bt, seq, next_n, top_k, max_len):
    logits = ktri.indexer_logits_triton(q, w, cache, bt, seq, max_len)
    out = torch.full((q.shape[0] * next_n, top_k), 99, dtype=torch.int32, device=DEV)
    ktri.indexer_topk_triton(logits, seq, next_n, top_k, out)
    return logits, out


def median_us(fn, reps=20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def checks(res: dict) -> None:
    lens16 = torch.randint(1, 9000, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    # (lengths, block size, heads, next_n, top_k): Flash's 64 heads / top-k 512, and the tiny's
    cases = [([20000], 64, 64, 1, 512), ([0, 300, 512, 513], 64, 64, 1, 512),
             (lens16, 64, 64, 1, 512), ([40, 700, 2000], 64, 64, 2, 512),
             ([3, 8, 9, 100, 1000], 16, 4, 1, 8)]
    for lens, bs, heads, next_n, top_k in cases if DEV.type == "cuda" else cases[-1:]:
        cache, bt, seq, q, w = make(lens, bs, heads, next_n, seed=len(lens))
        t_logits, t_out, ends = twin(q, w, cache, bt, seq, next_n, top_k, FLASH_MAX_LEN)
        k_logits, k_out = kernels(q, w, cache, bt, seq, next_n, top_k, FLASH_MAX_LEN)
        same = all(torch.equal(k_logits[r, :e], t_logits[r, :e])
                   for r, e in enumerate(ends.tolist()))
        res["checks"].append({
            "case": f"B={len(lens)} H={heads} bs={bs} next_n={next_n} top_k={top_k} "
                    f"lens={lens[:6]}",
            "logits_bitwise": same, "topk_identical": torch.equal(k_out, t_out)})
        print(res["checks"][-1], flush=True)
    if DEV.type != "cuda":
        return
    vals = torch.tensor([-3.0, -0.0, 0.0, 0.5, 0.5, 2.0], device=DEV)  # most keys tie
    ends = [300, 512, 513, 5000, 60000]
    logits = vals[torch.randint(0, len(vals), (len(ends), max(ends) + 1), device=DEV)]
    seq = torch.tensor(ends, dtype=torch.int32, device=DEV)
    k_out = torch.zeros((len(ends), 512), dtype=torch.int32, device=DEV)
    t_out = k_out.clone()
    ktri.indexer_topk_triton(logits, seq, 1, 512, k_out)
    idx.top_k_per_row(logits, None, seq, 512, t_out)
    res["checks"].append({"case": f"crafted ties, top_k 512, ends {ends}",
                          "topk_identical": torch.equal(k_out, t_out)})
    print(res["checks"][-1], flush=True)
    cs = cos_sin()
    for tokens in (1, 16, 64, 256):
        g = torch.Generator(device=DEV).manual_seed(tokens)
        x = (torch.randn(tokens, 64, D, device=DEV, generator=g)
             * torch.logspace(-6, 3, tokens, device=DEV)[:, None, None]).to(torch.bfloat16)
        pos = torch.randint(0, cs.shape[0], (tokens,), device=DEV, generator=g)
        wi = torch.randn(tokens, 64, device=DEV, generator=g).to(torch.bfloat16)
        t_codes, t_w = indexer_q_rope_quant_torch(pos, x, cs, wi, D**-0.5, 64**-0.5)
        k_codes, k_w = qtri.indexer_q_rope_quant_triton(pos, x, cs, wi, D**-0.5, 64**-0.5)
        res["checks"].append({"case": f"q op T={tokens} H=64",
                              "codes_bitwise": torch.equal(t_codes.view(torch.uint8), k_codes),
                              "weights_bitwise": torch.equal(t_w, k_w)})
        print(res["checks"][-1], flush=True)


def timings(res: dict, t0: float, budget_s: float = 100.0) -> None:
    for bsz in (1, 16, 64):
        for ctx in (4096, 32768):  # compressed keys per request (x 4 tokens)
            if time.time() - t0 > budget_s:
                return
            cache, bt, seq, q, w = make([ctx] * bsz, 64, 64, 1, seed=7)
            out = torch.empty((bsz, 512), dtype=torch.int32, device=DEV)
            logits = ktri.indexer_logits_triton(q, w, cache, bt, seq, FLASH_MAX_LEN)
            row = {"B": bsz, "ctx_compressed": ctx,
                   "logits_us": round(median_us(lambda: ktri.indexer_logits_triton(
                       q, w, cache, bt, seq, FLASH_MAX_LEN)), 1),
                   "topk_us": round(median_us(lambda: ktri.indexer_topk_triton(
                       logits, seq, 1, 512, out)), 1)}
            if bsz * ctx <= 16 * 32768:  # the twins hold [B, W, 128] float64 K
                ends = idx.decode_row_ends(seq, 1)

                def twins():
                    lg = idx._paged_decode_logits(q, cache, w, ends, bt, FLASH_MAX_LEN)
                    idx.top_k_per_row(lg, None, ends, 512, out)

                row["twin_us"] = round(median_us(twins, reps=3), 1)
            res["timings"].append(row)
            print(row, flush=True)
    cs = cos_sin()
    for tokens in (1, 16, 64):
        x = torch.randn(tokens, 64, D, device=DEV).to(torch.bfloat16)
        pos = torch.arange(tokens, device=DEV)
        wi = torch.randn(tokens, 64, device=DEV)
        res["timings"].append({
            "q_op_T": tokens,
            "kernel_us": round(median_us(lambda: qtri.indexer_q_rope_quant_triton(
                pos, x, cs, wi, 0.1, 0.125)), 1),
            "twin_us": round(median_us(lambda: indexer_q_rope_quant_torch(
                pos, x, cs, wi, 0.1, 0.125)), 1)})
        print(res["timings"][-1], flush=True)


def main() -> None:
    gpu = torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu"
    print(torch.__version__, triton.__version__, gpu)
    res = {"torch": torch.__version__, "triton": triton.__version__, "device": gpu,
           "checks": [], "timings": []}
    t0 = time.time()
    checks(res)
    if DEV.type == "cuda":
        timings(res, t0)
    out = Path(os.environ.get("OUT", ".")) / "indexer_h200.json"
    out.write_text(json.dumps(res, indent=1))
    ok = all(v for c in res["checks"] for k, v in c.items() if k != "case")
    print("all bitwise" if ok else "MISMATCH", f"({time.time() - t0:.1f} s) -> {out}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
