// ws_client.js - a small kdaserve.v1 WebSocket client (docs/protocol.md) for
// the protocol tests (ws_protocol.test.js) and the load test (ws_load.js).
//
// Every frame the server sends is decoded (JSON text frames, msgpack binary
// frames) into an event object, tagged with `__binary` (how it came) and
// `__t` (arrival time, ms, monotonic), and queued. Callers take events out
// of the queue with next(predicate): events nobody asked for yet stay queued,
// so several requests can be in flight on one connection and each waits for
// its own id.
"use strict";
const WebSocket = require("ws");
const { encode, decode } = require("@msgpack/msgpack");

const PROTOCOL = "kdaserve.v1";

function nowMs() {
  return Number(process.hrtime.bigint()) / 1e6;
}

function describe(ev) {
  if (ev === undefined || ev === null || typeof ev !== "object") return String(ev);
  const { __binary, __t, ...rest } = ev;
  let s = JSON.stringify(rest);
  if (s.length > 300) s = s.slice(0, 300) + "...";
  return (__binary ? "[msgpack] " : "") + s;
}

class KdsClient {
  constructor(ws) {
    this.ws = ws;
    this.queue = [];   // events received and not yet taken
    this.waiters = []; // {pred, resolve, reject, timer}
    this.seen = [];    // the last few events, for error messages
    this.closeInfo = null;
    this.closeWaiters = [];
    this.errors = [];
    this.nextId = 1;
    this.hello = null;
    ws.on("message", (data, isBinary) => this._onMessage(data, isBinary));
    ws.on("close", (code, reason) => this._onClose(code, reason.toString()));
    ws.on("error", (e) => this.errors.push(e)); // reported through close / timeouts
  }

  // Connect, wait for `hello` (and authenticate with the `auth` op when
  // opts.token is given). opts: protocols (default ["kdaserve.v1"]; [] for
  // none), headers, token, bearer (a token sent as Authorization: Bearer),
  // timeoutMs, wsOptions (passed to ws).
  static connect(url, opts = {}) {
    const protocols = opts.protocols === undefined ? [PROTOCOL] : opts.protocols;
    const headers = { ...(opts.headers || {}) };
    if (opts.bearer) headers.Authorization = "Bearer " + opts.bearer;
    const timeoutMs = opts.timeoutMs || 30000;
    return new Promise((resolve, reject) => {
      let settled = false;
      const ws = new WebSocket(url, protocols, {
        headers,
        handshakeTimeout: timeoutMs,
        ...(opts.wsOptions || {}),
      });
      const c = new KdsClient(ws);
      const fail = (e) => {
        if (settled) return;
        settled = true;
        try { ws.terminate(); } catch (_) { /* already gone */ }
        reject(e);
      };
      ws.once("unexpected-response", (req, res) => {
        const err = new Error(`handshake refused: HTTP ${res.statusCode}`);
        err.httpStatus = res.statusCode;
        fail(err);
      });
      ws.once("error", (e) => fail(new Error(`cannot connect to ${url}: ${e.message}`)));
      ws.once("open", async () => {
        try {
          c.hello = await c.next((e) => e.event === "hello", timeoutMs, "the hello event");
          if (opts.token !== undefined) {
            const r = await c.request({ op: "auth", token: opts.token });
            if (r.event !== "result") throw new Error(`auth failed: ${describe(r)}`);
            c.tenant = r.tenant;
          }
          settled = true;
          resolve(c);
        } catch (e) {
          fail(e);
        }
      });
    });
  }

  get protocol() {
    return this.ws.protocol;
  }

  _onMessage(data, isBinary) {
    let ev;
    try {
      ev = isBinary ? decode(data) : JSON.parse(data.toString("utf8"));
    } catch (e) {
      ev = { event: "__unparseable", raw: data.toString(isBinary ? "hex" : "utf8").slice(0, 200) };
    }
    if (ev === null || typeof ev !== "object" || Array.isArray(ev))
      ev = { event: "__not_an_object", raw: ev };
    ev.__binary = isBinary;
    ev.__t = nowMs();
    this.seen.push(ev);
    if (this.seen.length > 8) this.seen.shift();
    for (let i = 0; i < this.waiters.length; i++) {
      const w = this.waiters[i];
      if (w.pred(ev)) {
        this.waiters.splice(i, 1);
        clearTimeout(w.timer);
        w.resolve(ev);
        return;
      }
    }
    this.queue.push(ev);
  }

