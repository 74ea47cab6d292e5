// http_ttft.js - time to first token of a stateless OpenAI client's second
// turn, which resends a long first message: with resume it prefills only the
// new turn, whatever the length (docs/benchmarks.md).
//   node http_ttft.js PORT TEXT_FILE     (e.g. xz -dc data/corpus/heldout.txt.xz > doc.txt)
"use strict";
const fs = require("fs");
const OpenAI = require("openai");
const port = process.argv[2];
const c = new OpenAI({ baseURL: `http://127.0.0.1:${port}/v1`, apiKey: "x", maxRetries: 0, timeout: 600000 });
const doc = fs.readFileSync(process.argv[3], "utf8");
async function ttft(messages) {
  const t0 = performance.now();
  let first = null, usage = null;
  const s = await c.chat.completions.create({ model: "default", messages, max_tokens: 8, temperature: 0, ignore_eos: true, stream: true, stream_options: { include_usage: true } });
  let text = "";
  for await (const ch of s) {
    const d = ch.choices[0]?.delta?.content;
    if (d && first === null) first = performance.now() - t0;
    if (d) text += d;
    if (ch.usage) usage = ch.usage;
  }
  return { ms: first, usage, text };
}
(async () => {
  for (const chars of [8000, 32000, 128000]) {
    const m = [{ role: "user", content: doc.slice(0, chars) }];
    const a = await ttft(m);
    m.push({ role: "assistant", content: a.text }, { role: "user", content: "Summarise." });
    const b = await ttft(m);
    console.log(`context ${b.usage.prompt_tokens} tokens: turn 1 ttft ${a.ms.toFixed(0)} ms (prefilled ${a.usage.prompt_tokens}); turn 2 ttft ${b.ms.toFixed(0)} ms, cached ${b.usage.prompt_tokens_details.cached_tokens}, prefilled ${b.usage.prompt_tokens - b.usage.prompt_tokens_details.cached_tokens}`);
  }
})();
