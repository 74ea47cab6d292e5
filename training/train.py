"""train.py - train the default model (pure KDA + MoE Kimi-Linear) on the CPU.

  /usr/bin/python3 training/prepare_data.py            # -> /tmp/kds_train/{train,heldout}.pt
  /usr/bin/python3 training/train.py --steps 1200 --time-budget 2280 \\
      --out /tmp/kds_train/ckpt.pt > /tmp/kds_train/train.log 2>&1 &

Random windows of --seq+1 tokens from the training ids (fresh state per
window), AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), linear warmup
then cosine decay to 10% of --lr. The schedule's progress is
max(step / steps, elapsed / time_budget), so a slow (shared) machine still
ends on a fully decayed learning rate inside the budget. MoE balance without
an auxiliary loss: after every step each router's e_score_correction_bias
moves by --bias-rate towards equal expert load (DeepSeek-V3 style).
Deterministic for a given seed and number of steps taken.
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
from model import KimiLinear  # noqa: E402

N_RANKS = 8192
N_SPECIAL = 256


def default_config():
    """The default model's config.json (complete Kimi-Linear field set)."""
    V = N_RANKS + N_SPECIAL
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_kimi.KimiLinearConfig",
            "AutoModel": "modeling_kimi.KimiLinearModel",
            "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM",
        },
        "model_type": "kimi_linear",
        "vocab_size": V,
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "intermediate_size": 768,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "mla_use_nope": True,
        "q_lora_rank": None,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "linear_attn_config": {
            "kda_layers": [1, 2, 3, 4],
            "full_attn_layers": [],
            "num_heads": 4,
            "head_dim": 64,
            "short_conv_kernel_size": 4,
        },
        "num_experts": 8,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "moe_intermediate_size": 128,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 2.446,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
        "model_max_length": 1048576,
        "bos_token_id": N_RANKS,          # [BOS]
        "eos_token_id": N_RANKS + 1,      # [EOS]: ends every training document
        "pad_token_id": N_RANKS + 255,    # [PAD]
        "initializer_range": 0.02,
        "use_cache": True,
    }


def param_groups(model, wd):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.dim() == 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


@torch.no_grad()
def evaluate(model, ids, seq, max_windows=None):
    """Mean next-token loss over non-overlapping windows of seq+1 tokens
    (each window from a fresh state; every token of a window is scored)."""
    model.eval()
    n = (len(ids) - 1) // seq
    if max_windows:
        n = min(n, max_windows)
    tot, cnt = 0.0, 0
    for b in range(0, n, 16):
        rows = [ids[i * seq: i * seq + seq + 1] for i in range(b, min(n, b + 16))]
        x = torch.stack(rows).long()
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                               reduction="sum")
        tot += loss.item()
        cnt += x[:, 1:].numel()
    model.train()
    return tot / cnt


def lr_at(progress, args):
    warm = args.warmup / args.steps
    if progress < warm:
        return args.lr * progress / warm
    p = min(1.0, (progress - warm) / (1 - warm))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/tmp/kds_train")
    ap.add_argument("--out", default="/tmp/kds_train/ckpt.pt")
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--time-budget", type=float, default=2280.0, help="seconds")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--bias-rate", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--bench", type=int, default=0, help="time N steps and exit")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    cfg = default_config()
    model = KimiLinear(cfg)
    model.set_kda_mode("ext")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params:,} ({n_params * 2 / 1e6:.2f} MB as bf16)", flush=True)
    train = torch.load(os.path.join(args.data, "train.pt"))
    held = torch.load(os.path.join(args.data, "heldout.pt"))
    print(f"train tokens {len(train):,}, held-out tokens {len(held):,}", flush=True)

    opt = torch.optim.AdamW(param_groups(model, args.wd), lr=args.lr, betas=(0.9, 0.95),
                            eps=1e-8)
    gen = torch.Generator().manual_seed(args.seed)
    L = args.seq + 1
    t0 = time.time()
    tokens = 0
    ema = None
    step = 0
    for step in range(1, args.steps + 1):
        elapsed = time.time() - t0
        progress = max((step - 1) / args.steps, elapsed / args.time_budget)
        if progress >= 1.0:
            print(f"time budget reached at step {step - 1}", flush=True)
            step -= 1
            break
        lr = lr_at(progress, args)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(train) - L, (args.batch,), generator=gen)
        x = torch.stack([train[s: s + L] for s in starts.tolist()]).long()
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for moe in model.moe_layers():
                load = moe.last_load.float()
                moe.gate.e_score_correction_bias += args.bias_rate * torch.sign(load.mean() - load)
        tokens += x[:, 1:].numel()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if args.bench:
            if step == 2:
                t_b = time.time()
            if step >= args.bench:
                dt = time.time() - t_b
                print(f"bench: steps 3..{step}: {dt / (step - 2):.2f} s/step, "
                      f"{(step - 2) * x[:, 1:].numel() / dt:.0f} tokens/s")
                return
        if step % 10 == 0:
            dt = time.time() - t0
            print(f"step {step} loss {loss.item():.4f} ema {ema:.4f} lr {lr:.2e} gnorm {gn:.2f} "
                  f"tok/s {tokens / dt:.0f} elapsed {dt:.0f}s", flush=True)
        if step % args.eval_every == 0:
            hl = evaluate(model, held, args.seq, max_windows=32)
            loads = [moe.last_load.tolist() for moe in model.moe_layers()]
            print(f"eval step {step}: held-out loss {hl:.4f} ppl {math.exp(hl):.1f} "
                  f"expert load {loads}", flush=True)
            torch.save({"cfg": cfg, "state": model.state_dict(), "step": step}, args.out)

    dt = time.time() - t0
    hl = evaluate(model, held, args.seq)
    tl = evaluate(model, train[: len(held)], args.seq)
    print(f"done: {step} steps, {tokens:,} tokens, {dt:.0f} s; "
          f"train-sample loss {tl:.4f} (ppl {math.exp(tl):.1f}), "
          f"held-out loss {hl:.4f} (ppl {math.exp(hl):.1f})", flush=True)
    torch.save({"cfg": cfg, "state": model.state_dict(), "step": step,
                "train_seconds": dt, "tokens": tokens, "args": vars(args),
                "final": {"train_loss": tl, "heldout_loss": hl}}, args.out)
    json.dump({"steps": step, "tokens": tokens, "seconds": dt, "train_loss": tl,
               "heldout_loss": hl, "args": vars(args)},
              open(os.path.splitext(args.out)[0] + ".json", "w"), indent=1)


if __name__ == "__main__":
    main()
