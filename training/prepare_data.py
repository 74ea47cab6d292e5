"""prepare_data.py - tokenise the committed corpus (data/corpus/*.txt.xz) with
the default model's tokenizer into token-id files for training.

  /usr/bin/python3 training/prepare_data.py [OUT_DIR]     (default /tmp/kds_train)

Documents are separated in the corpus by a line "[EOS]"; each document is
encoded as ordinary text and followed by the [EOS] id. Writes
OUT_DIR/{train,heldout}.pt (int16 tensors) and prints token counts.
"""
import lzma
import os
import sys
import time

import torch

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
from tokenizer import Tokenizer  # noqa: E402

ROOT = os.path.dirname(here)
SEP = "\n[EOS]\n"


def docs(path):
    text = lzma.open(path, "rt", encoding="utf-8").read()
    assert text.endswith(SEP)
    return text[: -len(SEP)].split(SEP)


def encode_docs(tok, ds):
    eos = tok.specials["[EOS]"]
    ids = []
    for d in ds:
        ids.extend(tok.encode(d))
        ids.append(eos)
    return ids


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/kds_train"
    os.makedirs(out, exist_ok=True)
    tok = Tokenizer(os.path.join(ROOT, "models/default"))
    for split in ("train", "heldout"):
        t0 = time.time()
        src = os.path.join(ROOT, "data/corpus", f"{split}.txt.xz")
        ds = docs(src)
        ids = encode_docs(tok, ds)
        nbytes = sum(len(d.encode()) for d in ds)
        torch.save(torch.tensor(ids, dtype=torch.int16), os.path.join(out, f"{split}.pt"))
        print(f"{split}: {len(ds)} documents, {nbytes} bytes -> {len(ids)} tokens "
              f"({nbytes / len(ids):.2f} bytes/token, {time.time() - t0:.1f} s)")


if __name__ == "__main__":
    main()
