#!/usr/bin/env node
// ws_load.js - load test of `kdaserve serve` (docs/protocol.md): for each N
// in --conns, N WebSocket connections each create a fresh session and all
// start one generate of --tokens tokens at the same moment (sampling with a
// fixed seed per stream, so reruns ask for the same work). Reports, per N:
// aggregate tokens/s (all tokens / wall time from the first request to the
// last done), per-stream tokens/s (a stream's tokens after its first one /
// time from its first to its last token event), time to first token (send
// -> first token event) and inter-token latency as p50/p90/p99, and errors.
// A token event may carry several tokens (the protocol lets a server
// coalesce for a slow reader) and does not say how many, so "inter-token"
// is the gap between consecutive token events; tokens per event is
// reported beside it (1.0 means every gap is one token). The server's mean
// batch (sessions per decode step) during each run comes from its /metrics
// counters kdaserve_decode_rows_total / kdaserve_decode_steps_total (null
// when the server has no such counters). With --repeats R each level runs R
// times and the run with the median aggregate tokens/s is reported, with the
// range of the R aggregates beside it.
//
//   node ws_load.js --url ws://127.0.0.1:8080/ [--conns 1,8,32,64] [--tokens 128]
//        [--per-conn K] [--repeats R] [--seed 1] [--prompt TEXT] [--token T]
//        [--json FILE] [--markdown]
//
// --per-conn K: K sessions per connection (N connections x K streams).
// --turns T: every stream runs T turns one after the other on its session,
// turn k of stream i asking for --tokens x (1 + ((i + 3k) mod 4) / 4) tokens,
// so turns end (and their sessions save) at different moments while the
// other streams decode: the inter-token gaps then show what a save costs
// the streams around it (docs/benchmarks.md "Saves and the other streams").
// Gaps are measured inside a turn, never across done -> next generate.
// Exit status 0 when no stream had an error, 1 otherwise, 2 for bad usage.
"use strict";
const fs = require("fs");
const http = require("http");
const { KdsClient, nowMs, describe } = require("./ws_client.js");

function usage(msg) {
  const out = msg ? console.error : console.log;
  if (msg) console.error(`ws_load.js: ${msg}`);
  out("usage: node ws_load.js --url ws://HOST:PORT/ [--conns 1,8,32,64] [--tokens 128] " +
      "[--per-conn K] [--turns T] [--repeats R] [--seed S] [--prompt TEXT] [--token T] [--json FILE] [--markdown]\n" +
      "  N connections per level (--conns), each with its own fresh session, all generating\n" +
      "  --tokens tokens at once; prints aggregate and per-stream tokens/s, time to first\n" +
      "  token and inter-token latency percentiles, the server's mean batch (/metrics) and\n" +
      "  errors per level (docs/benchmarks.md). --token: auth token for an --auth-file server.");
  process.exit(msg ? 2 : 0);
}

const opt = { conns: [1, 8, 32, 64], tokens: 128, perConn: 1, turns: 1, repeats: 1, seed: 1,
              prompt: "It is a truth universally acknowledged", markdown: false };
{
  const a = process.argv.slice(2);
  for (let i = 0; i < a.length; i++) {
    const k = a[i];
    const v = () => (i + 1 < a.length ? a[++i] : usage(`${k} needs a value`));
    if (k === "--help" || k === "-h") usage();
    else if (k === "--url") opt.url = v();
    else if (k === "--conns") opt.conns = v().split(",").map(Number);
    else if (k === "--tokens") opt.tokens = Number(v());
    else if (k === "--per-conn") opt.perConn = Number(v());
    else if (k === "--turns") opt.turns = Number(v());
    else if (k === "--repeats") opt.repeats = Number(v());
    else if (k === "--seed") opt.seed = Number(v());
    else if (k === "--prompt") opt.prompt = v();
    else if (k === "--token") opt.token = v();
    else if (k === "--json") opt.json = v();
    else if (k === "--markdown") opt.markdown = true;
    else usage(`unknown argument '${k}'`);
  }
  if (!opt.url) usage("--url is required");
  if (!opt.conns.every((n) => Number.isInteger(n) && n > 0)) usage("--conns: positive integers");
  if (!(Number.isInteger(opt.tokens) && opt.tokens > 0)) usage("--tokens: a positive integer");
  if (!(Number.isInteger(opt.perConn) && opt.perConn > 0)) usage("--per-conn: a positive integer");
  if (!(Number.isInteger(opt.repeats) && opt.repeats > 0)) usage("--repeats: a positive integer");
  if (!(Number.isInteger(opt.turns) && opt.turns > 0)) usage("--turns: a positive integer");
}

