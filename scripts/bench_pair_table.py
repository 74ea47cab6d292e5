#!/usr/bin/env python3
# bench_pair_table.py FILE - the table of a scripts/bench_pair.sh run: per round the
# best prefill and decode tokens/s of models A and B and the ratios B / A, then the
# medians (of the figures, and of the per-round ratios) and the ratios' range.
import re, sys, statistics as st
rows = {}; loads = []
cur = None
for line in open(sys.argv[1]):
    m = re.match(r'=== round (\d+) (?:model|bin) (\S+) load (\S+)', line)
    if m:
        cur = (int(m.group(1)), m.group(2)); loads.append(float(m.group(3))); continue
    m = re.match(r'(prefill|decode)\s+([\d.]+) tokens/s .*median ([\d.]+)', line)
    if m and cur:
        rows.setdefault(cur[0], {}).setdefault(cur[1], {})[m.group(1)] = (float(m.group(2)), float(m.group(3)))
names = []
for r in rows.values():
    for n in r:
        if n not in names: names.append(n)
a, b = names[0], names[1]
print(f"A = {a}\nB = {b}\nload average (1 min) at the runs' starts: {min(loads):.1f}-{max(loads):.1f}")
print("| round | A prefill | B prefill | ratio | A decode | B decode | ratio |")
print("|---|---|---|---|---|---|---|")
rp, rd = [], []
agg = {a: {'prefill': [], 'decode': []}, b: {'prefill': [], 'decode': []}}
for i in sorted(rows):
    r = rows[i]
    if a not in r or b not in r or 'decode' not in r[a] or 'decode' not in r[b]: continue
    p = r[b]['prefill'][0] / r[a]['prefill'][0]; d = r[b]['decode'][0] / r[a]['decode'][0]
    rp.append(p); rd.append(d)
    for n in (a, b):
        for k in ('prefill', 'decode'): agg[n][k].append(r[n][k][0])
    print(f"| {i} | {r[a]['prefill'][0]} | {r[b]['prefill'][0]} | {p:.2f} | {r[a]['decode'][0]} | {r[b]['decode'][0]} | {d:.2f} |")
print(f"| median | {st.median(agg[a]['prefill']):.4g} | {st.median(agg[b]['prefill']):.4g} | **{st.median(rp):.2f}** | {st.median(agg[a]['decode']):.4g} | {st.median(agg[b]['decode']):.4g} | **{st.median(rd):.2f}** |")
print(f"range of ratios: prefill {min(rp):.2f}-{max(rp):.2f}, decode {min(rd):.2f}-{max(rd):.2f}")
