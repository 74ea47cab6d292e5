/*
 * app.js - the kdaserve web chat page: one WebSocket speaking kdaserve.v1
 * (docs/protocol.md, the only contract), JSON frames only. Plain script, no
 * build step, no external resources, no inline code (works under a strict
 * CSP: default-src 'self').
 *
 * The server is the same origin: ws(s)://<host>/ with subprotocol
 * "kdaserve.v1". For development the page also takes ?server=ws://HOST:PORT/
 * (so it can be loaded from another static server or a file:// URL).
 *
 * Stable hooks for tests (id == data-testid unless noted):
 *   conn-state        connection state; data-state = idle | connecting |
 *                     authenticating | connected | reconnecting | refused |
 *                     needs-token | no-server
 *   model-name        the model the server runs (from hello/info)
 *   auth-token, btn-auth   token field (kept in localStorage) and its button;
 *                     using a token reconnects and sends {"op":"auth"} first
 *   error-banner      shown on an error; error-code holds the protocol code,
 *                     error-message the text; error-close hides it
 *   session-list      the sessions; each is an li with
 *                     data-testid="session-item", data-session=<name>,
 *                     aria-selected="true" when open
 *   btn-new, btn-fork, btn-rename, btn-delete, btn-refresh
 *   dialog            the modal used by new/fork/rename/delete/restore, with
 *                     dialog-title, dialog-name, dialog-mode, dialog-system,
 *                     dialog-ok, dialog-cancel
 *   stats-tokens, stats-mode, stats-state, stats-state-bytes,
 *   stats-resume-ms, stats-prefill, stats-decode   per-session figures
 *   btn-snapshots     toggles the snapshot view: snapshot-list holds li
 *                     data-testid="snapshot-item" data-snapshot=<id>, each
 *                     with a button data-testid="snapshot-restore"
 *   chat-title        name of the open session
 *   transcript        the conversation: div data-testid="msg-user" and
 *                     data-testid="msg-assistant"; an assistant reply carries
 *                     data-streaming="true" while tokens arrive,
 *                     data-token-events=<token events received>, and on done
 *                     data-reason=<stop|length|cancelled|error>; its text is
 *                     in the child .msg-body
 *   gen-status        data-state = idle | waiting | generating | stopping |
 *                     done | failed; data-reason as above after done
 *   message-input     Enter sends, Shift+Enter is a newline
 *   btn-send, btn-stop  (stop sends {"op":"cancel","target":<generate id>})
 *   settings          <details> with raw-toggle (send "text" instead of
 *                     "message"), set-temperature, set-max-tokens
 *   btn-attach, file-input   attach a file: it is sent through {"op":"append"}
 *                     in chunks (base64), the composer's text untouched
 *   ingest-status     data-state = idle | sending | done | cancelled | failed,
 *                     with ingest-progress (a <progress>), ingest-text
 *                     (bytes, tokens, tok/s, ETA) and btn-ingest-cancel
 *   msg-document      an ingested document in the transcript: a collapsed
 *                     <details> with data-name, data-bytes, data-tokens; its
 *                     summary says name, size and tokens, its body the start
 *                     of the text
 */
'use strict';