function pct(xs, p) {
  if (xs.length === 0) return NaN;
  const s = xs.slice().sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.max(0, Math.ceil((p / 100) * s.length) - 1))];
}
const r1 = (x) => (Number.isFinite(x) ? Math.round(x * 10) / 10 : null);
const r2 = (x) => (Number.isFinite(x) ? Math.round(x * 100) / 100 : null);

const RUN = "load" + Date.now().toString(36);
let runNo = 0;

// The values of these samples in the server's GET /metrics (a missing one
// null; all null when the server cannot be asked).
function metricValues(names) {
  const u = new URL(opt.url);
  return new Promise((resolve) => {
    http.get({ host: u.hostname, port: u.port, path: "/metrics" }, (res) => {
      let body = "";
      res.setEncoding("utf8");
      res.on("data", (d) => (body += d));
      res.on("end", () => resolve(names.map((name) => {
        const m = body.match(new RegExp(`^${name} ([0-9.eE+]+)$`, "m"));
        return m ? Number(m[1]) : null;
      })));
    }).on("error", () => resolve(names.map(() => null)));
  });
}

// The server's decode counters (null when missing).
async function decodeCounters() {
  const [steps, rows] = await metricValues(["kdaserve_decode_steps_total", "kdaserve_decode_rows_total"]);
  return steps === null || rows === null ? null : { steps, rows };
}

// The server's save-time histogram: count and sum (s); null when missing.
async function saveCounters() {
  const [count, sum] = await metricValues(["kdaserve_snapshot_save_seconds_count",
                                           "kdaserve_snapshot_save_seconds_sum"]);
  return count === null || sum === null ? null : { count, sum_s: sum };
}

async function runLevel(n) {
  runNo++;
  const errors = [];
  const clients = [];
  for (let i = 0; i < n; i++) {
    try {
      clients.push(await KdsClient.connect(opt.url, { token: opt.token }));
    } catch (e) {
      errors.push(`connect ${i}: ${e.message}`);
    }
  }
  // Sessions first (not timed).
  const streams = [];
  for (let i = 0; i < clients.length; i++) {
    for (let k = 0; k < opt.perConn; k++) {
      const session = `${RUN}-r${runNo}-${i}-${k}`;
      const r = await clients[i].request({ op: "create", session });
      if (r.event !== "result") errors.push(`create ${session}: ${describe(r)}`);
      else streams.push({ c: clients[i], session, seed: opt.seed + streams.length });
    }
  }
  const m0 = await decodeCounters();
  const sv0 = await saveCounters();
  const t0 = nowMs();
  // One promise per stream: its turns in a row; one result per turn.
  const turnTokens = (i, k) => opt.turns === 1 ? opt.tokens
    : Math.round(opt.tokens * (1 + ((i + 3 * k) % 4) / 4));
  const runs = streams.map(async (s, i) => {
    const out = [];
    for (let k = 0; k < opt.turns; k++) {
      const r = await s.c.startGenerate({ session: s.session, text: opt.prompt,
                                          max_tokens: turnTokens(i, k), temperature: 0.8,
                                          seed: s.seed + 1000 * k }, { timeoutMs: 600000 })
        .finished.catch((e) => ({ failed: e }));
      out.push(r);
      if (r.failed || r.error || !r.done || r.done.reason === "error") break;
    }
    return out;
  });
  const results = (await Promise.all(runs)).flat();
  const t1 = nowMs();
  const m1 = await decodeCounters();
  const saves = await saveCounters();

  let tokens = 0, events = 0;
  const ttft = [], itl = [], perStream = [], serverTokS = [], queueMs = [];
  results.forEach((r, i) => {
    if (r.failed) return errors.push(`stream ${i}: ${r.failed.message}`);
    if (r.error) return errors.push(`stream ${i}: ${describe(r.error)}`);
    if (!r.done || r.done.reason === "error") return errors.push(`stream ${i}: ${describe(r.done)}`);
    tokens += r.done.tokens;
    events += r.tokenTimes.length;
    if (r.tokenTimes.length === 0) return;
    ttft.push(r.tokenTimes[0] - r.tSend);
    for (let j = 1; j < r.tokenTimes.length; j++) itl.push(r.tokenTimes[j] - r.tokenTimes[j - 1]);
    const span = r.tokenTimes[r.tokenTimes.length - 1] - r.tokenTimes[0];
    if (span > 0 && r.done.tokens > 1) perStream.push((r.done.tokens - 1) / (span / 1000));
    serverTokS.push(r.done.decode_tok_s);
    queueMs.push(r.done.queue_ms);
  });
  await Promise.all(clients.map((c) => c.close()));
  const wall = (t1 - t0) / 1000;
  return {
    streams: streams.length, connections: clients.length, tokens, wall_s: r2(wall),
    aggregate_tok_s: r1(tokens / wall),
    per_stream_tok_s: { p50: r1(pct(perStream, 50)), p10: r1(pct(perStream, 10)), min: r1(Math.min(...perStream)) },
    server_decode_tok_s_p50: r1(pct(serverTokS, 50)),
    ttft_ms: { p50: r1(pct(ttft, 50)), p90: r1(pct(ttft, 90)), p99: r1(pct(ttft, 99)) },
    itl_ms: { p50: r2(pct(itl, 50)), p90: r2(pct(itl, 90)), p99: r2(pct(itl, 99)),
              p999: r2(pct(itl, 99.9)), max: r2(Math.max(...itl)) },
    turns: results.length,
    saves: sv0 && saves && saves.count > sv0.count
      ? { count: saves.count - sv0.count,
          mean_ms: r2(((saves.sum_s - sv0.sum_s) / (saves.count - sv0.count)) * 1e3) } : null,
    tokens_per_event: r2(tokens / Math.max(1, events)),
    queue_ms_p50: r2(pct(queueMs, 50)),
    batch_mean: m0 && m1 && m1.steps > m0.steps ? r2((m1.rows - m0.rows) / (m1.steps - m0.steps)) : null,
    errors: errors.length, error_samples: errors.slice(0, 5),
  };
}

