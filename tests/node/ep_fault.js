// ep_fault.js - for tests/test_ep.c (a rank lost mid-generation): on a
// `kdaserve serve` of several ranks, save one short turn of a session (it
// must survive), then start a long generation on it, print "generating"
// once its tokens flow, and print how it ended:
//   done REASON CODE MESSAGE | error CODE MESSAGE | closed CODE
//   node ep_fault.js ws://127.0.0.1:PORT/ SESSION
"use strict";
const { KdsClient } = require("./ws_client");

(async () => {
  const [url, session] = process.argv.slice(2);
  const c = await KdsClient.connect(url);
  await c.ok({ op: "create", session });
  const first = await c.generate({ session, text: "Once upon a time", max_tokens: 8, temperature: 0 });
  console.log(`first ${first.done ? first.done.reason + " snapshot " + first.done.snapshot : "error"}`);
  let said = false;
  const r = c.startGenerate({ session, text: " and then", max_tokens: 100000, temperature: 0 }, {
    timeoutMs: 120000,
    onEvent: (ev, st) => {
      if (!said && st.tokens.length >= 4) {
        said = true;
        console.log("generating");
      }
    },
  });
  try {
    await r.finished;
  } catch (e) {
    console.log(`closed ${c.closeInfo ? c.closeInfo.code : "?"} ${e.message.slice(0, 200)}`);
    process.exit(0);
  }
  if (r.done) {
    const e = r.done.error || {};
    console.log(`done ${r.done.reason} ${e.code || "-"} ${e.message || ""}`);
  } else if (r.error) {
    console.log(`error ${r.error.code} ${r.error.message}`);
  }
  await c.close();
  process.exit(0);
})().catch((e) => {
  console.log(`failed ${e.message}`);
  process.exit(1);
});
