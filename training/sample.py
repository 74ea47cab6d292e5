"""sample.py - continue prompts with the exported model (models/default) in
PyTorch, to check that it writes English.

  /usr/bin/python3 training/sample.py [--model DIR] [--tokens 60] [--temp 0.8]
      [--top-k 40] [--seed 1] [PROMPT ...]
"""
import argparse
import json
import os
import sys

import torch

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
import st  # noqa: E402
from model import KimiLinear  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

PROMPTS = ["It is a truth universally", "Call me Ishmael.", "\"My dear Mr. Bennet,\" said",
           "The whale", "A man who"]


def load(d):
    cfg = json.load(open(os.path.join(d, "config.json")))
    m = KimiLinear(cfg)
    sd = {k: v.float() for k, v in st.load(os.path.join(d, "model.safetensors")).items()}
    m.load_state_dict(sd)
    m.eval()
    m.set_kda_mode("ext")
    return m, cfg


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(os.path.dirname(here), "models/default"))
    ap.add_argument("--tokens", type=int, default=60)
    ap.add_argument("--temp", type=float, default=0.8)
    ap.add_argument("--top-k", type=int, default=40)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("prompts", nargs="*")
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    m, cfg = load(args.model)
    tok = Tokenizer(args.model)
    eos = cfg["eos_token_id"]
    for p in args.prompts or PROMPTS:
        ids = tok.encode(p)
        with torch.no_grad():
            for _ in range(args.tokens):
                logits = m(torch.tensor([ids]))[0, -1]
                if args.temp <= 0:
                    nxt = int(logits.argmax())
                else:
                    v, i = torch.topk(logits / args.temp, args.top_k)
                    nxt = int(i[torch.multinomial(torch.softmax(v, -1), 1)])
                if nxt == eos:
                    break
                ids.append(nxt)
        print(repr(tok.decode(ids)))
        print()


if __name__ == "__main__":
    main()