(async () => {
  const all = [];
  let bad = 0;
  for (const n of opt.conns) {
    const runs = [];
    for (let i = 0; i < opt.repeats; i++) {
      const r = await runLevel(n);
      bad += r.errors;
      runs.push(r);
    }
    runs.sort((a, b) => a.aggregate_tok_s - b.aggregate_tok_s);
    const r = runs[Math.floor((runs.length - 1) / 2)];
    r.n = n;
    r.aggregate_tok_s_range = [runs[0].aggregate_tok_s, runs[runs.length - 1].aggregate_tok_s];
    r.errors = runs.reduce((a, x) => a + x.errors, 0);
    all.push(r);
    console.log(JSON.stringify(r));
  }
  const meta = { url: opt.url, tokens: opt.tokens, per_conn: opt.perConn, repeats: opt.repeats, seed: opt.seed,
                 prompt: opt.prompt, node: process.version, date: new Date().toISOString() };
  if (opt.json) fs.writeFileSync(opt.json, JSON.stringify({ meta, results: all }, null, 1) + "\n");
  if (opt.markdown) {
    console.log("\n| streams | aggregate tok/s (range) | per-stream tok/s p50 (p10) | TTFT ms p50 / p90 / p99 | " +
                "inter-token ms p50 / p90 / p99 | tokens/event | batch_mean | errors |");
    console.log("|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (const r of all)
      console.log(`| ${r.streams} | ${r.aggregate_tok_s}` +
                  (opt.repeats > 1 ? ` (${r.aggregate_tok_s_range[0]}-${r.aggregate_tok_s_range[1]})` : "") +
                  ` | ${r.per_stream_tok_s.p50} (${r.per_stream_tok_s.p10}) | ` +
                  `${r.ttft_ms.p50} / ${r.ttft_ms.p90} / ${r.ttft_ms.p99} | ` +
                  `${r.itl_ms.p50} / ${r.itl_ms.p90} / ${r.itl_ms.p99} | ${r.tokens_per_event} | ` +
                  `${r.batch_mean} | ${r.errors} |`);
  }
  for (const r of all) for (const e of r.error_samples) console.error(`error (${r.n} streams): ${e}`);
  process.exit(bad === 0 ? 0 : 1);
})();
