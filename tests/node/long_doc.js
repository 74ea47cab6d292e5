#!/usr/bin/env node
// long_doc.js - a long document attached to a session, then resumed by a
// stateless OpenAI client with no replay (docs/benchmarks.md, "A
// 1,000,000-token document"). For each size in --sizes (bytes of the text
// file's start, cut on a line end):
//
//   ingest  a fresh plain-mode session `--prefix-SIZE` takes the document:
//           --via ws    over WebSocket `append` (docs/protocol.md), 512 KiB
//                       chunks, each sent after the answer to the last;
//           --via page  through the web page in headless Chromium (the
//                       "attach file" button, as a user would);
//           --via api   as the prompt of a first /v1/completions request
//                       (a long prompt is a long body, docs/http-api.md).
//           Prints progress (tokens, tok/s, ETA) as it goes.
//   resume  POST /v1/completions with the official `openai` client, stream
//           on: the same text plus a question. Reports the time to the first
//           token and usage (prompt tokens, cached tokens = the tokens that
//           came from the stored state, so prompt - cached were prefilled).
//
// --phase ingest | resume | both (default both). Run `ingest`, restart the
// server, run `resume`: the stored states carry across restarts.
//
//   node long_doc.js --url http://127.0.0.1:PORT/ --file DOC.txt
//        [--sizes 36000,360000,3600000] [--via ws|page|api] [--phase P]
//        [--prefix NAME] [--json FILE]
//
// Exit status 0 when every step worked and every resume found its document
// (cached tokens within 512 of the document's tokens), 1 otherwise, 2 for
// bad usage.
"use strict";
const fs = require("fs");
const { KdsClient, nowMs, describe } = require("./ws_client.js");

function usage(msg) {
  if (msg) console.error(`long_doc.js: ${msg}`);
  console.error("usage: node long_doc.js --url http://HOST:PORT/ --file DOC [--sizes B,B,...] " +
                "[--via ws|page|api] [--phase ingest|resume|both] [--prefix NAME] [--json FILE]");
  process.exit(msg ? 2 : 0);
}

