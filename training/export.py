"""export.py - write a trained checkpoint as a Hugging Face Kimi-Linear
directory, plus our own reference logits for the engine test.

  /usr/bin/python3 training/export.py --ckpt /tmp/kds_train/ckpt.pt --out models/default

Writes into OUT:
  config.json                 the complete Kimi-Linear config
  model.safetensors           matrices (embeddings, projections, experts,
                              router) as BF16; norm weights, A_log, dt_bias,
                              conv taps and the router correction bias as F32
  expected_heldout.safetensors
                              ids   I32 [T]   held-out token ids (T = 64)
                              logits F32 [T, vocab]  the PyTorch model's logits
                              text  U8 [n]    the UTF-8 text that encodes to ids
                              computed with the stored (bf16-rounded) weights
                              in float32 arithmetic, token-by-token KDA
                              recurrence (model.kda_recurrent)
  training.json               training and evaluation figures
The tokenizer files (tiktoken.model, tokenizer_config.json) come from
make_tokenizer.sh. Held-out perplexity is measured here on the exported
weights.
"""
import argparse
import json
import math
import os
import sys

import torch

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
import st  # noqa: E402
from model import KimiLinear  # noqa: E402
from prepare_data import ROOT, docs  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402
from train import evaluate  # noqa: E402


def evaluate_windows(model, flat, L):
    """Like evaluate() over windows already laid out back to back (L tokens each)."""
    import torch.nn.functional as F
    x = flat.view(-1, L).long()
    tot = 0.0
    with torch.no_grad():
        for b in range(0, len(x), 16):
            xb = x[b:b + 16]
            lg = model(xb[:, :-1])
            tot += F.cross_entropy(lg.reshape(-1, lg.shape[-1]), xb[:, 1:].reshape(-1),
                                   reduction="sum").item()
    return tot / (len(x) * (L - 1))

F32_SUFFIXES = ("layernorm.weight", "norm.weight", "A_log", "dt_bias", "conv1d.weight",
                "e_score_correction_bias")
T_REF = 64


def storage_dtype(name):
    return torch.float32 if name.endswith(F32_SUFFIXES) else torch.bfloat16


def reference_text(tok, model_dir_docs):
    """A held-out passage of about T_REF tokens whose text encodes to exactly
    those ids (cut at a pre-token boundary)."""
    text = model_dir_docs[0]
    ids = tok.encode(text)
    for n in range(T_REF, 0, -1):
        t = tok.decode(ids[:n])
        if tok.encode(t) == ids[:n]:
            return t, ids[:n]
    raise RuntimeError("no clean cut")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default="/tmp/kds_train/ckpt.pt")
    ap.add_argument("--out", default=os.path.join(ROOT, "models/default"))
    ap.add_argument("--data", default="/tmp/kds_train")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-eval", action="store_true", help="no perplexity (quick tests)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    ck = torch.load(args.ckpt)
    cfg = ck["cfg"]
    model = KimiLinear(cfg)
    model.load_state_dict(ck["state"])
    model.eval()

    # Round every tensor to its storage dtype and put the rounded values back,
    # so the reference below is computed from exactly the stored numbers.
    tensors = {}
    sd = model.state_dict()
    for name, t in sd.items():
        tensors[name] = t.detach().to(storage_dtype(name)).contiguous()
    with torch.no_grad():
        model.load_state_dict({k: v.float() for k, v in tensors.items()})
    os.makedirs(args.out, exist_ok=True)
    st.save(os.path.join(args.out, "model.safetensors"), tensors)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    n_params = sum(t.numel() for t in tensors.values())
    n_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"wrote {args.out}: {len(tensors)} tensors, {n_params:,} parameters, "
          f"{n_bytes:,} bytes of weights")

    # Reference logits on held-out text, exact recurrence, float32.
    tok = Tokenizer(args.out)
    held_docs = docs(os.path.join(ROOT, "data/corpus/heldout.txt.xz"))
    text, ids = reference_text(tok, held_docs)
    model.set_kda_mode("recurrent")
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0].float()
    st.save(os.path.join(args.out, "expected_heldout.safetensors"), {
        "ids": torch.tensor(ids, dtype=torch.int32),
        "logits": logits.contiguous(),
        "text": torch.tensor(list(text.encode("utf-8")), dtype=torch.uint8),
    })
    print(f"expected_heldout: {len(ids)} ids, text {text!r}")

    if args.skip_eval:
        return
    # Held-out perplexity of the exported weights: overall and per source
    # (the held-out documents are the 6 Austen novels' tails, Moby-Dick's
    # tail, then fortunes), and a training sample of the same size spread
    # evenly over the whole training stream.
    model.set_kda_mode("ext")
    held = torch.load(os.path.join(args.data, "heldout.pt"))
    train = torch.load(os.path.join(args.data, "train.pt"))
    lens = [len(tok.encode(d)) + 1 for d in held_docs]
    assert sum(lens) == len(held), "heldout.pt is not the tokenised heldout.txt.xz"
    a, m_ = sum(lens[:6]), sum(lens[:7])
    parts = {"austen": held[:a], "moby_dick": held[a:m_], "fortunes": held[m_:]}
    hl = evaluate(model, held, 256)
    per = {k: evaluate(model, v, 256) for k, v in parts.items()}
    n_win = (len(held) - 1) // 256
    stride = (len(train) - 257) // n_win
    sample = torch.cat([train[i * stride: i * stride + 257] for i in range(n_win)])
    tl = evaluate_windows(model, sample, 257)
    info = {
        "parameters": n_params,
        "weight_bytes": n_bytes,
        "heldout_tokens": len(held),
        "heldout_loss": round(hl, 4),
        "heldout_ppl": round(math.exp(hl), 2),
        "heldout_ppl_by_source": {k: round(math.exp(v), 2) for k, v in per.items()},
        "heldout_tokens_by_source": {k: len(v) for k, v in parts.items()},
        "heldout_bytes_per_token": round(sum(len(d.encode()) for d in held_docs) / len(held), 3),
        "train_sample_loss": round(tl, 4),
        "train_sample_ppl": round(math.exp(tl), 2),
        "eval": "mean next-token cross-entropy over non-overlapping 256-token windows "
                "(fresh state per window), exported weights, float32 math; the train sample "
                "is as many windows, evenly spaced over the training stream",
        "train_steps": ck.get("step"),
        "train_tokens": ck.get("tokens"),
        "train_seconds": round(ck.get("train_seconds", 0)),
        "train_args": ck.get("args"),
    }
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(info, f, indent=1)
        f.write("\n")
    print(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