(() => {
  const $ = (id) => document.getElementById(id);
  const el = {};
  for (const id of [
    'btn-sidebar', 'model-name', 'conn-state', 'auth-form', 'auth-token', 'error-banner',
    'error-code', 'error-message', 'error-close', 'sidebar', 'btn-new', 'btn-fork',
    'btn-rename', 'btn-delete', 'btn-refresh', 'session-list', 'session-empty',
    'stats-tokens', 'stats-mode', 'stats-state', 'stats-state-bytes', 'stats-resume-ms',
    'stats-prefill', 'stats-decode', 'btn-snapshots', 'snapshots', 'snapshot-list',
    'chat-title', 'transcript', 'gen-status', 'composer', 'message-input', 'btn-send',
    'btn-stop', 'raw-toggle', 'set-temperature', 'set-max-tokens', 'dlg', 'dlg-form',
    'dlg-title', 'dlg-text', 'dlg-name-row', 'dlg-name', 'dlg-mode-row', 'dlg-mode',
    'dlg-system-row', 'dlg-system', 'dlg-ok', 'dlg-cancel', 'btn-attach', 'file-input',
    'ingest-status', 'ingest-progress', 'ingest-text', 'btn-ingest-cancel',
  ]) el[id] = $(id);

  const NAME_RE = /^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$/;
  const BACKOFF_MIN_MS = 500;
  const BACKOFF_MAX_MS = 15000;
  const FLUSH_MS = 40; // streamed text is drawn at most this often

  const st = {
    ws: null,
    nextId: 1,
    pending: new Map(), // id -> {resolve, reject} of one-shot requests
    gens: new Map(), // id -> generation record, while it runs
    gen: null, // the generation this page started and has not seen end
    ingest: null, // the document this page is sending (see attachFile)
    maxMessage: 1048576, // the server's --max-message (from info)
    backoff: BACKOFF_MIN_MS,
    retryTimer: null,
    retryTick: null, // the countdown shown while waiting to reconnect
    retryAt: 0,
    hello: null,
    sessions: [],
    current: null, // name of the open session
    openSeq: 0, // guards against a slow open overwriting a newer one
  };

  /* ---------- small helpers ---------- */

  const store = {
    get(k) {
      try { return localStorage.getItem(k); } catch (_) { return null; }
    },
    set(k, v) {
      try {
        if (v === null || v === '') localStorage.removeItem(k);
        else localStorage.setItem(k, v);
      } catch (_) { /* storage disabled: settings just are not remembered */ }
    },
  };

  function node(tag, attrs, text) {
    const n = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === 'class') n.className = v;
      else n.setAttribute(k, v);
    }
    if (text !== undefined) n.textContent = text;
    return n;
  }

  function fmtNum(x, digits) {
    if (typeof x !== 'number' || !isFinite(x)) return '–';
    return x.toLocaleString(undefined, { maximumFractionDigits: digits || 0 });
  }

  function fmtBytes(b) {
    if (typeof b !== 'number') return '–';
    if (b < 1024) return b + ' B';
    if (b < 1024 * 1024) return fmtNum(b / 1024, 1) + ' KiB';
    return fmtNum(b / (1024 * 1024), 1) + ' MiB';
  }

  function fmtTime(us) {
    if (typeof us !== 'number') return '';
    return new Date(us / 1000).toLocaleString();
  }

  /* ---------- error banner ---------- */

  function showError(code, message) {
    el['error-code'].textContent = code || 'error';
    el['error-message'].textContent = message || '';
    el['error-banner'].hidden = false;
    console.warn('kdaserve error:', code, message);
  }

  function hideError() {
    el['error-banner'].hidden = true;
  }

  /* ---------- connection ---------- */

  function wsUrl() {
    const q = new URLSearchParams(location.search).get('server');
    if (q) return q;
    if (!location.host) return null;
    return (location.protocol === 'https:' ? 'wss:' : 'ws:') + '//' + location.host + '/';
  }

  const CONN_TEXT = {
    idle: 'not connected',
    connecting: 'connecting…',
    authenticating: 'authenticating…',
    connected: 'connected',
    reconnecting: 'disconnected',
    refused: 'token refused',
    'needs-token': 'token needed',
    'no-server': 'no server',
  };

  function setConn(state, extra) {
    el['conn-state'].dataset.state = state;
    el['conn-state'].textContent = CONN_TEXT[state] + (extra ? ' ' + extra : '');
    updateControls();
  }

  function connected() {
    return el['conn-state'].dataset.state === 'connected';
  }

  function connect() {
    clearTimeout(st.retryTimer);
    clearInterval(st.retryTick);
    st.retryTimer = null;
    if (st.ws) {
      const old = st.ws;
      st.ws = null; // its close event is then ignored
      old.close(1000);
      connectionLost();
    }
    const url = wsUrl();
    if (!url) {
      setConn('no-server');
      showError('no_server', 'this page has no server: open it from kdaserve serve, or add ?server=ws://HOST:PORT/');
      return;
    }
    let ws;
    try {
      ws = new WebSocket(url, 'kdaserve.v1');
    } catch (e) {
      showError('connect', String(e.message || e));
      scheduleRetry();
      return;
    }
    st.ws = ws;
    st.hello = null;
    setConn('connecting');
    ws.onmessage = (ev) => {
      if (st.ws !== ws) return;
      if (typeof ev.data !== 'string') return; // we send JSON, so all answers are JSON
      let msg;
      try {
        msg = JSON.parse(ev.data);
      } catch (_) {
        showError('bad_frame', 'the server sent a frame that is not JSON');
        return;
      }
      if (msg && typeof msg === 'object') onEvent(msg);
    };
    ws.onclose = (ev) => {
      if (st.ws !== ws) return;
      st.ws = null;
      connectionLost();
      if (ev.code === 1008) {
        // Wrong token: retrying with the same one cannot work.
        setConn('refused');
        showError('unauthenticated', 'the server refused the token (close 1008): enter a valid one');
        return;
      }
      if (ev.code === 1009) showError('too_big', 'the server closed the connection: message too large (1009)');
      else if (ev.code === 1013) showError('limit', 'the server has too many connections (1013); retrying');
      scheduleRetry();
    };
  }

  /* Everything that was waiting on the socket fails; a running generation
   * ends (the server keeps and saves what it generated). */
  function connectionLost() {
    for (const [, p] of st.pending) p.reject({ code: 'disconnected', message: 'connection lost' });
    st.pending.clear();
    for (const [, g] of st.gens) finishGen(g, { reason: 'disconnected' });
    st.gens.clear();
    if (st.ingest) finishIngest(st.ingest, { reason: 'disconnected' });
  }

  function scheduleRetry() {
    const delay = Math.round(st.backoff * (0.75 + Math.random() * 0.5));
    st.backoff = Math.min(st.backoff * 2, BACKOFF_MAX_MS);
    st.retryAt = Date.now() + delay;
    const tick = () => {
      const left = Math.max(0, Math.ceil((st.retryAt - Date.now()) / 1000));
      setConn('reconnecting', '— retrying in ' + left + ' s');
    };
    tick();
    st.retryTick = setInterval(tick, 1000);
    st.retryTimer = setTimeout(connect, delay);
  }

  function sendJson(obj) {
    if (!st.ws || st.ws.readyState !== WebSocket.OPEN) return false;
    st.ws.send(JSON.stringify(obj));
    return true;
  }

  /* One-shot request: resolves with the result event, rejects with the error
   * event ({code, message}). */
  function request(obj) {
    const id = st.nextId++;
    return new Promise((resolve, reject) => {
      if (!sendJson(Object.assign({ id }, obj))) {
        reject({ code: 'disconnected', message: 'not connected' });
        return;
      }
      st.pending.set(id, { resolve, reject });
    });
  }

  /* request() that shows a failure in the banner and returns null. */
  async function call(obj) {
    try {
      return await request(obj);
    } catch (e) {
      showError(e.code, e.message);
      return null;
    }
  }

  function onEvent(msg) {
    const id = msg.id;
    if (msg.event === 'hello') {
      onHello(msg);
      return;
    }
    if (id !== null && id !== undefined && st.gens.has(id)) {
      onGenEvent(st.gens.get(id), msg);
      return;
    }
    // a document's progress and done carry the id of its first chunk
    if (st.ingest && id === st.ingest.id && (msg.event === 'progress' || msg.event === 'done')) {
      onIngestEvent(st.ingest, msg);
      return;
    }
    if (id !== null && id !== undefined && st.pending.has(id)) {
      const p = st.pending.get(id);
      st.pending.delete(id);
      if (msg.event === 'error') p.reject({ code: msg.code, message: msg.message });
      else p.resolve(msg);
      return;
    }
    if (msg.event === 'error') showError(msg.code, msg.message);
  }

  async function onHello(msg) {
    st.hello = msg;
    el['model-name'].textContent = msg.model ? 'model: ' + msg.model : '';
    const token = store.get('kds.token');
    if (token) {
      setConn('authenticating');
      try {
        await request({ op: 'auth', token });
      } catch (e) {
        if (e.code === 'disconnected') return;
        showError(e.code, e.message);
        // A wrong token is closed with 1008 by the server; a server without
        // auth may refuse the op yet serve us anonymously.
        if (msg.auth_required) return;
      }
    } else if (msg.auth_required) {
      setConn('needs-token');
      showError('unauthenticated', 'this server needs a token: enter it at the top');
      return;
    }
    st.backoff = BACKOFF_MIN_MS;
    setConn('connected');
    request({ op: 'info' }).then((r) => {
      if (r.model && r.model.name) el['model-name'].textContent = 'model: ' + r.model.name;
      if (r.limits && r.limits.max_tokens) el['set-max-tokens'].max = r.limits.max_tokens;
      if (r.limits && r.limits.max_message_bytes) st.maxMessage = r.limits.max_message_bytes;
    }, () => { /* info is decoration only */ });
    await refreshList();
    const want = st.current || store.get('kds.session');
    if (want && st.sessions.some((s) => s.name === want)) {
      openSession(want);
    } else if (st.current) { // gone while we were away (deleted elsewhere, other store)
      st.current = null;
      store.set('kds.session', null);
      clearSessionView();
      renderList();
      updateControls();
    }
  }

  /* ---------- sessions ---------- */

  async function refreshList() {
    const r = await call({ op: 'list' });
    if (!r) return;
    st.sessions = Array.isArray(r.sessions) ? r.sessions : [];
    st.sessions.sort((a, b) => (b.updated || 0) - (a.updated || 0));
    renderList();
  }

  function renderList() {
    const ul = el['session-list'];
    ul.replaceChildren();
    for (const s of st.sessions) {
      const li = node('li', {
        'data-testid': 'session-item',
        'data-session': s.name,
        'aria-selected': String(s.name === st.current),
        tabindex: '0',
        role: 'option',
      });
      li.append(node('span', { class: 'session-name' }, s.name));
      const meta = fmtNum(s.tokens) + ' tok · ' + (s.mode || '?') + (s.parent ? ' · from ' + s.parent : '');
      li.append(node('span', { class: 'session-meta' }, meta));
      if (s.state && s.state !== 'cold') li.append(node('span', { class: 'badge ' + s.state }, s.state));
      li.addEventListener('click', () => openSession(s.name));
      li.addEventListener('keydown', (e) => {
        if (e.key === 'Enter' || e.key === ' ') {
          e.preventDefault();
          openSession(s.name);
        }
      });
      ul.append(li);
    }
    el['session-empty'].hidden = st.sessions.length > 0 || !connected();
  }

  function clearSessionView() {
    el['transcript'].replaceChildren();
    el['chat-title'].textContent = 'No session open';
    for (const k of ['tokens', 'mode', 'state', 'state-bytes', 'resume-ms', 'prefill', 'decode'])
      el['stats-' + k].textContent = '–';
    el['snapshots'].hidden = true;
    el['snapshot-list'].replaceChildren();
  }

  async function openSession(name) {
    const seq = ++st.openSeq;
    st.current = name;
    store.set('kds.session', name);
    renderList();
    clearSessionView();
    // the last reply's summary belongs to the session it came from
    if (!st.gen) setGenStatus('idle', '');
    el['chat-title'].textContent = name;
    el['sidebar'].classList.remove('open');
    el['btn-sidebar'].setAttribute('aria-expanded', 'false');
    updateControls();
    const r = await call({ op: 'open', session: name });
    if (seq !== st.openSeq) return;
    if (!r) {
      st.current = null;
      store.set('kds.session', null);
      renderList();
      clearSessionView();
      updateControls();
      return;
    }
    el['chat-title'].textContent = r.session || name;
    el['stats-tokens'].textContent = fmtNum(r.tokens);
    el['stats-mode'].textContent = r.mode || '–';
    el['stats-state-bytes'].textContent = fmtBytes(r.state_bytes);
    el['stats-resume-ms'].textContent = fmtNum(r.resume_ms, 2) + ' ms';
    const h = await call({ op: 'history', session: name, last: 100 });
    if (seq !== st.openSeq) return;
    const turns = h && Array.isArray(h.turns) ? h.turns : r.last_turns || [];
    for (const t of turns) {
      if (t.document) {
        addDocument(t.document, t.prompt, !!t.document.clipped);
        continue;
      }
      if (t.prompt) addMessage('user', t.prompt);
      if (!t.reply) continue; // e.g. the system text a session was created with
      const m = addMessage('assistant', t.reply);
      m.dataset.streaming = 'false';
    }
    if (st.ingest && st.ingest.session === name) showIngest(st.ingest);
    // A reply still streaming into this session from this page goes last.
    if (st.gen && st.gen.session === name) {
      if (st.gen.userEl) el['transcript'].append(st.gen.userEl);
      el['transcript'].append(st.gen.el);
    }
    scrollToEnd(true);
    refreshStats();
    el['message-input'].focus();
  }

  async function refreshStats() {
    const name = st.current;
    if (!name || !connected()) return;
    let r;
    try {
      r = await request({ op: 'stats', session: name });
    } catch (e) {
      if (e.code !== 'not_found' && e.code !== 'disconnected') showError(e.code, e.message);
      return;
    }
    if (name !== st.current || !r.session) return;
    const s = r.session;
    el['stats-tokens'].textContent = fmtNum(s.tokens);
    el['stats-mode'].textContent = s.mode || '–';
    el['stats-state'].textContent = s.state || '–';
    el['stats-state-bytes'].textContent = fmtBytes(s.state_bytes);
    if (typeof s.last_resume_ms === 'number')
      el['stats-resume-ms'].textContent = fmtNum(s.last_resume_ms, 2) + ' ms';
    // 0: nothing prefilled or decoded yet in this server's run (not a rate)
    el['stats-prefill'].textContent = s.last_prefill_tok_s > 0
      ? fmtNum(s.last_prefill_tok_s, 1) + ' tok/s' : '–';
    el['stats-decode'].textContent = s.last_decode_tok_s > 0
      ? fmtNum(s.last_decode_tok_s, 1) + ' tok/s' : '–';
  }

  /* The modal: resolves with {name, mode, system} on OK, null otherwise. */
  function ask(opts) {
    return new Promise((resolve) => {
      const d = el['dlg'];
      el['dlg-title'].textContent = opts.title;
      el['dlg-text'].textContent = opts.text || '';
      el['dlg-name-row'].hidden = !opts.name;
      el['dlg-mode-row'].hidden = !opts.mode;
      el['dlg-system-row'].hidden = !opts.system;
      el['dlg-name'].value = opts.name ? opts.name.value || '' : '';
      el['dlg-name'].placeholder = opts.name ? opts.name.placeholder || '' : '';
      el['dlg-mode'].value = '';
      el['dlg-system'].value = '';
      el['dlg-ok'].textContent = opts.ok || 'OK';
      el['dlg-ok'].classList.toggle('danger', !!opts.danger);
      d.returnValue = '';
      const onClose = () => {
        d.removeEventListener('close', onClose);
        if (d.returnValue !== 'ok') {
          resolve(null);
          return;
        }
        resolve({
          name: el['dlg-name'].value.trim(),
          mode: el['dlg-mode'].value,
          system: el['dlg-system'].value,
        });
      };
      d.addEventListener('close', onClose);
      d.showModal();
      if (opts.name) el['dlg-name'].select();
    });
  }

  async function newSession() {
    const a = await ask({
      title: 'New session', name: { placeholder: 'name (optional)' }, mode: true, system: true,
      ok: 'Create',
    });
    if (!a) return;
    const req = { op: 'create' };
    if (a.name) req.session = a.name;
    if (a.mode) req.mode = a.mode;
    if (a.system) req.system = a.system;
    const r = await call(req);
    if (!r) return;
    await refreshList();
    openSession(r.session);
  }

  async function forkSession() {
    const from = st.current;
    if (!from) return;
    const a = await ask({
      title: 'Fork ' + from, text: 'A new session with the same state and history; the original stays as it is.',
      name: { placeholder: 'name (optional)' }, ok: 'Fork',
    });
    if (!a) return;
    const req = { op: 'fork', session: from };
    if (a.name) req.name = a.name;
    const r = await call(req);
    if (!r) return;
    await refreshList();
    openSession(r.session);
  }

  async function renameSession() {
    const from = st.current;
    if (!from) return;
    const a = await ask({ title: 'Rename ' + from, name: { value: from }, ok: 'Rename' });
    if (!a || !a.name || a.name === from) return;
    const r = await call({ op: 'rename', session: from, name: a.name });
    if (!r) return;
    if (st.current === from) {
      st.current = r.session || a.name;
      store.set('kds.session', st.current);
      el['chat-title'].textContent = st.current;
    }
    await refreshList();
    if (!el['snapshots'].hidden) loadSnapshots();
  }

  async function deleteSession() {
    const name = st.current;
    if (!name) return;
    const a = await ask({
      title: 'Delete ' + name + '?', text: 'Its snapshots stay in the store until garbage collection.',
      ok: 'Delete', danger: true,
    });
    if (!a) return;
    const r = await call({ op: 'delete', session: name });
    if (!r) return;
    if (st.current === name) {
      st.current = null;
      store.set('kds.session', null);
      clearSessionView();
    }
    await refreshList();
    updateControls();
  }

  async function loadSnapshots() {
    const name = st.current;
    if (!name) return;
    const r = await call({ op: 'snapshots', session: name });
    if (!r || name !== st.current) return;
    const ul = el['snapshot-list'];
    ul.replaceChildren();
    const snaps = Array.isArray(r.snapshots) ? r.snapshots : [];
    if (snaps.length === 0) ul.append(node('li', { class: 'muted small' }, 'no snapshots'));
    for (const p of snaps) {
      const li = node('li', { 'data-testid': 'snapshot-item', 'data-snapshot': String(p.id) });
      const label = node('span', { class: 'snap-label' });
      label.append(node('strong', {}, '#' + p.id), ' ' + fmtNum(p.tokens) + ' tok');
      label.title = fmtTime(p.created);
      li.append(label, node('span', { class: 'muted small' }, fmtTime(p.created)));
      const b = node('button', { type: 'button', 'data-testid': 'snapshot-restore', class: 'small' }, 'Restore');
      b.addEventListener('click', () => restoreSnapshot(p.id));
      li.append(b);
      ul.append(li);
    }
  }

  async function toggleSnapshots() {
    const box = el['snapshots'];
    box.hidden = !box.hidden;
    el['btn-snapshots'].setAttribute('aria-expanded', String(!box.hidden));
    if (!box.hidden) await loadSnapshots();
  }

  async function restoreSnapshot(id) {
    const a = await ask({
      title: 'Restore snapshot #' + id, text: 'Makes a new session that continues this snapshot; nothing is changed or lost.',
      name: { placeholder: 'name (optional)' }, ok: 'Restore',
    });
    if (!a) return;
    const req = { op: 'restore', snapshot: id };
    if (a.name) req.name = a.name;
    const r = await call(req);
    if (!r) return;
    await refreshList();
    openSession(r.session);
  }

  /* ---------- transcript and generation ---------- */

  function nearBottom() {
    const t = el['transcript'];
    return t.scrollHeight - t.scrollTop - t.clientHeight < 80;
  }

  function scrollToEnd(force) {
    const t = el['transcript'];
    if (force || nearBottom()) t.scrollTop = t.scrollHeight;
  }

  function addMessage(role, text) {
    const m = node('div', { class: 'msg ' + role, 'data-testid': 'msg-' + role });
    m.append(node('div', { class: 'msg-role' }, role === 'user' ? 'you' : 'model'));
    const body = node('div', { class: 'msg-body' });
    body.append(document.createTextNode(text));
    m.append(body);
    el['transcript'].append(m);
    return m;
  }

  /* An ingested document: collapsed, its name, size and tokens in the
   * summary; opened, the start of its text. */
  function addDocument(doc, preview, clipped, reason) {
    const m = node('details', {
      class: 'msg document', 'data-testid': 'msg-document', 'data-name': doc.name || '',
      'data-bytes': String(doc.bytes), 'data-tokens': String(doc.tokens),
    });
    if (reason) m.dataset.reason = reason;
    const sum = node('summary', {});
    sum.append(node('span', { class: 'msg-role' }, 'document '), node('span', { class: 'doc-name' }, doc.name || ''),
      node('span', { class: 'doc-meta muted small' },
        ' · ' + fmtBytes(doc.bytes) + ' · ' + fmtNum(doc.tokens) + ' tokens'));
    m.append(sum);
    const body = node('div', { class: 'msg-body' });
    body.append(document.createTextNode((preview || '') + (clipped ? '…' : '')));
    m.append(body);
    el['transcript'].append(m);
    return m;
  }

  function setGenStatus(state, text, reason) {
    const s = el['gen-status'];
    s.dataset.state = state;
    if (reason) s.dataset.reason = reason;
    else delete s.dataset.reason;
    s.textContent = text;
  }

  function settings() {
    const req = {};
    const t = parseFloat(el['set-temperature'].value);
    if (isFinite(t) && t >= 0) req.temperature = t;
    const n = parseInt(el['set-max-tokens'].value, 10);
    if (isFinite(n) && n > 0) req.max_tokens = n;
    return req;
  }

  function sendMessage() {
    if (!st.current || st.gen || !connected()) return;
    if (st.ingest && st.ingest.session === st.current) return; // busy: the text stays
    const raw = el['raw-toggle'].checked;
    const text = el['message-input'].value;
    if (!raw && text.trim() === '') return; // raw "" continues the context
    const id = st.nextId++;
    const req = Object.assign({ id, op: 'generate', session: st.current }, settings());
    if (raw) req.text = text;
    else req.message = text;
    const userEl = text ? addMessage('user', text) : null;
    const m = addMessage('assistant', '');
    m.dataset.streaming = 'true';
    m.dataset.tokenEvents = '0';
    const g = {
      id, session: st.current, el: m, userEl, text: '', textNode: m.querySelector('.msg-body').firstChild,
      tokenEvents: 0, started: false, input: text,
      pending: '', lastFlush: -Infinity, flushTimer: null, // see scheduleFlush
    };
    st.gens.set(id, g);
    st.gen = g;
    if (!sendJson(req)) {
      st.gens.delete(id);
      finishGen(g, { reason: 'disconnected' });
      return;
    }
    el['message-input'].value = '';
    setGenStatus('waiting', 'waiting for the server…');
    scrollToEnd(true);
    updateControls();
  }

  function onGenEvent(g, msg) {
    switch (msg.event) {
      case 'started':
        g.started = true;
        if (!g.stopping)
          setGenStatus('generating', 'generating… (prompt ' + fmtNum(msg.prompt_tokens) + ' tokens after '
            + fmtNum(msg.context) + ')');
        break;
      case 'token':
        if (typeof msg.text === 'string' && msg.text) {
          g.text += msg.text;
          g.pending += msg.text;
          g.tokenEvents++;
          g.el.dataset.tokenEvents = String(g.tokenEvents);
          scheduleFlush(g);
        }
        break;
      case 'done':
        st.gens.delete(g.id);
        finishGen(g, msg);
        break;
      case 'error': // could not start
        st.gens.delete(g.id);
        showError(msg.code, msg.message);
        g.el.remove();
        if (g.userEl) g.userEl.remove();
        if (el['message-input'].value === '') el['message-input'].value = g.input;
        if (st.gen === g) st.gen = null;
        setGenStatus('failed', 'not sent: ' + msg.code, 'error');
        updateControls();
        break;
      default:
        break;
    }
  }

  /* Streamed text reaches the DOM at most every FLUSH_MS: a fast model sends
   * thousands of token events a second, and a layout (and scroll) for each
   * would keep the page too busy to take a click on Stop. The first piece
   * shows at once. */
  function scheduleFlush(g) {
    const wait = g.lastFlush + FLUSH_MS - performance.now();
    if (wait <= 0) flush(g);
    else if (!g.flushTimer) g.flushTimer = setTimeout(() => flush(g), wait);
  }

  function flush(g) {
    clearTimeout(g.flushTimer);
    g.flushTimer = null;
    if (!g.pending) return;
    const stick = nearBottom();
    g.textNode.appendData(g.pending);
    g.pending = '';
    g.lastFlush = performance.now();
    if (stick) scrollToEnd(true);
  }

  function finishGen(g, msg) {
    const reason = msg.reason || 'error';
    flush(g);
    // `reply` is the whole text: authoritative if a piece was missed.
    if (typeof msg.reply === 'string' && msg.reply !== g.text) {
      g.text = msg.reply;
      g.textNode.data = msg.reply;
    }
    g.el.dataset.streaming = 'false';
    g.el.dataset.reason = reason;
    if (st.gen === g) st.gen = null;
    if (reason === 'disconnected') {
      setGenStatus('failed', 'connection lost while generating (the server saved what it had)', reason);
    } else {
      const parts = [reason];
      if (typeof msg.tokens === 'number') parts.push(fmtNum(msg.tokens) + ' tokens');
      if (typeof msg.decode_tok_s === 'number') parts.push(fmtNum(msg.decode_tok_s, 1) + ' tok/s');
      if (typeof msg.prefill_ms === 'number') parts.push('prefill ' + fmtNum(msg.prefill_ms, 1) + ' ms');
      setGenStatus('done', 'done: ' + parts.join(' · '), reason);
      if (reason === 'error' && msg.error) showError(msg.error.code, msg.error.message);
      refreshList();
      if (g.session === st.current) refreshStats();
    }
    updateControls();
  }

  async function stopGen() {
    const g = st.gen;
    if (!g) return;
    g.stopping = true;
    el['btn-stop'].disabled = true;
    setGenStatus('stopping', 'stopping…');
    const r = await call({ op: 'cancel', target: g.id });
    // Not started yet on the server, or already ending: try by session.
    if (r && r.cancelled === false && st.gens.has(g.id)) await call({ op: 'cancel', session: g.session });
  }

  /* ---------- attach a file (op append) ---------- */

  // Bytes of the file per chunk: base64 makes 4 of every 3, and the message
  // must stay within the server's --max-message.
  function chunkBytes() {
    const fit = Math.floor((st.maxMessage - 2048) / 4) * 3;
    return Math.max(3, Math.min(256 * 1024, fit));
  }

  function toBase64(bytes) {
    let s = '';
    for (let i = 0; i < bytes.length; i += 0x8000)
      s += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
    return btoa(s);
  }

  function fmtEta(s) {
    if (typeof s !== 'number' || !isFinite(s)) return '–';
    s = Math.round(s);
    const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
    const two = (x) => String(x).padStart(2, '0');
    return h ? h + ':' + two(m) + ':' + two(sec) : m + ':' + two(sec);
  }

  function setIngestStatus(state, text, frac) {
    el['ingest-status'].hidden = state === 'idle';
    el['ingest-status'].dataset.state = state;
    el['ingest-text'].textContent = text;
    if (typeof frac === 'number') el['ingest-progress'].value = Math.max(0, Math.min(1, frac));
    el['btn-ingest-cancel'].hidden = state !== 'sending';
  }

  function showIngest(ing) {
    const p = ing.progress;
    const parts = [ing.name + ': ' + fmtBytes(ing.sent) + ' of ' + fmtBytes(ing.size) + ' sent'];
    let frac = ing.size ? ing.sent / ing.size / 2 : 0;
    if (p) {
      parts.push(fmtNum(p.tokens) + ' of ' + fmtNum(p.total) + ' tokens');
      if (typeof p.tok_s === 'number') parts.push(fmtNum(p.tok_s) + ' tok/s');
      parts.push('ETA ' + fmtEta(p.eta_s));
      // the bar: prefilled tokens against the estimated total
      const est = typeof p.eta_s === 'number' && p.tok_s > 0 ? p.tokens + p.eta_s * p.tok_s : p.total;
      frac = est > 0 ? p.tokens / est : frac;
    }
    if (ing.session !== st.current) parts.push('(into ' + ing.session + ')');
    setIngestStatus('sending', parts.join(' · '), frac);
  }

  async function attachFile(file) {
    if (!file || !st.current || st.ingest || !connected()) return;
    const session = st.current;
    const size = file.size;
    const chunk = chunkBytes();
    const ing = { id: st.nextId++, session, name: file.name || 'document', size, sent: 0,
      progress: null, cancelling: false, ended: false };
    st.ingest = ing;
    hideError();
    showIngest(ing);
    updateControls();
    try {
      for (let off = 0, first = true; first || off < size; off += chunk, first = false) {
        if (ing.cancelling || ing.ended) return;
        const bytes = new Uint8Array(await file.slice(off, Math.min(size, off + chunk)).arrayBuffer());
        const req = { op: 'append', session, data: toBase64(bytes), last: off + chunk >= size };
        if (first) {
          req.id = ing.id;
          req.name = ing.name.slice(0, 200);
          req.size = size;
        }
        // the next chunk goes after the answer to this one (the server's flow control)
        const r = await requestWithId(req);
        ing.sent = r.received;
        if (st.ingest === ing && !ing.progress) showIngest(ing);
      }
    } catch (e) {
      if (ing.ended) return;
      if (ing.cancelling && e.code === 'not_found') return; // cancelled: done follows
      showError(e.code, 'attaching ' + ing.name + ': ' + e.message);
      if (e.code === 'disconnected' || !ing.started) {
        finishIngest(ing, { reason: 'error' });
        return;
      }
      // a chunk was refused: stop there, keeping what went in
      ing.cancelling = true;
      await call({ op: 'cancel', session });
    }
  }

  /* request() with the caller's id (the first chunk's id names the document). */
  function requestWithId(obj) {
    if (obj.id === undefined) return request(obj);
    const ing = st.ingest;
    return new Promise((resolve, reject) => {
      if (!sendJson(obj)) {
        reject({ code: 'disconnected', message: 'not connected' });
        return;
      }
      st.pending.set(obj.id, {
        resolve: (m) => { if (ing) ing.started = true; resolve(m); },
        reject,
      });
    });
  }

  function onIngestEvent(ing, msg) {
    if (msg.event === 'progress') {
      ing.progress = msg;
      if (typeof msg.bytes === 'number') ing.sent = Math.max(ing.sent, msg.bytes);
      if (st.ingest === ing && !ing.cancelling) showIngest(ing);
      return;
    }
    finishIngest(ing, msg);
  }

  function finishIngest(ing, msg) {
    if (ing.ended) return;
    ing.ended = true;
    if (st.ingest === ing) st.ingest = null;
    const reason = msg.reason || 'error';
    const doc = msg.document;
    if (doc && ing.session === st.current && (doc.tokens > 0 || reason === 'complete')) {
      // the start of the text, as history shows it: fetched with the turn
      call({ op: 'history', session: ing.session, last: 1 }).then((h) => {
        const t = h && h.turns && h.turns[h.turns.length - 1];
        const m = addDocument(doc, t && t.document ? t.prompt : '', !!(t && t.document && t.document.clipped),
          reason === 'complete' ? '' : reason);
        if (st.gen && st.gen.session === ing.session) {
          if (st.gen.userEl) el['transcript'].append(st.gen.userEl);
          el['transcript'].append(st.gen.el);
        }
        scrollToEnd(true);
        return m;
      });
    }
    if (reason === 'complete') {
      setIngestStatus('done', ing.name + ': ' + fmtBytes(doc.bytes) + ', ' + fmtNum(doc.tokens) + ' tokens in '
        + fmtNum(msg.prefill_ms / 1000, 1) + ' s (' + fmtNum(msg.tok_s) + ' tok/s)', 1);
    } else if (reason === 'cancelled') {
      setIngestStatus('cancelled', ing.name + ': stopped; kept ' + (doc ? fmtNum(doc.tokens) + ' tokens ('
        + fmtBytes(doc.bytes) + ')' : 'what went in'));
    } else {
      setIngestStatus('failed', ing.name + ': ' + (reason === 'disconnected'
        ? 'connection lost (the server kept and saved what went in)' : 'failed'));
      if (msg.error) showError(msg.error.code, msg.error.message);
    }
    refreshList();
    if (ing.session === st.current) refreshStats();
    updateControls();
  }

  async function cancelIngest() {
    const ing = st.ingest;
    if (!ing || ing.cancelling) return;
    ing.cancelling = true;
    el['btn-ingest-cancel'].disabled = true;
    el['ingest-text'].textContent = ing.name + ': cancelling…';
    await call({ op: 'cancel', session: ing.session });
    el['btn-ingest-cancel'].disabled = false;
  }

  /* ---------- controls ---------- */

  function updateControls() {
    const on = connected();
    const open = on && !!st.current;
    el['btn-new'].disabled = !on;
    el['btn-refresh'].disabled = !on;
    el['btn-fork'].disabled = !open;
    el['btn-rename'].disabled = !open;
    el['btn-delete'].disabled = !open;
    el['btn-snapshots'].disabled = !open;
    el['message-input'].disabled = !open;
    const busy = !!st.ingest && st.ingest.session === st.current;
    el['btn-send'].disabled = !open || !!st.gen || busy;
    el['btn-attach'].disabled = !open || !!st.gen || !!st.ingest;
    el['btn-stop'].hidden = !st.gen;
    el['btn-stop'].disabled = !st.gen || !!st.gen.stopping;
  }

  function bind() {
    el['error-close'].addEventListener('click', hideError);
    el['btn-new'].addEventListener('click', newSession);
    el['btn-fork'].addEventListener('click', forkSession);
    el['btn-rename'].addEventListener('click', renameSession);
    el['btn-delete'].addEventListener('click', deleteSession);
    el['btn-refresh'].addEventListener('click', () => {
      refreshList();
      refreshStats();
    });
    el['btn-snapshots'].addEventListener('click', toggleSnapshots);
    el['btn-stop'].addEventListener('click', stopGen);
    el['btn-attach'].addEventListener('click', () => el['file-input'].click());
    el['file-input'].addEventListener('change', () => {
      const f = el['file-input'].files && el['file-input'].files[0];
      el['file-input'].value = ''; // the same file can be chosen again
      if (f) attachFile(f);
    });
    el['btn-ingest-cancel'].addEventListener('click', cancelIngest);
    // Narrow screens: the session list is a drawer; a click beside it or
    // Escape closes it.
    const drawer = (open) => {
      el['sidebar'].classList.toggle('open', open);
      el['btn-sidebar'].setAttribute('aria-expanded', String(open));
    };
    el['btn-sidebar'].addEventListener('click', () => drawer(!el['sidebar'].classList.contains('open')));
    document.querySelector('main').addEventListener('click', () => drawer(false));
    document.addEventListener('keydown', (e) => {
      if (e.key === 'Escape' && !el['dlg'].open) drawer(false);
    });

    el['composer'].addEventListener('submit', (e) => {
      e.preventDefault();
      sendMessage();
    });
    el['message-input'].addEventListener('keydown', (e) => {
      if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        sendMessage();
      }
    });

    el['auth-token'].value = store.get('kds.token') || '';
    el['auth-form'].addEventListener('submit', (e) => {
      e.preventDefault();
      store.set('kds.token', el['auth-token'].value.trim());
      hideError();
      st.backoff = BACKOFF_MIN_MS;
      connect();
    });

    // The dialog's OK checks the name before closing.
    el['dlg-form'].addEventListener('submit', (e) => {
      const n = el['dlg-name'].value.trim();
      if (!el['dlg-name-row'].hidden && n && !NAME_RE.test(n)) {
        e.preventDefault();
        el['dlg-text'].textContent = 'A name is 1-64 of A-Z a-z 0-9 . _ - and starts with a letter or digit.';
      }
    });
    el['dlg-cancel'].addEventListener('click', () => el['dlg'].close('cancel'));

    // Sampling settings are remembered per browser.
    for (const [id, key] of [['set-temperature', 'kds.temperature'], ['set-max-tokens', 'kds.max_tokens']]) {
      const v = store.get(key);
      if (v !== null) el[id].value = v;
      el[id].addEventListener('change', () => store.set(key, el[id].value));
    }
    el['raw-toggle'].checked = store.get('kds.raw') === '1';
    el['raw-toggle'].addEventListener('change', () => store.set('kds.raw', el['raw-toggle'].checked ? '1' : null));
  }

  bind();
  updateControls();
  connect();
})();