  _onClose(code, reason) {
    this.closeInfo = { code, reason, t: nowMs() };
    for (const w of this.waiters) {
      clearTimeout(w.timer);
      w.reject(new Error(`connection closed (code ${code}${reason ? " " + reason : ""}) ` +
                         `while waiting for ${w.what}; last events: ` +
                         this.seen.map(describe).join(" | ")));
    }
    this.waiters = [];
    for (const w of this.closeWaiters) w(this.closeInfo);
    this.closeWaiters = [];
  }

  // The first queued or future event matching pred (removed from the queue).
  next(pred, timeoutMs = 60000, what = "an event") {
    const i = this.queue.findIndex(pred);
    if (i >= 0) return Promise.resolve(this.queue.splice(i, 1)[0]);
    if (this.closeInfo)
      return Promise.reject(new Error(`connection already closed (code ${this.closeInfo.code}) ` +
                                      `while waiting for ${what}`));
    return new Promise((resolve, reject) => {
      const w = { pred, resolve, reject, what };
      w.timer = setTimeout(() => {
        this.waiters.splice(this.waiters.indexOf(w), 1);
        reject(new Error(`timed out after ${timeoutMs} ms waiting for ${what}; last events: ` +
                         (this.seen.map(describe).join(" | ") || "none")));
      }, timeoutMs);
      this.waiters.push(w);
    });
  }

  // Is there a queued event matching pred (not removed)?
  peek(pred) {
    return this.queue.find(pred);
  }

  send(obj, opts = {}) {
    if (opts.binary) this.ws.send(Buffer.from(encode(obj)), { binary: true });
    else this.ws.send(JSON.stringify(obj));
  }

  sendRaw(data, opts = {}) {
    this.ws.send(data, opts);
  }

  // One-shot request: fills in an id when absent, resolves with its
  // `result` or `error` event.
  request(obj, opts = {}) {
    const req = obj.id === undefined ? { id: this.nextId++, ...obj } : obj;
    this.send(req, opts);
    return this.next((e) => e.id === req.id && (e.event === "result" || e.event === "error"),
                     opts.timeoutMs || 60000, `the answer to ${JSON.stringify(req).slice(0, 120)}`);
  }

  // Like request, but throws unless the answer is a `result`.
  async ok(obj, opts = {}) {
    const r = await this.request(obj, opts);
    if (r.event !== "result") throw new Error(`${obj.op} failed: ${describe(r)}`);
    return r;
  }

  // Send a generate and collect its stream. Returns {id, events, started,
  // tokens (texts), tokenTimes, done, error, text, tSend}. Stops at `done`
  // or `error`. opts.onEvent(ev, r) is called for every event as it comes.
  startGenerate(obj, opts = {}) {
    const req = { op: "generate", ...obj };
    if (req.id === undefined) req.id = this.nextId++;
    const r = { id: req.id, events: [], started: null, tokens: [], tokenTimes: [], done: null,
                error: null, text: "", tSend: nowMs() };
    this.send(req, opts);
    r.finished = (async () => {
      for (;;) {
        const ev = await this.next((e) => e.id === req.id, opts.timeoutMs || 120000,
                                   `the stream of generate id ${JSON.stringify(req.id)}`);
        r.events.push(ev);
        if (ev.event === "started") r.started = ev;
        else if (ev.event === "token") {
          r.tokens.push(ev.text);
          r.tokenTimes.push(ev.__t);
        } else if (ev.event === "done") r.done = ev;
        else if (ev.event === "error") r.error = ev;
        if (opts.onEvent) opts.onEvent(ev, r);
        if (r.done || r.error || (ev.event !== "started" && ev.event !== "token")) break;
      }
      r.text = r.tokens.join("");
      return r;
    })();
    return r;
  }

  generate(obj, opts = {}) {
    return this.startGenerate(obj, opts).finished;
  }

  waitClose(timeoutMs = 30000) {
    if (this.closeInfo) return Promise.resolve(this.closeInfo);
    return new Promise((resolve, reject) => {
      const t = setTimeout(() => reject(new Error(`no close within ${timeoutMs} ms`)), timeoutMs);
      this.closeWaiters.push((info) => {
        clearTimeout(t);
        resolve(info);
      });
    });
  }

  // Polite close; resolves when the close handshake is over (or 5 s passed).
  async close() {
    if (this.closeInfo) return this.closeInfo;
    try { this.ws.close(1000); } catch (_) { /* not open yet */ }
    try { return await this.waitClose(5000); } catch (_) { this.ws.terminate(); return null; }
  }

  // Drop the TCP connection without a close frame.
  terminate() {
    this.ws.terminate();
  }
}

module.exports = { KdsClient, PROTOCOL, nowMs, describe, encode, decode };
