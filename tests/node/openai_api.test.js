#!/usr/bin/env node
// openai_api.test.js - checks a running `kdaserve serve` against
// docs/http-api.md with the official `openai` npm package (pinned in
// package.json) as the client. Prints one line per check ("ok N - group:
// what" or "not ok N - group: what: why") and exits 0 only when every check
// passed. Driven by tests/test_serve.c.
//
//   node openai_api.test.js --url http://127.0.0.1:PORT/ --group G[,G...]
//        [--token-a T --token-b T] [--phase save|check --state FILE]
//
// Groups:
//   basic    models, a chat completion, a completion, a streamed one (text ==
//            concatenated deltas == the same request unstreamed), usage,
//            stop strings, explicit sessions, a client going away mid-stream
//            (its generation stops), seed determinism
//   errors   malformed JSON, wrong types, unknown model, n > 1, hostile JSON
//            (deep nesting, huge numbers, invalid UTF-8), over-long body
//            (the server runs with --max-http-body 65536), unknown paths and
//            methods: OpenAI's error shape and status; the server survives
//   auth     --auth-file with two tenants: no key / a wrong key are 401, a
//            tenant never resumes another's stored state
//   resume   a 10-turn conversation resent whole every turn: each turn costs
//            only its new tokens (usage.prompt_tokens_details.cached_tokens),
//            replies equal a stateful WebSocket session's bit for bit; an
//            edited-and-regenerated turn forks from the turn before. With
//            --phase save the first 5 turns, with --phase check (after a
//            server restart) the other 5, from the store.
//   recorded an HTTP turn's sampler settings are the session's recorded ones
//            (docs/protocol.md, generate): a later WebSocket generate that
//            gives none samples with them, the same whether the session
//            stayed in memory or was loaded from the store
//   cancelled a WebSocket generate cancelled during its prompt's prefill
//            keeps its session's turns in the prefix index: a stateless
//            client resumes from what went in and from the turns after
//   keepalive a kept-alive connection carries request after request (JSON
//            answers, errors, /metrics), a streamed answer ends its own; two
//            requests pipelined after a POST close the connection without a
//            wrong answer; the openai client's pooled connections under load
//            (concurrent loops of completions, streams and refusals) get
//            every answer right
"use strict";
const fs = require("fs");
const http = require("http");
const net = require("net");
const OpenAI = require("openai");
const { KdsClient } = require("./ws_client.js");

const ALL = ["basic", "errors", "auth", "resume", "recorded", "cancelled", "keepalive"];
const opt = { groups: [] };
{
  const a = process.argv.slice(2);
  const usage = (m) => {
    console.error(`openai_api.test.js: ${m}\nusage: node openai_api.test.js --url http://HOST:PORT/ ` +
                  `--group G[,G] [--token-a T --token-b T] [--phase save|check --state FILE]`);
    process.exit(2);
  };
  for (let i = 0; i < a.length; i++) {
    const k = a[i];
    const v = () => (i + 1 < a.length ? a[++i] : usage(`${k} needs a value`));
    if (k === "--url") opt.url = v().replace(/\/$/, "");
    else if (k === "--group") opt.groups.push(...v().split(",").filter(Boolean));
    else if (k === "--token-a") opt.tokenA = v();
    else if (k === "--token-b") opt.tokenB = v();
    else if (k === "--phase") opt.phase = v();
    else if (k === "--state") opt.state = v();
    else usage(`unknown argument '${k}'`);
  }
  if (!opt.url) usage("--url is required");
  if (!opt.groups.length) opt.groups = ["basic"];
  for (const g of opt.groups) if (!ALL.includes(g)) usage(`unknown group '${g}'`);
}
const WS_URL = opt.url.replace(/^http/, "ws") + "/";

let nCheck = 0, nFail = 0, group = "";
async function check(name, fn) {
  nCheck++;
  try {
    await fn();
    console.log(`ok ${nCheck} - ${group}: ${name}`);
  } catch (e) {
    nFail++;
    console.log(`not ok ${nCheck} - ${group}: ${name}: ${(e && e.stack) || e}`);
  }
}
function ok(c, m) { if (!c) throw new Error(m); }
function eq(got, want, what) {
  const g = JSON.stringify(got), w = JSON.stringify(want);
  if (g !== w) throw new Error(`${what}: got ${g}, expected ${w}`);
}

function client(key) {
  return new OpenAI({ baseURL: opt.url + "/v1", apiKey: key || "none", maxRetries: 0, timeout: 120000 });
}

// A raw HTTP request (for bodies the SDK would never send).
function raw(method, path, body, headers = {}) {
  return new Promise((resolve, reject) => {
    const u = new URL(opt.url + path);
    const len = body === undefined ? {} : { "content-length": Buffer.byteLength(body) };
    const req = http.request({ host: u.hostname, port: u.port, path: u.pathname, method,
                               headers: { "content-type": "application/json", ...len, ...headers } }, (res) => {
      const chunks = [];
      res.on("data", (d) => chunks.push(d));
      res.on("end", () => {
        const text = Buffer.concat(chunks).toString("utf8");
        let json = null;
        try { json = JSON.parse(text); } catch (_) { /* not JSON */ }
        resolve({ status: res.statusCode, headers: res.headers, text, json });
      });
    });
    req.on("error", reject);
    if (body !== undefined) req.write(body);
    req.end();
  });
}