const opt = { sizes: [36000, 360000, 3600000], via: "ws", phase: "both", prefix: "longdoc" };
{
  const a = process.argv.slice(2);
  for (let i = 0; i < a.length; i++) {
    const k = a[i];
    const v = () => (i + 1 < a.length ? a[++i] : usage(`${k} needs a value`));
    if (k === "--help" || k === "-h") usage();
    else if (k === "--url") opt.url = v().replace(/\/+$/, "");
    else if (k === "--file") opt.file = v();
    else if (k === "--sizes") opt.sizes = v().split(",").map(Number);
    else if (k === "--via") opt.via = v();
    else if (k === "--phase") opt.phase = v();
    else if (k === "--prefix") opt.prefix = v();
    else if (k === "--json") opt.json = v();
    else usage(`unknown argument '${k}'`);
  }
  if (!opt.url || !/^http:\/\//.test(opt.url)) usage("--url http://HOST:PORT/ is required");
  if (!opt.file) usage("--file is required");
  if (!["ws", "page", "api"].includes(opt.via)) usage("--via: ws, page or api");
  if (!["ingest", "resume", "both"].includes(opt.phase)) usage("--phase: ingest, resume or both");
  if (!opt.sizes.every((n) => Number.isInteger(n) && n > 0)) usage("--sizes: positive integers");
}

const QUESTION = "\n\nQuestion: what happens next?\nAnswer:";
const full = fs.readFileSync(opt.file);
// The first `bytes` of the file, cut after a line end (so the text ends the
// same way whatever comes after it, and never inside a character).
function docOf(bytes) {
  if (bytes >= full.length) return full.toString("utf8");
  let end = full.lastIndexOf(0x0a, bytes - 1) + 1;
  if (end <= 0) end = bytes;
  return full.subarray(0, end).toString("utf8");
}
const fmt = (s) => (s < 60 ? `${s.toFixed(0)} s` : `${Math.floor(s / 60)}:${String(Math.round(s % 60)).padStart(2, "0")}`);

async function ingestWs(session, text) {
  const c = await KdsClient.connect(opt.url.replace(/^http/, "ws") + "/");
  const r = await c.request({ op: "create", session, mode: "plain" });
  if (r.event !== "result") throw new Error(`create ${session}: ${describe(r)}`);
  const buf = Buffer.from(text, "utf8"), CHUNK = 512 * 1024;
  const id = c.nextId++;
  let tLast = 0;
  const t0 = nowMs();
  for (let off = 0; off < buf.length; off += CHUNK) {
    const last = off + CHUNK >= buf.length;
    const req = { id: off ? c.nextId++ : id, op: "append", session,
                  data: buf.subarray(off, off + CHUNK).toString("base64"), last };
    if (!off) Object.assign(req, { name: `${session}.txt`, size: buf.length });
    const a = await c.request(req, { timeoutMs: 3600000 });
    if (a.event !== "result") throw new Error(`chunk at ${off}: ${describe(a)}`);
    for (let p; (p = c.peek((e) => e.id === id && e.event === "progress"));) {
      c.next((e) => e === p);
      if (nowMs() - tLast > 5000) {
        tLast = nowMs();
        console.error(`  ${session}: ${p.tokens} of ${p.total} tokens, ${Math.round(p.tok_s)} tok/s` +
                      (p.eta_s != null ? `, ETA ${fmt(p.eta_s)}` : ""));
      }
    }
  }
  const done = await c.next((e) => e.id === id && e.event === "done", 3600000, "the document's done");
  await c.close();
  if (done.reason !== "complete") throw new Error(`done: ${describe(done)}`);
  return { tokens: done.document.tokens, context: done.context, wall_s: (nowMs() - t0) / 1000,
           tok_s: done.tok_s };
}

async function ingestPage(session, text) {
  const { chromium } = require("playwright-core");
  const browser = await chromium.launch({ executablePath: process.env.KDS_CHROMIUM || "/usr/bin/chromium",
                                          args: ["--no-sandbox"] });
  try {
    const page = await browser.newPage();
    const tid = (t) => `[data-testid="${t}"]`;
    await page.goto(opt.url + "/");
    await page.waitForSelector(tid("btn-new") + ":not([disabled])", { timeout: 30000 });
    await page.click(tid("btn-new"));
    await page.fill(tid("dialog-name"), session);
    await page.selectOption(tid("dialog-mode"), "plain");
    await page.click(tid("dialog-ok"));
    await page.waitForSelector(tid("session-item") + `[data-session="${session}"][aria-selected="true"]`);
    const t0 = nowMs();
    await page.setInputFiles(tid("file-input"), { name: `${session}.txt`, mimeType: "text/plain",
                                                  buffer: Buffer.from(text, "utf8") });
    for (let tLast = nowMs(); ;) {
      const st = await page.evaluate(() => {
        const s = document.querySelector("#ingest-status");
        return { state: s.dataset.state, text: s.textContent };
      });
      if (st.state === "done") break;
      if (st.state === "error") throw new Error(`the page says: ${st.text}`);
      if (nowMs() - tLast > 5000) {
        tLast = nowMs();
        console.error(`  ${session} (page): ${st.text.trim()}`);
      }
      await new Promise((r) => setTimeout(r, 100));
    }
    const d = await page.evaluate(() => {
      const m = document.querySelector('[data-testid="msg-document"]');
      return m ? { tokens: +m.dataset.tokens, bytes: +m.dataset.bytes } : null;
    });
    if (!d) throw new Error("no document in the page's history");
    return { tokens: d.tokens, wall_s: (nowMs() - t0) / 1000 };
  } finally {
    await browser.close();
  }
}

function client() {
  const OpenAI = require("openai");
  return new OpenAI({ baseURL: `${opt.url}/v1`, apiKey: "x", maxRetries: 0, timeout: 3600000 });
}

// One streamed completion: time to the first text, the text, usage.
async function complete(prompt, session) {
  const t0 = nowMs();
  let first = null, usage = null, text = "";
  const s = await client().completions.create({ model: "default", prompt, max_tokens: 8, temperature: 0,
                                                stream: true, stream_options: { include_usage: true },
                                                ...(session ? { session } : {}) });
  for await (const ch of s) {
    const d = ch.choices[0] && ch.choices[0].text;
    if (d && first === null) first = nowMs() - t0;
    if (d) text += d;
    if (ch.usage) usage = ch.usage;
  }
  return { ttft_ms: first, total_ms: nowMs() - t0, usage, text };
}

(async () => {
  const rows = [];
  let bad = 0;
  for (const size of opt.sizes) {
    const text = docOf(size), session = `${opt.prefix}-${size}`;
    const row = { size_bytes: Buffer.byteLength(text), session, via: opt.via };
    try {
      if (opt.phase !== "resume") {
        console.error(`${session}: ingesting ${row.size_bytes} bytes via ${opt.via}`);
        if (opt.via === "ws") row.ingest = await ingestWs(session, text);
        else if (opt.via === "page") row.ingest = await ingestPage(session, text);
        else {
          const r = await complete(text, session);
          row.ingest = { tokens: r.usage.prompt_tokens, wall_s: r.total_ms / 1000 };
        }
        row.ingest.tok_s = row.ingest.tok_s || row.ingest.tokens / row.ingest.wall_s;
        console.error(`${session}: ${row.ingest.tokens} tokens in ${row.ingest.wall_s.toFixed(1)} s`);
      }
      if (opt.phase !== "ingest") {
        const r = await complete(text + QUESTION);
        row.resume = { ttft_ms: r.ttft_ms, prompt_tokens: r.usage.prompt_tokens,
                       cached_tokens: r.usage.prompt_tokens_details.cached_tokens,
                       prefilled: r.usage.prompt_tokens - r.usage.prompt_tokens_details.cached_tokens };
        // the stored state is the document up to one prefill slice before its
        // end (docs/http-api.md, "Resume points"): 512 covers the default --prefill-slice 256
        const doc = row.ingest ? row.ingest.tokens : r.usage.prompt_tokens - 16;
        if (row.resume.cached_tokens < doc - 512) {
          bad++;
          console.error(`${session}: only ${row.resume.cached_tokens} cached tokens of ${r.usage.prompt_tokens}: ` +
                        "the stored document was not found");
        }
      }
    } catch (e) {
      bad++;
      row.error = e.message;
      console.error(`${session}: ${e.message}`);
    }
    console.log(JSON.stringify(row));
    rows.push(row);
  }
  if (opt.json) fs.writeFileSync(opt.json, JSON.stringify({ url: opt.url, file: opt.file, rows }, null, 1) + "\n");
  console.log("\n| document | via | ingest: tokens, s, tok/s | resume: prompt tokens | cached | prefilled | TTFT ms |");
  console.log("|---:|---|---:|---:|---:|---:|---:|");
  for (const r of rows) {
    const i = r.ingest ? `${r.ingest.tokens}, ${r.ingest.wall_s.toFixed(1)}, ${Math.round(r.ingest.tok_s)}` : "-";
    const s = r.resume || {};
    console.log(`| ${r.size_bytes} B | ${r.via} | ${i} | ${s.prompt_tokens ?? "-"} | ${s.cached_tokens ?? "-"} | ` +
                `${s.prefilled ?? "-"} | ${s.ttft_ms != null ? s.ttft_ms.toFixed(0) : "-"} |`);
  }
  process.exit(bad ? 1 : 0);
})();
