"""tokenizer.py - tiktoken-exact byte-level BPE in plain Python.

Reads a tiktoken rank file ("base64-token rank" lines; here the first 8,192
ranks of cl100k_base) and encodes text exactly as OpenAI's tiktoken does with
the same ranks and the cl100k pre-tokenisation pattern: the text is split by
the regex, every piece that is itself a token becomes that token, every other
piece is merged pairwise by lowest rank (tiktoken's `_byte_pair_merge`).
Ranks missing from the file are simply never merged; since all 256 single
bytes are present, every text encodes. `check_tokenizer.py` compares the ids
with tiktoken's own encoder (npm tiktoken@1.0.22, run by node).

Needs Debian's python3-regex (for \\p{L}, \\p{N}).
"""
import base64
import json
import os

import regex

CL100K_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
                  r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


def load_ranks(path):
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def bpe(piece, ranks):
    """tiktoken's byte-pair merge of one pre-token (bytes) -> list of ids."""
    if piece in ranks:
        return [ranks[piece]]
    parts = [bytes([b]) for b in piece]
    while len(parts) > 1:
        best, best_i = None, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and (best is None or r < best):
                best, best_i = r, i
        if best is None:
            break
        parts[best_i:best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return [ranks[p] for p in parts]


class Tokenizer:
    """Ranks + cl100k pattern + named specials (ids >= number of ranks)."""

    def __init__(self, model_dir):
        self.ranks = load_ranks(os.path.join(model_dir, "tiktoken.model"))
        self.n_ranks = len(self.ranks)
        self.decoder = {r: t for t, r in self.ranks.items()}
        cfg = json.load(open(os.path.join(model_dir, "tokenizer_config.json")))
        self.specials = {v["content"]: int(k) for k, v in cfg["added_tokens_decoder"].items()}
        self.special_names = {i: n for n, i in self.specials.items()}
        self.pattern = regex.compile(CL100K_PATTERN)
        self.cache = {}

    def encode(self, text):
        """Ordinary text (special-token names are plain text) -> ids."""
        out = []
        for m in self.pattern.finditer(text):
            piece = m.group().encode("utf-8")
            ids = self.cache.get(piece)
            if ids is None:
                ids = bpe(piece, self.ranks)
                if len(self.cache) < 1_000_000:
                    self.cache[piece] = ids
            out.extend(ids)
        return out

    def decode_bytes(self, ids):
        return b"".join(self.decoder[i] if i in self.decoder
                        else self.special_names.get(i, "").encode() for i in ids)

    def decode(self, ids):
        return self.decode_bytes(ids).decode("utf-8", errors="replace")