// OpenAI's error shape: {"error":{"message","type","param","code"}}.
function errorShape(j, what) {
  ok(j && typeof j === "object" && j.error && typeof j.error === "object", `${what}: no error object: ${JSON.stringify(j)}`);
  const e = j.error;
  ok(typeof e.message === "string" && e.message.length > 0, `${what}: error.message`);
  ok(typeof e.type === "string" && e.type.length > 0, `${what}: error.type`);
  ok("param" in e && (e.param === null || typeof e.param === "string"), `${what}: error.param`);
  ok("code" in e && (e.code === null || typeof e.code === "string"), `${what}: error.code`);
  return e;
}

// The SDK's error for a refused request: status and body.
async function refused(p, status, what) {
  try {
    await p;
  } catch (e) {
    ok(e instanceof OpenAI.APIError, `${what}: not an APIError: ${e}`);
    eq(e.status, status, `${what}: status`);
    errorShape({ error: e.error }, what);
    return e;
  }
  throw new Error(`${what}: the request was accepted`);
}

const MODEL = "default";
const chat = (c, messages, extra = {}, opts = undefined) =>
  c.chat.completions.create({ model: MODEL, messages, max_tokens: 16, temperature: 0, ...extra }, opts);

function usageOk(u, what) {
  ok(u && Number.isInteger(u.prompt_tokens) && u.prompt_tokens > 0, `${what}: usage.prompt_tokens`);
  ok(Number.isInteger(u.completion_tokens) && u.completion_tokens >= 1, `${what}: usage.completion_tokens`);
  eq(u.total_tokens, u.prompt_tokens + u.completion_tokens, `${what}: usage.total_tokens`);
  ok(u.prompt_tokens_details && Number.isInteger(u.prompt_tokens_details.cached_tokens),
     `${what}: usage.prompt_tokens_details.cached_tokens`);
}

