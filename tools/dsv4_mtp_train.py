"""Train the MTP layer of the tiny DeepSeek V4 (models/dsv4-tiny-gpl3) with the main model frozen,
then write only the MTP tensors back into the checkpoint (every other tensor keeps its bytes).

    python -m tools.dsv4_mtp_train --model models/dsv4-tiny-gpl3 \
        [--time-limit 420] [--steps 400] [--batch 4] [--lr 3e-3] [--samples 40] [--dry-run]

Objective (DeepSeek's MTP, depth 1): at position t the layer gets the main model's last hidden
streams at t (before its hc head) and the embedding of token t + 1, and predicts token t + 2
through the shared head; cross-entropy over the positions of samples of BOS + SEQ_LEN - 1 tokens
of the corpus stream starting at paragraphs (the main model's training samples,
tools/dsv4_train.py, same corpus.json). The main model is the committed, quantized checkpoint run
by the e2e oracle (tests/e2e/dsv4_oracle.py: FP8/MXFP4 weights decoded, vLLM's run-time FP8 KV and
indexer steps), so the MTP layer learns the hidden states vLLM feeds it; they are computed once,
without gradients, for `--samples` samples.

The forward is the MTP reference (tests/e2e/dsv4_mtp_reference.py) in float32, started from the
seed's float weights of tools/dsv4_tiny.py (the draws the random MTP layer was encoded from) and
with vLLM's position-0 embedding mask. Trained: every MTP tensor but the router bias (DeepSeek
sets it by load balancing, not by gradient) and the shared embedding and head. AdamW, warm-up then
cosine to 10% over the steps or the time limit, gradient clip 1.0, seeded (torch and the sample
order; float reductions make it not bitwise reproducible across machines, so the result is
committed). The loss curve and the held-out next-next-token accuracy before and after go to
`<model>/mtp_train_log.json`.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SEQ_LEN = 512
SEED = 0


def sample_starts(info: dict, n: int, seed: int) -> list[int]:
    starts = [s for s in info["para_starts"] if s + SEQ_LEN - 1 <= len(info["stream"])]
    rng = random.Random(seed)
    return sorted(rng.sample(starts, min(n, len(starts))))


def main_hidden(model_dir: Path, info: dict, starts: list[int], bos: int):
    """(ids [N, SEQ_LEN], hidden [N, SEQ_LEN, hc, d] float32): the frozen main model's last hidden
    streams (the input of its hc head) for each sample."""
    import torch

    from tests.e2e.dsv4_oracle import Dsv4Oracle

    o = Dsv4Oracle(model_dir)
    got = {}
    o.model.model.hc_head.register_forward_hook(lambda m, a, out: got.__setitem__("h", a[0].detach()))
    ids, hid = [], []
    for s in starts:
        row = [bos] + info["stream"][s:s + SEQ_LEN - 1]
        o.logprobs(row)
        ids.append(torch.tensor(row))
        hid.append(got["h"][0].float().clone())
    return o, torch.stack(ids), torch.stack(hid)


def mtp_loss(ref, ids, hid):
    """Mean cross-entropy of token t + 2 from (hidden t, token t + 1); and top-1 accuracy."""
    import torch
    import torch.nn.functional as F

    b, s = ids.shape
    pos = torch.arange(s - 1).expand(b, -1)
    x = ref(ids[:, 1:], pos, hid[:, :-1])
    logits = ref.logits(x)[:, :-1]  # the last row's target (token s + 1) is outside the sample
    tgt = ids[:, 2:]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1))
    acc = (logits.argmax(-1) == tgt).float().mean()
    return loss, acc


def encode_mtp(trained: dict, cfg: dict) -> dict:
    """Trained float MTP tensors -> the checkpoint's formats (dsv4_tiny's encoders and format table)."""
    import torch

    from tools import dsv4_tiny

    fmts = {name: fmt for name, (fmt, _) in dsv4_tiny._draw(cfg, SEED).items() if name.startswith("mtp.")}
    if set(fmts) != set(trained):
        raise SystemExit(f"trained MTP tensors differ from the checkpoint's: "
                         f"{sorted(set(fmts) ^ set(trained))[:8]}")
    out = {}
    for name, fmt in fmts.items():
        t = trained[name].double()
        if fmt in ("fp8", "mxfp4"):
            base = name.removesuffix(".weight")
            q, s = (dsv4_tiny.encode_fp8_block if fmt == "fp8" else dsv4_tiny.encode_mxfp4)(t)
            out[base + ".weight"], out[base + ".scale"] = q, s
        else:
            out[name] = t.to({"bf16": torch.bfloat16, "f32": torch.float32, "i32": torch.int32}[fmt])
    return out


def write_mtp(model_dir: Path, encoded: dict) -> None:
    """Replace the mtp.* tensors of model.safetensors; assert every other tensor is unchanged."""
    import torch
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    old = load_file(str(path))
    mtp_old = {k for k in old if k.startswith("mtp.")}
    if mtp_old != set(encoded):
        raise SystemExit(f"{path}: MTP tensor names differ: {sorted(mtp_old ^ set(encoded))[:8]}")
    for k, t in encoded.items():
        if t.shape != old[k].shape or t.dtype != old[k].dtype:
            raise SystemExit(f"{k}: {t.dtype} {tuple(t.shape)} would replace {old[k].dtype} {tuple(old[k].shape)}")
    new = dict(old)
    new.update(encoded)
    save_file(new, str(path), metadata={"format": "pt"})
    back = load_file(str(path))
    for k, t in old.items():
        if not k.startswith("mtp."):
            assert back[k].view(-1).view(torch.uint8).equal(t.view(-1).view(torch.uint8)), k


def run(a) -> dict:
    import torch

    from tests.e2e.dsv4_mtp_reference import MtpReference
    from tools import dsv4_tiny

    torch.manual_seed(SEED)
    model_dir = Path(a.model)
    cfg = json.loads((model_dir / "config.json").read_text())
    info = json.loads((model_dir / "corpus.json").read_text())
    starts = sample_starts(info, a.samples + a.held_out, SEED)
    rng = random.Random(SEED)
    rng.shuffle(starts)
    t0 = time.time()
    o, ids, hid = main_hidden(model_dir, info, starts, cfg["bos_token_id"])
    o_native = o.native
    hidden_s = time.time() - t0
    train_ids, train_hid = ids[:a.samples], hid[:a.samples]
    held_ids, held_hid = ids[a.samples:], hid[a.samples:]
    # start: the seed's float MTP draws (as the main training started from its draws); shared
    # embedding and head: the committed checkpoint's (what vLLM shares with the MTP layer)
    init = {k: v for k, v in dsv4_tiny.float_weights(cfg, SEED).items() if k.startswith("mtp.")}
    init.update({k: o_native[k] for k in ("embed.weight", "head.weight")})
    ref = MtpReference(cfg, init, dtype=torch.float32, mask_position0=True, runtime_quant=True)
    ref.block.mlp.gate.e_score_correction_bias.requires_grad_(False)
    params = [p for p in ref.parameters() if p.requires_grad]

    def evaluate():
        with torch.no_grad():
            ref.eval()
            ls, acc = zip(*[mtp_loss(ref, held_ids[i:i + 1], held_hid[i:i + 1]) for i in range(len(held_ids))])
            ref.train()
        return round(float(sum(ls) / len(ls)), 4), round(float(sum(acc) / len(acc)), 4)

    before = evaluate()
    print(json.dumps({"held_out_before": before, "hidden_s": round(hidden_s, 1)}), flush=True)
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warm, t1 = max(1, a.steps // 20), time.time()

    def lr_factor(s: int) -> float:
        done = min(1.0, max(s / a.steps, (time.time() - t1) / a.time_limit))
        return min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    curve = []
    for step in range(a.steps):
        idx = [rng.randrange(len(train_ids)) for _ in range(a.batch)]
        loss, acc = mtp_loss(ref, train_ids[idx], train_hid[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        over = time.time() - t1 > a.time_limit
        if step % 10 == 0 or step == a.steps - 1 or over:
            curve.append({"step": step, "loss": round(loss.item(), 4), "acc": round(acc.item(), 4),
                          "lr": sched.get_last_lr()[0], "s": round(time.time() - t1, 1)})
            print(json.dumps(curve[-1]), flush=True)
        if over:
            break
    after = evaluate()
    log = {"objective": "token t+2 from the main model's last hidden streams at t and token t+1",
           "steps_run": curve[-1]["step"] + 1, "steps": a.steps, "batch": a.batch, "seq_len": SEQ_LEN,
           "lr": a.lr, "samples": a.samples, "held_out_samples": a.held_out, "seed": SEED,
           "train_s": round(time.time() - t1, 1), "hidden_s": round(hidden_s, 1),
           "held_out_loss_acc_before": before, "held_out_loss_acc_after": after,
           "torch": torch.__version__, "threads": torch.get_num_threads(), "loss_curve": curve}
    print(json.dumps({k: v for k, v in log.items() if k != "loss_curve"}), flush=True)
    if not a.dry_run:
        write_mtp(model_dir, encode_mtp(ref.native_state(), cfg))
        (model_dir / "mtp_train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    return log


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / "models" / "dsv4-tiny-gpl3"))
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--held-out", type=int, default=4)
    ap.add_argument("--time-limit", type=float, default=420.0,
                    help="stop (and save) after this many seconds; the learning-rate schedule follows it")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dry-run", action="store_true", help="train and report, write nothing")
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    run(a)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
