// bench.js ENCODING FILE REPEATS - encoding speed of the reference tokenizer
// (tiktoken@1.0.22: Rust core compiled to wasm) on FILE. Prints one JSON
// line with the median MB/s (10^6 UTF-8 input bytes per second) over REPEATS
// runs of encode_ordinary, after one warm-up run. Reading the file and
// decoding it to a JS string are not timed; passing the string into wasm
// (UTF-16 to UTF-8) is part of every encode call and is timed.
//   ENCODING  cl100k_base | o200k_base | kimi (Kimi's pattern over the
//             cl100k_base ranks: the same work as a Kimi vocabulary)
"use strict";
const fs = require("fs");
const { get_encoding } = require("tiktoken");
const { Tiktoken } = require("tiktoken/lite");

const [encName, file, repeatsArg] = process.argv.slice(2);
const repeats = Number(repeatsArg || 5);
const buf = fs.readFileSync(file);
const text = buf.toString("utf8");
let enc;
if (encName === "kimi") {
  const d = require("tiktoken/encoders/cl100k_base.json");
  enc = new Tiktoken(d.bpe_ranks, {}, require("./kimi_pat.js"));
} else {
  enc = get_encoding(encName);
}
let n = enc.encode_ordinary(text).length; // warm-up
const mbps = [];
for (let i = 0; i < repeats; i++) {
  const t0 = process.hrtime.bigint();
  n = enc.encode_ordinary(text).length;
  const s = Number(process.hrtime.bigint() - t0) / 1e9;
  mbps.push(buf.length / 1e6 / s);
}
mbps.sort((a, b) => a - b);
const r3 = (x) => Math.round(x * 1000) / 1000;
console.log(JSON.stringify({
  impl: `tiktoken@1.0.22 (node ${process.version})`, tokenizer: encName, bytes: buf.length,
  tokens: n, repeats, median_mbps: r3(mbps[Math.floor(repeats / 2)]), min_mbps: r3(mbps[0]),
  max_mbps: r3(mbps[repeats - 1]) }));
enc.free();
