#!/usr/bin/env node
/*
 * web_page.test.js - the web chat page (web/www/) in a real browser: headless
 * Chromium driven by playwright-core, against a running `kdaserve serve`.
 *
 *   node tests/node/web_page.test.js URL [SCREENSHOT]
 *
 * URL is the server's page (http://127.0.0.1:PORT/); SCREENSHOT defaults to
 * build/artifacts/web-page.png. The browser is $KDS_CHROMIUM, else Debian's
 * /usr/bin/chromium (scripts/bootstrap.sh installs it).
 *
 * Every response is served to the page with a strict Content-Security-Policy
 * added (default-src 'self'), so an inline script or style, or anything
 * fetched from elsewhere, shows up as a console error and fails the run.
 *
 * Prints one line per check ("ok N - what" / "not ok N - what: why") and
 * exits 0 only when every check passed. The page's hooks (ids and
 * data-testid) are listed at the top of web/www/app.js.
 */
'use strict';

const fs = require('fs');
const path = require('path');

const CSP = "default-src 'self'; connect-src 'self' ws: wss:; img-src 'self' data:; "
  + "base-uri 'none'; form-action 'none'; frame-ancestors 'none'";
const STEP_MS = 30000; // how long one step may wait for the page
const TOTAL_MS = 240000; // the whole run

let playwright;
try {
  playwright = require('playwright-core');
} catch (e) {
  console.error('web_page.test.js: playwright-core is not installed: run ./scripts/bootstrap.sh '
    + '(it runs npm ci in tests/node)');
  process.exit(2);
}

function findChromium() {
  const cands = [process.env.KDS_CHROMIUM, '/usr/bin/chromium', '/usr/bin/chromium-browser',
    '/usr/lib/chromium/chromium'].filter(Boolean);
  for (const c of cands) {
    try {
      fs.accessSync(c, fs.constants.X_OK);
      return c;
    } catch (_) { /* next */ }
  }
  return null;
}

const url = process.argv[2];
const shot = process.argv[3] || path.join('build', 'artifacts', 'web-page.png');
if (!url || !/^https?:\/\//.test(url)) {
  console.error('usage: node tests/node/web_page.test.js http://HOST:PORT/ [SCREENSHOT.png]');
  process.exit(2);
}
const chromiumPath = findChromium();
if (!chromiumPath) {
  console.error('web_page.test.js: no Chromium found (set KDS_CHROMIUM, or run ./scripts/bootstrap.sh '
    + 'which installs Debian\'s chromium)');
  process.exit(2);
}

/* ---------- checks ---------- */

let n = 0;
let failed = 0;
function ok(what, detail) {
  n++;
  console.log('ok ' + n + ' - ' + what + (detail ? ' (' + detail + ')' : ''));
}
function notOk(what, why) {
  n++;
  failed++;
  console.log('not ok ' + n + ' - ' + what + ': ' + String(why).split('\n')[0]);
}
/* Run one check; a thrown error fails it. Returns true when it passed. */
async function check(what, fn) {
  try {
    const detail = await fn();
    ok(what, detail);
    return true;
  } catch (e) {
    notOk(what, e && e.message ? e.message : e);
    return false;
  }
}
function expect(cond, why) {
  if (!cond) throw new Error(why);
}

const tid = (id) => '[data-testid="' + id + '"]';

/* ---------- the run ---------- */

