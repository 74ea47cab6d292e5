// ref_encode.js ENCODING MODE [RANKS PATTERN] - the reference encoder for
// kdaserve's tests: OpenAI tiktoken (its Rust core compiled to wasm, regexes
// by fancy-regex) from the tiktoken@1.0.22 npm package.
//
// stdin: one text per line, base64 of its UTF-8 bytes (so any text, newlines
// and NULs included, survives the trip). stdout: one line per text, the ids
// separated by spaces.
//   ENCODING  cl100k_base | o200k_base: tiktoken's own encoder;
//             custom: tiktoken's BPE over the "base64 rank" file RANKS with
//             the pre-tokeniser PATTERN (cl100k, o200k, or kimi: Kimi-K2's
//             pat_str, class intersections and all), no specials. With kimi,
//             the text is first cut as Kimi's Python encode() cuts it
//             (kimiSlices below).
//   MODE      ordinary (encode_ordinary: special-token text is plain text)
//             | all (encode(text, "all"): special-token text becomes specials)
"use strict";
const fs = require("fs");
const { get_encoding } = require("tiktoken");
const { Tiktoken } = require("tiktoken/lite");

const KIMI_PAT = require("./kimi_pat.js");

function patStr(name) {
  if (name === "kimi") return KIMI_PAT;
  const file = { cl100k: "cl100k_base", o200k: "o200k_base" }[name];
  if (!file) throw new Error(`unknown pattern ${name}`);
  return require(`tiktoken/encoders/${file}.json`).pat_str;
}

const [encName, mode, ranksFile, patName] = process.argv.slice(2);
let enc;
if (encName === "custom") {
  // The package's constructor reads "! RANK B64" lines.
  const lines = fs.readFileSync(ranksFile, "utf8").split("\n").filter(Boolean)
    .map((l) => { const [t, r] = l.split(" "); return `! ${r} ${t}`; });
  enc = new Tiktoken(lines.join("\n"), {}, patStr(patName));
} else {
  enc = get_encoding(encName);
}
// tokenization_kimi.py's encode() (after Llama 3's), ported line by line:
// tiktoken gets the text in chunks of 400,000 characters, each cut further
// so that no run of whitespace or of non-whitespace (str.isspace) is longer
// than 25,000 characters. Characters are code points, as in Python.
const PY_SPACE = /^[\t-\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]$/u;
function* splitRuns(chars, maxRun) {
  let len = 0, isSpace = chars.length > 0 ? PY_SPACE.test(chars[0]) : false, start = 0;
  for (let i = 0; i < chars.length; i++) {
    const now = PY_SPACE.test(chars[i]);
    if (isSpace !== now) { len = 1; isSpace = now; } else {
      len += 1;
      if (len > maxRun) { yield chars.slice(start, i).join(""); start = i; len = 1; }
    }
  }
  yield chars.slice(start).join("");
}
function kimiSlices(text) {
  const chars = Array.from(text), out = [];
  for (let i = 0; i < chars.length; i += 400000)
    for (const s of splitRuns(chars.slice(i, i + 400000), 25000)) out.push(s);
  return out;
}

const input = fs.readFileSync(0, "utf8").split("\n");
if (input.length && input[input.length - 1] === "") input.pop();
const out = [];
for (const b64 of input) {
  const text = Buffer.from(b64, "base64").toString("utf8");
  const parts = encName === "custom" && patName === "kimi" ? kimiSlices(text) : [text];
  const ids = [];
  for (const p of parts)
    for (const id of mode === "all" ? enc.encode(p, "all") : enc.encode_ordinary(p)) ids.push(id);
  out.push(ids.join(" "));
}
fs.writeFileSync(1, out.join("\n") + "\n");
enc.free();
