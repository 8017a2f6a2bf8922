"""Train the tiny DeepSeek V4 of tools/dsv4_tiny.py on a public text until it continues passages it
learned, then write it in the native formats (FP8 E4M3 + UE8M0 dense, MXFP4 experts) with that
module's writer. A random model has flat logits, so a check against an oracle on it cannot tell a
porting bug from rounding noise; a trained one predicts most tokens by several nats.

    python -m tools.dsv4_train prepare --work build/dsv4-train          # tokenizer + token stream (CPU)
    python -m tools.dsv4_train train   --work build/dsv4-train [--device cuda] [--steps N]
    python -m tools.dsv4_train export  --work build/dsv4-train --out tests/data/dsv4-tiny-trained

Corpus: the GNU General Public License version 3 as Debian ships it in every image
(/usr/share/common-licenses/GPL-3, package base-files; sha256 pinned below). Its own terms allow
verbatim copies ("Everyone is permitted to copy and distribute verbatim copies of this license
document, but changing it is not allowed"); the model learns it verbatim. Each section (the preamble,
"0. Definitions.", ..., "How to Apply These Terms") is one passage ending in EOS, paragraphs
joined by newlines, lines within a paragraph by spaces.

Training: transformers' DeepseekV4ForCausalLM (the e2e oracle's implementation), float32, from the
random tiny weights of dsv4_tiny (seed 0; hash-routing table and router bias kept), AdamW, samples
of BOS + SEQ_LEN - 1 tokens of the passage stream starting at a paragraph. Not bitwise
reproducible across machines (float reductions), so the result is committed; `train` records its
loss curve beside it. The MTP layer is not trained here (transformers has none): `export` writes
the seed's random MTP weights, and tools/dsv4_mtp_train.py (`make tiny-mtp`) trains it afterwards
with this model frozen.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORPUS_PATH = Path("/usr/share/common-licenses/GPL-3")
CORPUS_SHA256 = "3972dc9744f6499f0f9b2dbf76696f2ae7ad8af9b23dde66d6af86c9dfb36986"
SEQ_LEN = 512
SEED = 0


# ---- corpus -----------------------------------------------------------------------------------
def passages(text: str) -> list[str]:
    """GPL-3 -> its sections, each paragraphs joined by newlines (lines inside one by spaces)."""
    paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()]
    out: list[list[str]] = [[]]
    for p in paras:
        # a new section starts at "N. Title." / "TERMS AND CONDITIONS" / "END OF ..." / "How to Apply"
        if (re.match(r"^\d+\. [A-Z][^.]*\.$", p) or p in ("TERMS AND CONDITIONS", "END OF TERMS AND CONDITIONS")
                or p.startswith("How to Apply")) and out[-1]:
            out.append([])
        out[-1].append(p)
    return ["\n".join(s) for s in out if s]


def read_corpus(path: Path = CORPUS_PATH) -> str:
    if not path.exists():
        raise SystemExit(f"{path} not found: Debian's base-files ships it (the training corpus)")
    data = path.read_bytes()
    got = hashlib.sha256(data).hexdigest()
    if got != CORPUS_SHA256:
        raise SystemExit(f"{path}: sha256 {got}, expected {CORPUS_SHA256} (another GPL-3 text?)")
    return data.decode()


def prepare(work: Path) -> dict:
    """Tokenizer trained on the corpus (dsv4_tiny's BPE, vocab 1024) and the passage stream."""
    from tools import dsv4_tiny

    work.mkdir(parents=True, exist_ok=True)
    docs = passages(read_corpus())
    tok = dsv4_tiny.train_tokenizer(corpus=docs)
    tok.save(str(work / "tokenizer.json"))
    eos = tok.token_to_id(dsv4_tiny.EOS)
    stream, para_starts, doc_spans = [], [], []
    for d in docs:
        start = len(stream)
        for k, para in enumerate(d.split("\n")):
            para_starts.append(len(stream))
            stream += tok.encode(("\n" if k else "") + para).ids
        stream.append(eos)
        doc_spans.append([start, len(stream)])
    info = {"corpus": str(CORPUS_PATH), "sha256": CORPUS_SHA256, "stream": stream,
            "para_starts": para_starts, "doc_spans": doc_spans,
            "bos": tok.token_to_id(dsv4_tiny.BOS), "eos": eos}
    (work / "tokens.json").write_text(json.dumps(info))
    print(f"{len(docs)} passages, {len(stream)} tokens, {len(para_starts)} paragraph starts -> {work}")
    return info


# ---- native <-> transformers names --------------------------------------------------------------
def transformers_model(cfg: dict):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    hf = {k: v for k, v in cfg.items() if k not in ("quantization_config", "expert_dtype")}
    config = DeepseekV4Config(**hf)
    config._attn_implementation = "eager"
    return DeepseekV4ForCausalLM(config)


def native_to_transformers(native: dict, cfg: dict) -> dict:
    from tests.e2e.dsv4_oracle import to_transformers_state_dict

    return to_transformers_state_dict(native, cfg)


def transformers_to_native(sd: dict, cfg: dict) -> dict:
    """Inverse of the oracle's rename table (tests/e2e/dsv4_oracle.py), experts unstacked."""
    from tests.e2e.dsv4_oracle import _LAYER_RENAMES, _TOP

    top = {v: k for k, v in _TOP.items()}
    layer = {dst: src for src, dst in _LAYER_RENAMES}
    inter = cfg["moe_intermediate_size"]
    out = {}
    for name, t in sd.items():
        if name in top:
            out[top[name]] = t
            continue
        if "inv_freq" in name or "rotary_emb" in name:
            continue
        m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
        if m is None:
            raise KeyError(f"no native name for {name}")
        i, rest = m.groups()
        if rest == "mlp.experts.gate_up_proj":
            for e in range(t.shape[0]):
                out[f"layers.{i}.ffn.experts.{e}.w1.weight"] = t[e, :inter]
                out[f"layers.{i}.ffn.experts.{e}.w3.weight"] = t[e, inter:]
        elif rest == "mlp.experts.down_proj":
            for e in range(t.shape[0]):
                out[f"layers.{i}.ffn.experts.{e}.w2.weight"] = t[e]
        elif rest in layer:
            out[f"layers.{i}.{layer[rest]}"] = t
        else:
            raise KeyError(f"no native name for {name}")
    return out


# ---- training -----------------------------------------------------------------------------------
def train(work: Path, steps: int, batch: int, lr: float, device: str, log_every: int = 25,
          time_limit_s: float = 1e9) -> None:
    import torch
    from safetensors.torch import save_file

    from tools import dsv4_tiny

    info = json.loads((work / "tokens.json").read_text())
    cfg = dict(dsv4_tiny.CONFIG)
    torch.manual_seed(SEED)
    model = transformers_model(cfg).float()
    init = {k: v.float() if v.is_floating_point() else v.long()
            for k, v in native_to_transformers(dsv4_tiny.float_weights(cfg, SEED), cfg).items()}
    missing, unexpected = model.load_state_dict(init, strict=False)
    missing = [m for m in missing if "inv_freq" not in m]
    if missing or unexpected:
        raise SystemExit(f"init does not fit transformers: missing {missing}, unexpected {unexpected}")
    model.to(device).train()
    stream = torch.tensor(info["stream"], dtype=torch.long)
    starts = [s for s in info["para_starts"] if s + SEQ_LEN - 1 <= len(stream)]
    bos = info["bos"]
    rng = random.Random(SEED)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warm, t0 = max(1, steps // 20), time.time()

    def lr_factor(s: int) -> float:  # warm-up, then cosine to 10% over the steps or the time limit
        done = min(1.0, max(s / steps, (time.time() - t0) / time_limit_s))
        return min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    curve = []
    for step in range(steps):
        rows = []
        for _ in range(batch):
            s = rng.choice(starts)
            rows.append(torch.cat([torch.tensor([bos]), stream[s:s + SEQ_LEN - 1]]))
        x = torch.stack(rows).to(device)
        out = model(input_ids=x, labels=x, use_cache=False)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        over = time.time() - t0 > time_limit_s
        if step % log_every == 0 or step == steps - 1 or over:
            curve.append({"step": step, "loss": round(out.loss.item(), 4), "lr": sched.get_last_lr()[0],
                          "s": round(time.time() - t0, 1)})
            print(json.dumps(curve[-1]), flush=True)
        if over:
            break
    sd = {k: v.detach().float().cpu().contiguous() if v.is_floating_point() else v.detach().cpu().contiguous()
          for k, v in model.state_dict().items() if "inv_freq" not in k}
    # shards of <= 12 MB (the device tool returns files of at most 16 MiB)
    shard, size, n = {}, 0, 0
    for k in sorted(sd):
        shard[k], size = sd[k], size + sd[k].numel() * sd[k].element_size()
        if size > 12e6:
            save_file(shard, str(work / f"trained-{n}.safetensors"))
            shard, size, n = {}, 0, n + 1
    if shard:
        save_file(shard, str(work / f"trained-{n}.safetensors"))
    meta = {"steps_run": curve[-1]["step"] + 1, "steps": steps, "batch": batch, "seq_len": SEQ_LEN, "lr": lr,
            "device": device, "torch": torch.__version__, "seed": SEED, "loss_curve": curve}
    try:
        import transformers
        meta["transformers"] = transformers.__version__
        if device.startswith("cuda"):
            meta["device_name"] = torch.cuda.get_device_name()
    except Exception:  # noqa: BLE001 - informational only
        pass
    (work / "train_log.json").write_text(json.dumps(meta, indent=1) + "\n")


# ---- export -------------------------------------------------------------------------------------
def export(work: Path, out: Path) -> Path:
    """Trained float weights -> the native checkpoint (dsv4_tiny's writer, corpus tokenizer)."""
    import shutil

    from safetensors.torch import load_file

    from tools import dsv4_tiny

    cfg = dict(dsv4_tiny.CONFIG)
    sd = {}
    for f in sorted(work.glob("trained-*.safetensors")):
        sd.update(load_file(str(f)))
    trained = transformers_to_native(sd, cfg)
    dest = dsv4_tiny.make_dsv4_tiny(out, SEED, trained=trained, tokenizer_json=work / "tokenizer.json")
    info = json.loads((work / "tokens.json").read_text())
    (dest / "corpus.json").write_text(json.dumps(
        {k: info[k] for k in ("corpus", "sha256", "stream", "para_starts", "doc_spans")}) + "\n")
    shutil.copy(work / "train_log.json", dest / "train_log.json")
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--work", type=Path, required=True)
    t = sub.add_parser("train")
    t.add_argument("--work", type=Path, required=True)
    t.add_argument("--steps", type=int, default=1500)
    t.add_argument("--batch", type=int, default=16)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--device", default="cpu")
    t.add_argument("--time-limit", type=float, default=1e9,
                   help="stop (and save) after this many seconds; the learning-rate schedule follows it")
    e = sub.add_parser("export")
    e.add_argument("--work", type=Path, required=True)
    e.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.cmd == "prepare":
        prepare(a.work)
    elif a.cmd == "train":
        train(a.work, a.steps, a.batch, a.lr, a.device, time_limit_s=a.time_limit)
    else:
        print(export(a.work, a.out))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
