"""check_tokenizer.py - compare tokenizer.py's ids with OpenAI tiktoken's
(npm tiktoken@1.0.22, its Rust BPE compiled to wasm, run by node through
tests/node/ref_encode.js) on the same 8,192 ranks and the cl100k pattern.

  (cd tests/node && npm ci)     # once; installs tiktoken@1.0.22
  /usr/bin/python3 training/check_tokenizer.py

Texts: every held-out document, every 7th training document, and a few
hand-made strings (contractions, numbers, whitespace runs, non-ASCII).
"""
import base64
import os
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
from prepare_data import ROOT, docs  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

EXTRA = ["It is a truth universally acknowledged, that a single man",
         "I'LL go; she'S here, they'Re 've 'd 'm 'll 't",
         "12345678 3.14159 1,000,000", "  \n\n\t  x   y\r\n\r\n   ",
         "naïve café — “quoted” ‘single’ … 中文 emoji 🐳 e\u0301",
         "[EOS] <|im_end|> specials are plain text here"]


def main():
    model_dir = os.path.join(ROOT, "models/default")
    tok = Tokenizer(model_dir)
    texts = docs(os.path.join(ROOT, "data/corpus/heldout.txt.xz"))
    texts += docs(os.path.join(ROOT, "data/corpus/train.txt.xz"))[::7]
    texts += EXTRA
    inp = "".join(base64.b64encode(t.encode()).decode() + "\n" for t in texts)
    ref = subprocess.run(["node", os.path.join(ROOT, "tests/node/ref_encode.js"), "custom",
                          "ordinary", os.path.join(model_dir, "tiktoken.model"), "cl100k"],
                         input=inp.encode(), capture_output=True, check=True).stdout.decode()
    ref = ref.split("\n")[: len(texts)]
    bad, n_tok = 0, 0
    for t, r in zip(texts, ref):
        want = [int(x) for x in r.split()]
        got = tok.encode(t)
        n_tok += len(want)
        if got != want:
            bad += 1
            if bad <= 3:
                print("MISMATCH:", repr(t[:80]), got[:20], want[:20])
        assert tok.decode(got) == t
    print(f"{len(texts)} texts, {n_tok} tokens: {len(texts) - bad} identical to tiktoken, "
          f"{bad} differ")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
