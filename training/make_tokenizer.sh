#!/bin/sh
# make_tokenizer.sh - write the default model's tokenizer files:
#   tiktoken.model         the first 8,192 ranks of OpenAI's cl100k_base, from
#                          the npm package tiktoken@1.0.22 ("base64 rank" lines)
#   tokenizer_config.json  Kimi's layout: 256 special ids after the ranks
#                          (8192..8447), named ones at Kimi-K2's offsets
#
#   training/make_tokenizer.sh [OUT_DIR]     (default models/default)
#
# The full rank file is rebuilt first and checked against the sha256 of
# OpenAI's published cl100k_base.tiktoken; ranks 0..255 are the 256 single
# bytes, so the truncated file is still a complete byte-level BPE.
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$ROOT/models/default}
N=8192
WORK=$(mktemp -d /tmp/kds_vocab.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
npm pack --silent tiktoken@1.0.22 >/dev/null
tar xzf tiktoken-1.0.22.tgz package/encoders/cl100k_base.json
python3 - "$OUT/tiktoken.model" "$N" <<'PY'
import hashlib, json, sys
out, n = sys.argv[1], int(sys.argv[2])
d = json.load(open("package/encoders/cl100k_base.json"))
ranks = {}
for line in filter(None, d["bpe_ranks"].split("\n")):
    f = line.split(" ")
    for i, t in enumerate(f[2:]):
        ranks[t] = int(f[1]) + i
lines = [f"{t} {r}\n" for t, r in sorted(ranks.items(), key=lambda x: x[1])]
full = "".join(lines).encode()
sha = hashlib.sha256(full).hexdigest()
if sha != "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7":
    sys.exit(f"make_tokenizer: cl100k_base rebuilt with sha256 {sha}, not OpenAI's")
assert all(int(l.split()[1]) == i for i, l in enumerate(lines[:n]))
with open(out, "w") as o:
    o.writelines(lines[:n])
print(f"make_tokenizer: wrote {out} ({n} of {len(lines)} cl100k_base ranks)", file=sys.stderr)
PY
python3 "$ROOT/training/tokenizer_config.py" "$N" "$OUT/tokenizer_config.json"