async function collect(stream) {
  let text = "", finish = null, usage = null, chunks = 0;
  for await (const ch of stream) {
    chunks++;
    if (ch.usage) usage = ch.usage;
    for (const c of ch.choices || []) {
      if (c.delta && typeof c.delta.content === "string") text += c.delta.content;
      if (typeof c.text === "string") text += c.text;
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  return { text, finish, usage, chunks };
}

// ---------------------------------------------------------------- basic
async function basic() {
  group = "basic";
  const c = client();
  await check("GET /v1/models lists the served model", async () => {
    const page = await c.models.list();
    const ids = page.data.map((m) => m.id);
    eq(ids, [MODEL], "model ids");
    eq(page.data[0].object, "model", "object");
  });
  const msgs = [{ role: "user", content: "Tell me about the sea." }];
  let plain;
  await check("a chat completion: one assistant message, finish_reason, usage", async () => {
    plain = await chat(c, msgs, { max_tokens: 24 });
    eq(plain.object, "chat.completion", "object");
    eq(plain.choices.length, 1, "choices");
    eq(plain.choices[0].message.role, "assistant", "role");
    ok(typeof plain.choices[0].message.content === "string", "content is a string");
    ok(["stop", "length"].includes(plain.choices[0].finish_reason), "finish_reason");
    usageOk(plain.usage, "usage");
    ok(plain.usage.completion_tokens <= 24, "completion_tokens <= max_tokens");
  });
  await check("max_completion_tokens caps the reply like max_tokens", async () => {
    const r = await c.chat.completions.create({ model: MODEL, messages: msgs, max_completion_tokens: 5,
                                                temperature: 0, ignore_eos: true });
    eq(r.usage.completion_tokens, 5, "completion_tokens");
    eq(r.choices[0].finish_reason, "length", "finish_reason");
  });
  await check("a streamed chat completion: text == concatenated deltas == the same request unstreamed", async () => {
    const s = await collect(await chat(c, msgs, { max_tokens: 24, stream: true, stream_options: { include_usage: true } }));
    ok(s.chunks >= 3, `only ${s.chunks} chunks`);
    eq(s.text, plain.choices[0].message.content, "streamed text");
    eq(s.finish, plain.choices[0].finish_reason, "finish_reason");
    usageOk(s.usage, "streamed usage");
    eq(s.usage.completion_tokens, plain.usage.completion_tokens, "completion_tokens");
  });
  await check("a completion (plain text) and its stream agree", async () => {
    const a = await c.completions.create({ model: MODEL, prompt: "It is a truth universally", max_tokens: 20, temperature: 0 });
    eq(a.object, "text_completion", "object");
    ok(typeof a.choices[0].text === "string" && a.choices[0].text.length > 0, "text");
    usageOk(a.usage, "usage");
    const s = await collect(await c.completions.create({ model: MODEL, prompt: "It is a truth universally",
                                                         max_tokens: 20, temperature: 0, stream: true }));
    eq(s.text, a.choices[0].text, "streamed text");
  });
  await check("stop: the reply ends before the first stop string, finish_reason stop", async () => {
    const full = await c.completions.create({ model: MODEL, prompt: "Call me Ishmael. Some years ago",
                                              max_tokens: 40, temperature: 0, ignore_eos: true });
    const t = full.choices[0].text;
    const words = t.split(" ").filter((w) => w.length >= 3);
    ok(words.length >= 3, `reply too short to pick a stop word: ${JSON.stringify(t)}`);
    const stop = words[2];
    const cut = t.slice(0, t.indexOf(stop));
    const r = await c.completions.create({ model: MODEL, prompt: "Call me Ishmael. Some years ago",
                                           max_tokens: 40, temperature: 0, ignore_eos: true, stop: [stop, "zq#x"] });
    eq(r.choices[0].text, cut, "text");
    eq(r.choices[0].finish_reason, "stop", "finish_reason");
    const s = await collect(await c.completions.create({ model: MODEL, prompt: "Call me Ishmael. Some years ago",
                                                         max_tokens: 40, temperature: 0, ignore_eos: true, stop, stream: true }));
    eq(s.text, cut, "streamed text");
    eq(s.finish, "stop", "streamed finish_reason");
  });
  await check("an explicit session (body field or X-Kdaserve-Session) names where the turn is saved", async () => {
    const name = "named-" + process.pid;
    const a = await c.completions.create({ model: MODEL, prompt: "It is a truth", max_tokens: 3, session: name });
    eq(a.kdaserve.session, name, "session of the body field");
    const b = await c.completions.create({ model: MODEL, prompt: "It is a truth", max_tokens: 3 },
                                         { headers: { "X-Kdaserve-Session": name + "-h" } });
    eq(b.kdaserve.session, name + "-h", "session of the header");
    // the same session again from an empty state: its head moved, so a fork
    const d = await c.completions.create({ model: MODEL, prompt: "It is a truth", max_tokens: 3, session: name });
    eq(d.kdaserve.session, name + "-2", "a fork of the named session");
    const r = await raw("POST", "/v1/completions", JSON.stringify({ model: MODEL, prompt: "x", session: "bad name!" }));
    eq(r.status, 400, "an invalid session name");
    eq(errorShape(r.json, "session").param, "session", "param");
  });
  await check("a client that goes away mid-stream stops its generation", async () => {
    const active = async () => {
      const r = await raw("GET", "/metrics");
      const m = /^kdaserve_generations_active (\d+)/m.exec(r.text);
      ok(m, "no kdaserve_generations_active in /metrics");
      return Number(m[1]);
    };
    const ac = new AbortController();
    const s = await chat(c, msgs, { max_tokens: 100000, ignore_eos: true, stream: true }, { signal: ac.signal });
    let n = 0;
    try {
      for await (const ch of s) if (++n === 5) ac.abort();
    } catch (_) { /* the abort */ }
    ok(n >= 5, `only ${n} chunks before the abort`);
    let left = 1;
    for (let i = 0; i < 100 && (left = await active()) > 0; i++) await new Promise((r) => setTimeout(r, 100));
    eq(left, 0, "generations still active 10 s after the client went away (100,000 tokens asked; the server runs with --max-tokens 100000)");
  });
  await check("seed: the same seed gives the same sampled reply, another seed another", async () => {
    const p = { max_tokens: 32, temperature: 1.0, ignore_eos: true };
    const a = await chat(c, msgs, { ...p, seed: 42 });
    const b = await chat(c, msgs, { ...p, seed: 42 });
    const d = await chat(c, msgs, { ...p, seed: 4242 });
    eq(b.choices[0].message.content, a.choices[0].message.content, "same seed");
    ok(d.choices[0].message.content !== a.choices[0].message.content, "another seed gave the same 32 tokens");
  });
}

// ---------------------------------------------------------------- errors
async function errors() {
  group = "errors";
  const c = client();
  const m = [{ role: "user", content: "hi" }];
  const post = (body, path = "/v1/chat/completions") => raw("POST", path, body);
  await check("malformed JSON: 400 in OpenAI's error shape", async () => {
    for (const body of ['{"model":', "not json", "", '{"model":"default"} trailing', "[1,2]"]) {
      const r = await post(body);
      eq(r.status, 400, `status for ${JSON.stringify(body)}`);
      errorShape(r.json, JSON.stringify(body));
    }
  });
  await check("wrong types: 400 naming the parameter", async () => {
    const cases = [
      [{ temperature: "hot" }, "temperature"], [{ max_tokens: -1 }, "max_tokens"],
      [{ max_tokens: 1.5 }, "max_tokens"], [{ top_p: 3 }, "top_p"], [{ seed: "x" }, "seed"],
      [{ stream: "yes" }, "stream"], [{ stop: 5 }, "stop"], [{ stop: ["a", "b", "c", "d", "e"] }, "stop"],
      [{ messages: "hi" }, "messages"], [{ messages: [] }, "messages"],
      [{ messages: [{ role: "wizard", content: "x" }] }, "messages[0].role"],
      [{ messages: [{ role: "user", content: 7 }] }, "messages[0].content"],
      [{ messages: [{ role: "user", content: [{ type: "image_url", image_url: {} }] }] }, "messages[0].content"],
    ];
    for (const [extra, param] of cases) {
      const e = await refused(c.chat.completions.create({ model: MODEL, messages: m, ...extra }), 400, JSON.stringify(extra));
      eq(e.error.param, param, `param of ${JSON.stringify(extra)}`);
    }
    const e = await refused(c.completions.create({ model: MODEL, prompt: { a: 1 } }), 400, "prompt object");
    eq(e.error.param, "prompt", "param");
  });
  await check("a missing model is 400, an unknown one 404 model_not_found", async () => {
    let r = await post(JSON.stringify({ messages: m }));
    eq(r.status, 400, "status");
    eq(errorShape(r.json, "missing").param, "model", "param");
    const e = await refused(c.chat.completions.create({ model: "gpt-4o", messages: m }), 404, "unknown model");
    eq(e.error.code, "model_not_found", "code");
  });
  await check("n other than 1 and unsupported features are refused", async () => {
    const e = await refused(chat(c, m, { n: 2 }), 400, "n=2");
    eq(e.error.param, "n", "param");
    await refused(chat(c, m, { tools: [{ type: "function", function: { name: "f", parameters: {} } }] }), 400, "tools");
    await refused(chat(c, m, { logprobs: true }), 400, "logprobs");
  });
  await check("hostile JSON: deep nesting, huge numbers, invalid UTF-8, NUL: clear 400s", async () => {
    const deep = '{"model":"default","messages":' + "[".repeat(20000) + "]".repeat(20000) + "}";
    let r = await post(deep);
    eq(r.status, 400, "deep nesting");
    errorShape(r.json, "deep");
    for (const num of ["1e999", "-1e999", "123456789012345678901234567890"]) {
      r = await post(`{"model":"default","messages":[{"role":"user","content":"x"}],"max_tokens":${num}}`);
      eq(r.status, 400, `max_tokens ${num}`);
      r = await post(`{"model":"default","messages":[{"role":"user","content":"x"}],"temperature":${num}}`);
      eq(r.status, 400, `temperature ${num}`);
    }
    const bad = Buffer.concat([Buffer.from('{"model":"default","messages":[{"role":"user","content":"'),
                               Buffer.from([0xff, 0xc3, 0x28]), Buffer.from('"}]}')]);
    r = await post(bad);
    eq(r.status, 400, "invalid UTF-8");
    ok(/UTF-8/.test(errorShape(r.json, "utf8").message), "the message says UTF-8");
    r = await post('{"model":"default","messages":[{"role":"user","content":"a\\u0000b"}]}');
    eq(r.status, 400, "NUL in content");
    ok(/NUL/.test(errorShape(r.json, "nul").message), "the message says NUL");
  });
  await check("an over-long body is 413 (--max-http-body), and the next request is served", async () => {
    const big = "x".repeat(200000);
    const e = await refused(c.chat.completions.create({ model: MODEL, messages: [{ role: "user", content: big }] }), 413, "long body");
    ok(/max-http-body/.test(e.error.message), "the message names --max-http-body");
    const r = await chat(c, m, { max_tokens: 2 });
    eq(r.object, "chat.completion", "after it");
  });
  await check("a body without Content-Length (chunked) is 411", async () => {
    const r = await new Promise((resolve, reject) => {
      const u = new URL(opt.url + "/v1/chat/completions");
      const req = http.request({ host: u.hostname, port: u.port, path: u.pathname, method: "POST",
                                 headers: { "content-type": "application/json" } }, (res) => {
        const ch = [];
        res.on("data", (d) => ch.push(d));
        res.on("end", () => resolve({ status: res.statusCode, json: JSON.parse(Buffer.concat(ch).toString()) }));
      });
      req.on("error", reject);
      req.write('{"model":"default",');
      req.end('"messages":[]}');
    });
    eq(r.status, 411, "status");
    errorShape(r.json, "411");
  });
  await check("unknown paths are 404, wrong methods 405, both in the error shape", async () => {
    let r = await raw("GET", "/v1/embeddings");
    eq(r.status, 404, "unknown path");
    errorShape(r.json, "404");
    r = await raw("GET", "/v1/chat/completions");
    eq(r.status, 405, "GET chat");
    errorShape(r.json, "405");
    r = await raw("POST", "/v1/models", "{}");
    eq(r.status, 405, "POST models");
  });
  await check("the server still answers after all of that", async () => {
    const page = await c.models.list();
    eq(page.data.length, 1, "models");
  });
}

// ---------------------------------------------------------------- auth
async function auth() {
  group = "auth";
  await check("no API key and a wrong one: 401 invalid_api_key", async () => {
    const r = await raw("GET", "/v1/models");
    eq(r.status, 401, "no key");
    eq(errorShape(r.json, "no key").code, "invalid_api_key", "code");
    const e = await refused(client("wrong-token-0123456789").models.list(), 401, "wrong key");
    eq(e.error.code, "invalid_api_key", "code");
    const p = await raw("POST", "/v1/chat/completions", JSON.stringify({ model: MODEL, messages: [] }),
                        { authorization: "Bearer nope" });
    eq(p.status, 401, "POST with a wrong key");
  });
  await check("a tenant never resumes another tenant's stored state", async () => {
    const a = client(opt.tokenA), b = client(opt.tokenB);
    const msgs = [{ role: "user", content: "A secret of tenant A." }];
    const r1 = await chat(a, msgs, { ignore_eos: true, max_tokens: 8 });
    const next = [...msgs, { role: "assistant", content: r1.choices[0].message.content },
                  { role: "user", content: "Go on." }];
    const rb = await chat(b, next, { ignore_eos: true, max_tokens: 8 });
    eq(rb.usage.prompt_tokens_details.cached_tokens, 0, "tenant B's cached_tokens");
    const ra = await chat(a, next, { ignore_eos: true, max_tokens: 8 });
    ok(ra.usage.prompt_tokens_details.cached_tokens > 0, "tenant A resumes its own conversation");
    eq(rb.choices[0].message.content, ra.choices[0].message.content, "the same reply either way (greedy)");
  });
}

// ---------------------------------------------------------------- resume
const USER = ["Tell me about the whale.", "What did the captain say?", "And the crew?",
              "Describe the ship.", "What happened at dawn?", "Who was Queequeg?",
              "Where did they sail?", "What is a harpoon?", "How did it end?", "Thank you."];
const TURN = { max_tokens: 12, temperature: 0, ignore_eos: true };

// One stateless turn: the whole conversation, then the reply appended.
async function httpTurn(c, msgs, user) {
  const m = [...msgs, { role: "user", content: user }];
  const r = await chat(c, m, TURN);
  return { r, msgs: [...m, { role: "assistant", content: r.choices[0].message.content }] };
}

// The same turn on a stateful WebSocket session in chat mode.
async function wsTurn(ws, session, user) {
  const g = await ws.generate({ session, message: user, ...TURN });
  ok(g.done && !g.error, `WebSocket generate: ${JSON.stringify(g.error || g.done)}`);
  return g.done;
}

async function resume() {
  group = "resume";
  const c = client(opt.tokenA);
  const ws = await KdsClient.connect(WS_URL, opt.tokenA ? { token: opt.tokenA } : {});
  let st = { msgs: [], ctx: 0, wsSession: "ref-" + process.pid, wsSnaps: [], contexts: [], session: null };
  let from = 0, to = USER.length;
  if (opt.phase === "save") to = 5;
  if (opt.phase === "check") {
    st = JSON.parse(fs.readFileSync(opt.state, "utf8"));
    from = 5;
  } else {
    await ws.ok({ op: "create", session: st.wsSession, mode: "chat" });
  }
  await check(`turns ${from + 1}-${to} resent whole: only the new tokens are prefilled, replies equal the stateful session's`, async () => {
    for (let k = from; k < to; k++) {
      const { r, msgs } = await httpTurn(c, st.msgs, USER[k]);
      const d = await wsTurn(ws, st.wsSession, USER[k]);
      const u = r.usage;
      // turn 1 of a fresh conversation has nothing stored to resume
      eq(u.prompt_tokens_details.cached_tokens, k === 0 ? 0 : st.ctx, `turn ${k + 1}: cached_tokens`);
      eq(u.prompt_tokens, (k === 0 ? 0 : st.ctx) + d.prompt_tokens, `turn ${k + 1}: prompt_tokens = stored + new`);
      eq(r.choices[0].message.content, d.reply, `turn ${k + 1}: reply (WebSocket session: ${JSON.stringify(d.reply)})`);
      eq(r.kdaserve.context, d.context, `turn ${k + 1}: context`);
      if (st.session) eq(r.kdaserve.session, st.session, `turn ${k + 1}: continues the same session`);
      st.session = r.kdaserve.session;
      st.msgs = msgs;
      st.ctx = r.kdaserve.context;
      st.contexts.push(st.ctx);
      st.wsSnaps.push(d.snapshot);
      // the stateful reference of the edited branch below: the session as
      // it was before the last turn (a fork keeps its chat mode)
      if (k === USER.length - 2) await ws.ok({ op: "fork", session: st.wsSession, name: st.wsSession + "-b" });
    }
  });
  if (opt.phase === "save") {
    fs.writeFileSync(opt.state, JSON.stringify(st));
    await ws.close();
    return;
  }
  await check("an edited-and-regenerated turn forks from the turn before it", async () => {
    // drop the last exchange and ask something else instead
    const base = st.msgs.slice(0, -2);
    const { r } = await httpTurn(c, base, "Tell me something else.");
    eq(r.usage.prompt_tokens_details.cached_tokens, st.contexts[st.contexts.length - 2], "cached_tokens");
    ok(r.kdaserve.session !== st.session, `saved to a fork, not to ${st.session}`);
    const d = await wsTurn(ws, st.wsSession + "-b", "Tell me something else.");
    eq(r.choices[0].message.content, d.reply, "reply");
    // the original line is untouched and still resumes
    const again = await httpTurn(c, st.msgs, "One more.");
    eq(again.r.usage.prompt_tokens_details.cached_tokens, st.ctx, "the main line still resumes");
    eq(again.r.kdaserve.session, st.session, "in its own session");
  });
  await check("a WebSocket conversation resumes over HTTP as a branch: its turns are indexed, the session keeps its own", async () => {
    // a chat session made over WebSocket, with a system text and one turn
    const session = "wsconv-" + process.pid, system = "You are brief.", user = "Tell me about the whale.";
    await ws.ok({ op: "create", session, mode: "chat", system });
    const d = await wsTurn(ws, session, user);
    // the same conversation from a stateless client, one message more
    const msgs = [{ role: "system", content: system }, { role: "user", content: user },
                  { role: "assistant", content: d.reply }];
    const r = await chat(c, [...msgs, { role: "user", content: "And the crew?" }], TURN);
    eq(r.usage.prompt_tokens_details.cached_tokens, d.context, "cached_tokens: the WebSocket turn's context");
    ok(r.kdaserve.session !== session && r.kdaserve.session.startsWith(session + "-"),
       `saved to a branch of ${session}, not ${r.kdaserve.session}`);
    // the WebSocket session is as its client left it: its next turn follows its own
    const h = await ws.ok({ op: "history", session });
    eq(h.turns.length, 2, "the WebSocket session's turns (the system text and its one turn)");
    const d2 = await wsTurn(ws, session, "And the crew?");
    eq(d2.reply, r.choices[0].message.content, "the WebSocket session's next turn = the branch's reply");
    // the stateless client goes on in its branch
    const r2 = await chat(c, [...msgs, { role: "user", content: "And the crew?" },
                              { role: "assistant", content: r.choices[0].message.content },
                              { role: "user", content: "Thank you." }], TURN);
    eq(r2.kdaserve.session, r.kdaserve.session, "the next stateless turn continues its branch");
    ok(r2.usage.prompt_tokens_details.cached_tokens >= r.kdaserve.context, "and resumes it");
  });
  await check("a long plain prompt leaves a resume point: it plus a question resumes there, the reply as a stateful session's", async () => {
    // about 6,000 tokens of varied prose (>= the 4,096 that earn a resume point)
    const words = ["whale", "captain", "sea", "ship", "harpoon", "crew", "dawn", "storm", "deck", "sail"];
    let doc = "", x = 7;
    for (let i = 0; i < 3000; i++) {
      x = (Math.imul(x, 1103515245) + 12345) >>> 0;
      doc += words[(x >>> 16) % words.length] + (i % 17 === 16 ? ".\n" : " ");
    }
    const question = "\n\nQuestion: who was on the deck?\nAnswer:";
    const first = await c.completions.create({ model: MODEL, prompt: doc, max_tokens: 4, temperature: 0 });
    const n = first.usage.prompt_tokens;
    ok(n >= 4096, `the document is ${n} tokens, too few for a resume point`);
    const r = await c.completions.create({ model: MODEL, prompt: doc + question, ...TURN });
    const cached = r.usage.prompt_tokens_details.cached_tokens;
    // the last prefill slice boundary (256 tokens by default) before the
    // document's last two pre-tokens: never its end (which the question's
    // newlines change), never more than a slice and those before it
    ok(cached > n - 256 - 8 && cached < n, `cached ${cached} of the document's ${n} tokens`);
    eq(cached % 256, 0, "the resume point is on a prefill slice boundary");
    const session = "longdoc-" + process.pid;
    await ws.ok({ op: "create", session, mode: "plain" });
    const g = await ws.generate({ session, text: doc + question, ...TURN });
    ok(g.done && !g.error, `WebSocket generate: ${JSON.stringify(g.error || g.done)}`);
    eq(r.choices[0].text, g.done.reply, "the resumed reply equals a session fed the whole text");
  });
  await ws.close();
}

// ---------------------------------------------------------------- recorded
async function recorded() {
  group = "recorded";
  const c = client(opt.tokenA);
  const ws = await KdsClient.connect(WS_URL, opt.tokenA ? { token: opt.tokenA } : {});
  await check("an HTTP turn records its sampler settings in memory as in the store", async () => {
    // a WebSocket conversation, greedy: the session records temperature 0
    const session = "rec-" + process.pid, system = "You are brief.", user = "Tell me about the whale.";
    await ws.ok({ op: "create", session, mode: "chat", system });
    const d = await wsTurn(ws, session, user);
    // continued over HTTP in that very session (idle in memory), hot sampling
    const hot = { temperature: 2, top_p: 1, top_k: 0, min_p: 0, repeat_penalty: 1 };
    const r = await chat(c, [{ role: "system", content: system }, { role: "user", content: user },
                             { role: "assistant", content: d.reply }, { role: "user", content: "And the crew?" }],
                         { ...hot, seed: 3, max_tokens: 4, session });
    eq(r.kdaserve.session, session, "the HTTP turn went into the named session");
    eq(r.usage.prompt_tokens_details.cached_tokens, d.context, "it resumed the session's state");
    // the next WebSocket turns sample with what the session recorded: the
    // HTTP turn's settings, in memory (a) as loaded from the store (b, a
    // fork made at the same head) and as given explicitly (c)
    await ws.ok({ op: "fork", session, name: session + "-b" });
    await ws.ok({ op: "fork", session, name: session + "-c" });
    const next = { message: "Go on.", max_tokens: 16, ignore_eos: true, seed: 9 };
    const a = await ws.generate({ session, ...next });
    const b = await ws.generate({ session: session + "-b", ...next });
    const x = await ws.generate({ session: session + "-c", ...next, ...hot });
    for (const [g, w] of [[a, "in memory"], [b, "loaded"], [x, "explicit"]])
      ok(g.done && !g.error, `${w}: ${JSON.stringify(g.error || g.done)}`);
    eq(b.done.reply, x.done.reply, "loaded from the store, the session samples with the HTTP turn's settings");
    eq(a.done.reply, x.done.reply, "in memory, the session samples with the HTTP turn's settings");
  });
  await ws.close();
}

// ---------------------------------------------------------------- cancelled
async function cancelled() {
  group = "cancelled";
  const c = client(opt.tokenA);
  const ws = await KdsClient.connect(WS_URL, opt.tokenA ? { token: opt.tokenA } : {});
  // "a a a ..." is one token a word, so a client can write any prefix of it
  const words = (n) => (n > 0 ? "a" + " a".repeat(n - 1) : "");
  const N = 20000;
  for (const how of ["cancel", "disconnect"]) {
    await check(`a generate ended by ${how} during its prefill: its session's turns stay resumable over HTTP`, async () => {
      const session = `cut-${how}-${process.pid}`;
      await ws.ok({ op: "create", session, mode: "plain" });
      // a long prompt, stopped after its first slices went in
      const cw = how === "cancel" ? ws : await KdsClient.connect(WS_URL, opt.tokenA ? { token: opt.tokenA } : {});
      let onStarted;
      const startedP = new Promise((r) => { onStarted = r; });
      const g = cw.startGenerate({ session, text: words(N), max_tokens: 0 },
                                 { onEvent: (e) => { if (e.event === "started") onStarted(e); } });
      const started = await Promise.race([startedP, g.finished.then(() => g.started || { prompt_tokens: -1 })]);
      ok(started.prompt_tokens === N, `the prompt is ${started.prompt_tokens} tokens, not ${N}`);
      if (how === "cancel") {
        isResult(await ws.request({ op: "cancel", target: g.id }), "cancel");
        const d = (await g.finished).done;
        ok(d && d.reason === "cancelled", `done: ${JSON.stringify(d)}`);
      } else {
        cw.terminate();
      }
      // the session holds what went in (a whole number of slices)
      let ctx = -1;
      for (let t = 0; t < 600; t++) {
        const l = await ws.ok({ op: "list" });
        const e = l.sessions.find((x) => x.name === session);
        if (e && e.state !== "generating") { ctx = e.tokens; break; }
        await new Promise((r) => setTimeout(r, 50));
      }
      ok(ctx > 0 && ctx < N, `the turn was not stopped during its prefill: the session holds ${ctx} of ${N} tokens`);
      // the next turn of the session
      const d2 = (await ws.generate({ session, text: " b c d", max_tokens: 0 })).done;
      ok(d2 && !d2.error, `generate: ${JSON.stringify(d2)}`);
      eq(d2.context, ctx + 3, "context after ' b c d'");
      // a stateless client that sends the same tokens resumes at each end
      const r1 = await c.completions.create({ model: MODEL, prompt: words(ctx) + " z", max_tokens: 1, temperature: 0 });
      eq(r1.usage.prompt_tokens, ctx + 1, "the request's tokens");
      eq(r1.usage.prompt_tokens_details.cached_tokens, ctx, "resumed where the stopped turn ended");
      const r2 = await c.completions.create({ model: MODEL, prompt: words(ctx) + " b c d e", max_tokens: 1, temperature: 0 });
      eq(r2.usage.prompt_tokens_details.cached_tokens, ctx + 3, "resumed where the turn after it ended");
    });
  }
  await ws.close();
}

// ---------------------------------------------------------------- keepalive
// One request on a kept-alive agent: status, body, whether the socket was reused.
function agentRequest(agent, method, path, body, extra = {}) {
  return new Promise((resolve, reject) => {
    const u = new URL(opt.url + path);
    const headers = { ...extra, ...(body === undefined ? {} : { "content-type": "application/json",
                                                               "content-length": Buffer.byteLength(body) }) };
    const req = http.request({ host: u.hostname, port: u.port, path: u.pathname, method, agent, headers }, (res) => {
      const chunks = [];
      res.on("data", (d) => chunks.push(d));
      res.on("end", () => resolve({ status: res.statusCode, headers: res.headers, reused: req.reusedSocket,
                                    text: Buffer.concat(chunks).toString("utf8") }));
    });
    req.on("error", reject);
    if (body !== undefined) req.write(body);
    req.end();
  });
}

// Raw bytes to the server; everything it sends back until it closes (or 20 s).
function rawExchange(bytes) {
  return new Promise((resolve, reject) => {
    const u = new URL(opt.url);
    const s = net.connect(+u.port, u.hostname, () => s.write(bytes));
    const chunks = [];
    const timer = setTimeout(() => { s.destroy(); resolve({ closed: false, text: Buffer.concat(chunks).toString("utf8") }); }, 20000);
    s.on("data", (d) => chunks.push(d));
    s.on("error", () => {}); /* a reset is a close too */
    s.on("close", () => { clearTimeout(timer); resolve({ closed: true, text: Buffer.concat(chunks).toString("utf8") }); });
  });
}

async function keepalive() {
  group = "keepalive";
  const c = client(opt.tokenA);
  const auth = opt.tokenA ? { authorization: "Bearer " + opt.tokenA } : {};
  const body = (prompt) => JSON.stringify({ model: MODEL, prompt, max_tokens: 2, temperature: 0 });
  await check("a kept-alive connection carries request after request, each answered whole", async () => {
    const agent = new http.Agent({ keepAlive: true, maxSockets: 1 });
    try {
      const reqs = [["GET", "/v1/models"], ["POST", "/v1/completions", body("It is a truth")],
                    ["POST", "/v1/completions", "{bad"], ["GET", "/v1/nope"], ["GET", "/metrics"],
                    ["POST", "/v1/completions", body("Call me")], ["GET", "/v1/models"]];
      if (opt.tokenA) reqs.push(["POST", "/v1/completions", body("No key")], ["GET", "/v1/models"]);
      for (let k = 0; k < reqs.length; k++) {
        const [m, p, b] = reqs[k];
        const noKey = k === 7; /* refused, the connection kept */
        const r = await agentRequest(agent, m, p, b, noKey ? {} : auth);
        const want = noKey ? 401 : p === "/v1/nope" ? 404 : b === "{bad" ? 400 : 200;
        eq(r.status, want, `${m} ${p}: status`);
        if (p !== "/metrics") JSON.parse(r.text); /* whole: its Content-Length's bytes, JSON */
        ok(k === 0 || r.reused, `${m} ${p}: a new connection, not the kept one`);
        ok(r.headers.connection !== "close", `${m} ${p}: 'Connection: close'`);
      }
    } finally {
      agent.destroy();
    }
  });
  await check("a streamed answer ends its connection; the next request gets a new one", async () => {
    const agent = new http.Agent({ keepAlive: true, maxSockets: 1 });
    try {
      const sb = JSON.stringify({ model: MODEL, prompt: "The sea", max_tokens: 3, stream: true });
      const a = await agentRequest(agent, "POST", "/v1/completions", sb, auth);
      eq(a.status, 200, "status");
      ok(a.text.endsWith("data: [DONE]\n\n"), `the stream ends with [DONE]: ${JSON.stringify(a.text.slice(-40))}`);
      const b = await agentRequest(agent, "POST", "/v1/completions", body("It is"), auth);
      eq(b.status, 200, "the request after it");
      ok(!b.reused, "the streamed answer's connection was reused");
    } finally {
      agent.destroy();
    }
  });
  await check("requests pipelined after a POST: the connection closes, no wrong answer is sent", async () => {
    const post = (b) => `POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n` +
      Object.entries(auth).map(([k, v]) => `${k}: ${v}\r\n`).join("") +
      `Content-Length: ${Buffer.byteLength(b)}\r\n\r\n${b}`;
    const r = await rawExchange(post(body("It is a truth")) + post(body("Call me")));
    ok(r.closed, `the connection stayed open; it sent ${JSON.stringify(r.text.slice(0, 200))}`);
    /* what came (nothing: lws cannot read a request pipelined after a POST)
     * is whole answers, none of them made up */
    ok(!/request body is empty/.test(r.text), `an answer to no request: ${JSON.stringify(r.text.slice(0, 300))}`);
    ok(r.text === "" || r.text.startsWith("HTTP/1.1 200"), `not an answer: ${JSON.stringify(r.text.slice(0, 300))}`);
    const m = await c.models.list();
    eq(m.data.map((x) => x.id), [MODEL], "the server still answers");
  });
  await check("the openai client's pooled connections under load: every answer right", async () => {
    const workers = 16, until = Date.now() + 6000;
    let done = 0;
    const bad = [];
    const one = async (k) => {
      switch (k % 6) {
        case 0: eq((await c.models.list()).data.length, 1, "models"); break;
        case 1: {
          const r = await chat(c, [{ role: "user", content: "Hi " + k }], { max_tokens: 2 });
          ok(typeof r.choices[0].message.content === "string" && r.usage.completion_tokens >= 1, "chat");
          break;
        }
        case 2: {
          const r = await c.completions.create({ model: MODEL, prompt: "It is a truth " + k, max_tokens: 2 });
          ok(r.object === "text_completion", "completion");
          break;
        }
        case 3: await refused(c.completions.create({ model: "nope", prompt: "x" }), 404, "unknown model"); break;
        case 4: await refused(c.completions.create({ model: MODEL, prompt: "x", n: 2 }), 400, "n = 2"); break;
        case 5: {
          const s = await c.chat.completions.create({ model: MODEL, messages: [{ role: "user", content: "Yo" }],
                                                      max_tokens: 2, stream: true });
          eq((await collect(s)).finish !== null, true, "a stream's end");
          break;
        }
      }
    };
    await Promise.all(Array.from({ length: workers }, async (_, w) => {
      for (let k = w; Date.now() < until; k += workers) {
        try { await one(k); done++; } catch (e) { if (bad.length < 5) bad.push(`request kind ${k % 6}: ${e.message}`); }
      }
    }));
    ok(bad.length === 0, `${bad.length} of ${done + bad.length} requests went wrong: ${bad.join("; ")}`);
    ok(done > workers, `only ${done} requests`);
  });
}

function isResult(r, what) {
  ok(r && r.event === "result", `${what}: ${JSON.stringify(r)}`);
  return r;
}

(async () => {
  for (const g of opt.groups) {
    if (g === "basic") await basic();
    else if (g === "errors") await errors();
    else if (g === "auth") await auth();
    else if (g === "resume") await resume();
    else if (g === "recorded") await recorded();
    else if (g === "cancelled") await cancelled();
    else if (g === "keepalive") await keepalive();
  }
  console.log(`# ${nCheck - nFail} passed, ${nFail} failed`);
  process.exit(nFail ? 1 : 0);
})().catch((e) => {
  console.log(`not ok - ${group}: ${e.stack || e}`);
  process.exit(1);
});