async function main() {
  const browser = await playwright.chromium.launch({
    executablePath: chromiumPath,
    headless: true,
    // --no-sandbox: root in a container has no user namespaces for the
    // sandbox. LocalNetworkAccessChecks: a response fulfilled by page.route
    // (how the CSP is added) has no address, so Chromium counts the page as
    // public and would block its WebSocket to 127.0.0.1.
    args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage',
      '--disable-features=LocalNetworkAccessChecks'],
  });
  const problems = []; // script errors, CSP violations, failed loads
  try {
    const context = await browser.newContext({ viewport: { width: 1280, height: 800 } });
    context.setDefaultTimeout(STEP_MS);
    const page = await context.newPage();
    page.on('pageerror', (e) => problems.push('page error: ' + e.message));
    page.on('console', (m) => {
      if (m.type() === 'error') problems.push('console error: ' + m.text());
    });
    page.on('requestfailed', (r) => problems.push('request failed: ' + r.url() + ' ' + (r.failure() || {}).errorText));
    // Serve everything with the strict CSP added (the server may send its own too).
    await page.route('**/*', async (route) => {
      let resp;
      try {
        resp = await route.fetch();
      } catch (e) {
        problems.push('GET ' + route.request().url() + ' failed: ' + String(e.message).split('\n')[0]);
        await route.abort().catch(() => {});
        return;
      }
      const headers = Object.assign({}, resp.headers(), { 'content-security-policy': CSP });
      await route.fulfill({ response: resp, headers }).catch(() => {});
    });

    const name = 'web-' + process.pid + '-' + Date.now().toString(36);
    const alive = { page: true };

    const loaded = await check('page loads (index.html)', async () => {
      const resp = await page.goto(url, { waitUntil: 'load' });
      expect(resp && resp.ok(), 'GET ' + url + ' answered ' + (resp ? resp.status() : 'nothing'));
      return 'HTTP ' + resp.status();
    });
    if (!loaded) alive.page = false;

    // Without its stylesheet the page still works (the rest goes on), but
    // it is not the page we ship.
    alive.page && await check('style.css and app.js are applied', async () => {
      const css = await page.evaluate(() => getComputedStyle(document.querySelector('.layout')).display);
      expect(css === 'grid', 'style.css not applied (.layout display is ' + css + ')');
      const state = await page.getAttribute(tid('conn-state'), 'data-state');
      expect(state && state !== 'idle', 'app.js did not run (conn-state is ' + state + ')');
    });

    const conn = alive.page && await check('connects over WebSocket (conn-state = connected)', async () => {
      await page.waitForSelector(tid('conn-state') + '[data-state="connected"]');
      return (await page.textContent(tid('model-name'))).trim();
    });

    const created = conn && await check('creates a session with New', async () => {
      await page.click(tid('btn-new'));
      await page.fill(tid('dialog-name'), name);
      await page.click(tid('dialog-ok'));
      await page.waitForSelector(tid('session-item') + '[data-session="' + name + '"][aria-selected="true"]');
      await page.waitForFunction((nm) => document.querySelector('#chat-title').textContent === nm, name);
      await page.waitForFunction(() => /\d/.test(document.querySelector('#stats-state-bytes').textContent));
      return name + ', state ' + (await page.textContent(tid('stats-state-bytes')));
    });

    /* Watch the newest reply: every DOM change records its text length, so
     * "the reply grew over several observations" is what the page showed. */
    async function watchNextReply() {
      await page.evaluate(() => {
        const w = { lengths: [], obs: null };
        window.__kdsWatch = w;
        const t = document.querySelector('#transcript');
        w.obs = new MutationObserver(() => {
          const all = t.querySelectorAll('[data-testid="msg-assistant"]');
          const m = all[all.length - 1];
          if (!m || m.dataset.streaming !== 'true') return;
          const len = m.querySelector('.msg-body').textContent.length;
          if (w.lengths[w.lengths.length - 1] !== len) w.lengths.push(len);
        });
        w.obs.observe(t, { childList: true, subtree: true, characterData: true, attributes: true });
      });
    }
    async function lastReply() {
      return page.evaluate(() => {
        const all = document.querySelectorAll('[data-testid="msg-assistant"]');
        const m = all[all.length - 1];
        const w = window.__kdsWatch;
        if (w && w.obs) w.obs.disconnect();
        return m ? {
          text: m.querySelector('.msg-body').textContent,
          streaming: m.dataset.streaming,
          reason: m.dataset.reason || '',
          tokenEvents: +(m.dataset.tokenEvents || 0),
          lengths: w ? w.lengths : [],
        } : null;
      });
    }
    async function send(text, maxTokens) {
      await page.fill(tid('set-max-tokens'), String(maxTokens));
      await page.fill(tid('message-input'), text);
      await page.press(tid('message-input'), 'Enter');
    }
    const waitDone = () => page.waitForSelector(tid('gen-status') + '[data-state="done"]');

    const streamed = created && await check('streams a reply token by token', async () => {
      // A tiny model may end its text at once; a few tries make "it stopped
      // after one piece" (the model's choice) distinct from "no streaming".
      // The server joins the text of tokens made while a token event still
      // waits to be written (the writer is behind): a short reply on a
      // loaded machine (the sanitizer build, 2 busy cores) came as a single
      // event three times running, so each try asks for up to 240 tokens
      // (about a second there), long enough for the writer to go between.
      let r;
      await page.click(tid('settings') + ' summary'); // open the settings panel, left open
      for (let attempt = 1; attempt <= 3; attempt++) {
        await watchNextReply();
        await send('It is a truth universally acknowledged', 240);
        await page.waitForSelector(tid('gen-status') + ':is([data-state="generating"],[data-state="done"],[data-state="failed"])');
        await waitDone();
        r = await lastReply();
        if (r.tokenEvents >= 2) break;
      }
      expect(r, 'no reply element');
      expect(r.streaming === 'false', 'reply still marked streaming after done');
      expect(r.reason === 'length' || r.reason === 'stop', 'done reason ' + r.reason);
      expect(r.text.length > 0, 'empty reply');
      // Pieces arrived one by one, and the page showed the reply growing:
      // part of it was on screen while it streamed (the page draws at most
      // every 40 ms, so a short fast reply may be seen only once before done).
      expect(r.tokenEvents >= 2, 'only ' + r.tokenEvents + ' token event(s) arrived');
      const grew = r.lengths.filter((x) => x > 0);
      expect(grew.every((x, i) => i === 0 || x > grew[i - 1]), 'shown reply shrank: ' + JSON.stringify(r.lengths));
      expect(grew.length >= 1 && grew[0] < r.text.length,
        'no part of the reply was shown before it ended: lengths ' + JSON.stringify(r.lengths)
        + ', final ' + r.text.length);
      return r.tokenEvents + ' token events, shown lengths ' + grew.slice(0, 4).join('→')
        + (grew.length > 4 ? '→…→' + grew[grew.length - 1] : '') + ', reason ' + r.reason;
    });

    created && await check('shows session stats after generating', async () => {
      /* the stats the page asks for when the reply ends: a decode rate
       * (before any decode the page shows '–', not '0.0 tok/s') and the
       * session's tokens, from the same answer. Under the sanitizers the
       * reply can end before that answer is back, so wait for it. */
      await page.waitForFunction(() => /tok\/s/.test(document.querySelector('#stats-decode').textContent)
        && /[1-9]/.test(document.querySelector('#stats-tokens').textContent), null, { timeout: 15000 })
        .catch(() => {});
      const tokens = (await page.textContent(tid('stats-tokens'))).trim();
      expect(/[1-9]/.test(tokens), 'stats-tokens is ' + tokens);
      return 'tokens ' + tokens + ', decode ' + (await page.textContent(tid('stats-decode'))).trim()
        + ', prefill ' + (await page.textContent(tid('stats-prefill'))).trim();
    });

    /* The default model ends a sampled reply within a few dozen tokens (it
     * learnt fortune cookies), so the long generation is greedy, from a
     * fresh session whose opening text (the plain-mode "system") leads it
     * into a long run: deterministic for a given model. A few openings in
     * turn, in case a retrained model ends one of them by itself. */
    const STOP_CASES = [
      ['CHAPTER 1. Loomings.', 'Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse'],
      ['PRIDE AND PREJUDICE', 'Chapter 1. It is a truth universally acknowledged, that a single man in possession of a good fortune'],
      ['CHAPTER I.', 'The whale'],
    ];
    created && await check('Stop ends a long generation (cancelled)', async () => {
      let r;
      let k = 0;
      for (const [opening, prompt] of STOP_CASES) {
        const stopName = name + '-stop' + k++;
        await page.click(tid('btn-new'));
        await page.fill(tid('dialog-name'), stopName);
        await page.fill(tid('dialog-system'), opening);
        await page.click(tid('dialog-ok'));
        await page.waitForSelector(tid('session-item') + '[data-session="' + stopName + '"][aria-selected="true"]');
        await page.fill(tid('set-temperature'), '0');
        await watchNextReply();
        await send(prompt, 100000); // the server runs with --max-tokens 100000
        await page.waitForFunction(() => {
          const all = document.querySelectorAll('[data-testid="msg-assistant"]');
          const m = all[all.length - 1];
          return m && (+(m.dataset.tokenEvents || 0) >= 2 || m.dataset.streaming === 'false');
        });
        const stopBtn = page.locator(tid('btn-stop'));
        const t0 = Date.now();
        if (await stopBtn.isVisible()) await stopBtn.click().catch(() => {});
        const t1 = Date.now();
        await waitDone();
        r = await lastReply();
        r.timing = 'click took ' + (t1 - t0) + ' ms, done ' + (Date.now() - t1) + ' ms later';
        if (r.reason !== 'stop') break; // "stop": the model ended before the click; try again
      }
      await page.fill(tid('set-temperature'), '0.8');
      expect(r.reason === 'cancelled', 'done reason is ' + r.reason + ', not cancelled');
      expect(await page.locator(tid('btn-stop')).isHidden(), 'Stop button still shown');
      const len = r.text.length;
      await page.waitForTimeout(500);
      const after = await lastReply();
      expect(after.text.length === len, 'reply kept growing after done (' + len + ' → ' + after.text.length + ')');
      expect(await page.isEnabled(tid('btn-send')), 'Send not enabled again');
      return 'stopped after ' + r.tokenEvents + ' token events, ' + len + ' chars; ' + r.timing;
    });

    /* Attach file: a text of several hundred KB (characters of 2-4 bytes, so
     * the 256 KiB chunks cut some) goes in through append with progress and
     * an ETA, never touching the composer; the history shows it collapsed
     * (name, size, tokens), not as an empty "you" bubble; a second attach is
     * cancelled and keeps what went in. */
    function docText(bytes) {
      const words = ['the', 'whale', 'ship', 'Élan', 'naïve', '日本語', '😀', 'Zürich', 'sea'];
      let s = '', x = 7, line = 0;
      while (Buffer.byteLength(s) < bytes) {
        for (let k = 0; k < 12; k++) {
          x = (x * 1103515245 + 12345) & 0x7fffffff;
          s += words[x % words.length] + ' ';
        }
        s += '-'.repeat(2000 + (line++ % 5) * 400) + '\n';
      }
      return s;
    }
    const docName = name + '-doc';
    created && await check('Attach file: progress with an ETA, collapsed document in the history, composer kept', async () => {
      await page.click(tid('btn-new'));
      await page.fill(tid('dialog-name'), docName);
      await page.click(tid('dialog-ok'));
      await page.waitForSelector(tid('session-item') + '[data-session="' + docName + '"][aria-selected="true"]');
      const draft = 'a draft that must survive the attach';
      await page.fill(tid('message-input'), draft);
      const buf = Buffer.from(docText(Number(process.env.KDS_PAGE_DOC_BYTES || 700000)), 'utf8');
      await page.setInputFiles(tid('file-input'), { name: 'notes.txt', mimeType: 'text/plain', buffer: buf });
      await page.waitForFunction(() => {
        const s = document.querySelector('#ingest-status');
        return s.dataset.state === 'sending' && /ETA \d+:\d\d/.test(s.textContent)
          && document.querySelector('#ingest-progress').value > 0;
      }, null, { timeout: 60000 });
      const shown = (await page.textContent(tid('ingest-text'))).trim();
      expect(await page.isDisabled(tid('btn-send')), 'Send enabled while the document goes in');
      await page.waitForSelector(tid('ingest-status') + '[data-state="done"]', { timeout: 120000 });
      await page.waitForSelector(tid('msg-document'));
      const d = await page.evaluate(() => {
        const m = document.querySelector('[data-testid="msg-document"]');
        return { name: m.dataset.name, bytes: +m.dataset.bytes, tokens: +m.dataset.tokens, open: m.open,
          summary: m.querySelector('summary').textContent };
      });
      expect(d.name === 'notes.txt' && d.bytes === buf.length && d.tokens > 0, 'document item ' + JSON.stringify(d));
      expect(!d.open, 'the document is shown expanded');
      expect(/notes\.txt/.test(d.summary) && /KiB|MiB/.test(d.summary) && /tokens/.test(d.summary),
        'summary: ' + d.summary);
      expect(await page.inputValue(tid('message-input')) === draft, 'the composer lost its text');
      // reopened from the server's history: the same collapsed item, no empty "you" bubble
      await page.click(tid('session-item') + '[data-session="' + name + '"]');
      await page.waitForSelector(tid('msg-assistant'));
      await page.click(tid('session-item') + '[data-session="' + docName + '"]');
      await page.waitForSelector(tid('msg-document'));
      const again = await page.evaluate(() => ({
        docs: [...document.querySelectorAll('[data-testid="msg-document"]')].map((m) => [m.dataset.name, +m.dataset.bytes, m.open]),
        emptyUser: [...document.querySelectorAll('[data-testid="msg-user"]')].filter((m) => !m.querySelector('.msg-body').textContent.trim()).length,
        users: document.querySelectorAll('[data-testid="msg-user"]').length,
      }));
      expect(again.docs.length === 1 && again.docs[0][0] === 'notes.txt' && again.docs[0][1] === buf.length && !again.docs[0][2],
        'history after reopening: ' + JSON.stringify(again));
      expect(again.users === 0, again.users + ' "you" bubble(s) for a document');
      expect(await page.inputValue(tid('message-input')) === draft, 'the composer lost its text on reopening');
      return shown + '; ' + d.summary.trim();
    });

    created && await check('Attach file: Cancel stops it and keeps what went in', async () => {
      const buf = Buffer.from(docText(Number(process.env.KDS_PAGE_DOC_BYTES || 700000)), 'utf8');
      await page.setInputFiles(tid('file-input'), { name: 'again.txt', mimeType: 'text/plain', buffer: buf });
      await page.waitForFunction(() => {
        const s = document.querySelector('#ingest-status');
        return s.dataset.state === 'sending' && /tokens/.test(s.textContent);
      }, null, { timeout: 60000 });
      await page.click(tid('btn-ingest-cancel'));
      await page.waitForSelector(tid('ingest-status') + '[data-state="cancelled"]', { timeout: 60000 });
      await page.waitForSelector(tid('msg-document') + '[data-name="again.txt"]');
      const d = await page.evaluate(() => {
        const m = document.querySelector('[data-testid="msg-document"][data-name="again.txt"]');
        return { bytes: +m.dataset.bytes, tokens: +m.dataset.tokens, reason: m.dataset.reason || '' };
      });
      expect(d.reason === 'cancelled' && d.bytes < buf.length, 'cancelled item ' + JSON.stringify(d));
      expect(await page.isEnabled(tid('btn-send')), 'Send not enabled again');
      return 'kept ' + d.tokens + ' tokens, ' + d.bytes + ' of ' + buf.length + ' bytes';
    });

    created && await check('an error shows its code in the banner (create an existing name)', async () => {
      await page.click(tid('btn-new'));
      await page.fill(tid('dialog-name'), name);
      await page.click(tid('dialog-ok'));
      await page.waitForSelector(tid('error-banner'), { state: 'visible' });
      const code = (await page.textContent(tid('error-code'))).trim();
      expect(code === 'exists', 'error code shown is "' + code + '"');
      await page.click(tid('error-close'));
      await page.waitForSelector(tid('error-banner'), { state: 'hidden' });
      return code;
    });

    const forkName = name + '-f';
    created && await check('Fork makes a new session with the same history', async () => {
      await page.click(tid('session-item') + '[data-session="' + name + '"]');
      await page.waitForSelector(tid('session-item') + '[data-session="' + name + '"][aria-selected="true"]');
      await page.waitForSelector(tid('msg-assistant'));
      const turns = await page.locator(tid('msg-assistant')).count();
      await page.click(tid('btn-fork'));
      await page.fill(tid('dialog-name'), forkName);
      await page.click(tid('dialog-ok'));
      await page.waitForSelector(tid('session-item') + '[data-session="' + forkName + '"][aria-selected="true"]');
      await page.waitForFunction((k) => document.querySelectorAll('[data-testid="msg-assistant"]').length === k, turns);
      return turns + ' replies copied';
    });

    const restName = name + '-r';
    created && await check('Snapshots lists snapshots and Restore makes a session', async () => {
      // the first session has written snapshots (a fresh fork has none of its own)
      await page.click(tid('session-item') + '[data-session="' + name + '"]');
      await page.waitForSelector(tid('session-item') + '[data-session="' + name + '"][aria-selected="true"]');
      await page.waitForSelector(tid('msg-assistant'));
      await page.click(tid('btn-snapshots'));
      await page.waitForSelector(tid('snapshot-item'));
      const count = await page.locator(tid('snapshot-item')).count();
      await page.locator(tid('snapshot-restore')).last().click(); // the oldest snapshot
      await page.fill(tid('dialog-name'), restName);
      await page.click(tid('dialog-ok'));
      await page.waitForSelector(tid('session-item') + '[data-session="' + restName + '"][aria-selected="true"]');
      await page.waitForSelector(tid('session-item') + '[data-session="' + forkName + '"]');
      return count + ' snapshots listed';
    });

    created && await check('Rename and Delete change the session list', async () => {
      const renamed = name + '-x';
      await page.click(tid('btn-rename'));
      await page.fill(tid('dialog-name'), renamed);
      await page.click(tid('dialog-ok'));
      await page.waitForSelector(tid('session-item') + '[data-session="' + renamed + '"]');
      await page.waitForSelector(tid('session-item') + '[data-session="' + restName + '"]', { state: 'detached' });
      await page.click(tid('btn-delete'));
      await page.click(tid('dialog-ok'));
      await page.waitForSelector(tid('session-item') + '[data-session="' + renamed + '"]', { state: 'detached' });
      expect(await page.isDisabled(tid('btn-send')), 'Send enabled with no session open');
      return restName + ' → ' + renamed + ', deleted';
    });

    alive.page && await check('screenshot saved to ' + shot, async () => {
      if (created) {
        await page.click(tid('session-item') + '[data-session="' + name + '"]');
        await page.waitForSelector(tid('msg-assistant'));
        await page.waitForFunction(() => /\d/.test(document.querySelector('#stats-tokens').textContent));
      }
      fs.mkdirSync(path.dirname(path.resolve(shot)), { recursive: true });
      await page.screenshot({ path: shot });
      const size = fs.statSync(shot).size;
      expect(size > 0, 'empty file');
      return size + ' bytes';
    });

    await check('no script errors, CSP violations or failed loads', async () => {
      expect(problems.length === 0, problems.length + ': ' + problems.slice(0, 3).join(' | '));
    });
  } finally {
    await browser.close();
  }
}

const timer = setTimeout(() => {
  notOk('the whole run', 'took longer than ' + TOTAL_MS / 1000 + ' s');
  process.exit(1);
}, TOTAL_MS);

main().then(() => {
  clearTimeout(timer);
  console.log(failed ? failed + ' of ' + n + ' checks failed' : 'all ' + n + ' checks passed');
  process.exit(failed ? 1 : 0);
}, (e) => {
  clearTimeout(timer);
  notOk('browser run', e && e.stack ? e.stack : e);
  process.exit(1);
});
