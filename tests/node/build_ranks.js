// build_ranks.js OUTDIR - rebuild OpenAI's cl100k_base / o200k_base rank files
// from the tiktoken@1.0.22 npm package (encoders/*.json) into OUTDIR:
//   NAME.tiktoken       "base64 rank" lines sorted by rank (the official file)
//   NAME.specials.json  {"pat_str": ..., "special_tokens": {...}}
// and check each rank file against the sha256 of OpenAI's published file
// (../shared/reference/data-sources.md). Files are written to a temporary
// name and renamed, so concurrent runs never see half a file.
"use strict";
const fs = require("fs");
const path = require("path");
const crypto = require("crypto");

const OFFICIAL = {
  cl100k_base: "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
  o200k_base: "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
};

function writeAtomic(file, data) {
  const tmp = `${file}.tmp.${process.pid}`;
  fs.writeFileSync(tmp, data);
  fs.renameSync(tmp, file);
}

const out = process.argv[2];
if (!out) {
  console.error("usage: node build_ranks.js OUTDIR");
  process.exit(2);
}
fs.mkdirSync(out, { recursive: true });
for (const [name, sha] of Object.entries(OFFICIAL)) {
  const d = JSON.parse(fs.readFileSync(require.resolve(`tiktoken/encoders/${name}.json`), "utf8"));
  // Each bpe_ranks line is "! FIRST_RANK TOK TOK ...": tokens take consecutive ranks.
  const ranks = [];
  for (const line of d.bpe_ranks.split("\n")) {
    if (!line) continue;
    const f = line.split(" ");
    const start = Number(f[1]);
    for (let i = 2; i < f.length; i++) ranks.push([f[i], start + i - 2]);
  }
  ranks.sort((a, b) => a[1] - b[1]);
  const text = ranks.map(([t, r]) => `${t} ${r}\n`).join("");
  const got = crypto.createHash("sha256").update(text).digest("hex");
  if (got !== sha) {
    console.error(`build_ranks: ${name}: sha256 ${got} is not the official ${sha}`);
    process.exit(1);
  }
  writeAtomic(path.join(out, `${name}.specials.json`),
              JSON.stringify({ pat_str: d.pat_str, special_tokens: d.special_tokens }, null, 1) + "\n");
  writeAtomic(path.join(out, `${name}.tiktoken`), text);
  console.error(`build_ranks: ${name}: ${ranks.length} ranks, sha256 ${got} (official)`);
}
