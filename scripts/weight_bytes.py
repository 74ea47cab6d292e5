#!/usr/bin/env python3
# weight_bytes.py DIR - the weight bytes a decoded token reads, counted from a
# model directory's safetensors headers and config: every tensor but the
# embedding (one row) and the routed experts (top-k of E per layer).
import json, struct, sys, os, re, glob
d = sys.argv[1]
cfg = json.load(open(os.path.join(d, 'config.json')))
t = cfg.get('text_config', cfg)
E, k = t['num_experts'], t['num_experts_per_token']
sizes = {}
for f in glob.glob(os.path.join(d, '*.safetensors')):
    with open(f, 'rb') as fh:
        n = struct.unpack('<Q', fh.read(8))[0]
        h = json.loads(fh.read(n))
    for name, v in h.items():
        if name == '__metadata__': continue
        a, b = v['data_offsets']; sizes[name] = b - a
emb = sum(v for n, v in sizes.items() if 'embed_tokens' in n)
routed = sum(v for n, v in sizes.items() if re.search(r'\.experts\.\d+\.', n))
rest = sum(sizes.values()) - emb - routed
vocab = t['vocab_size']
per_tok_routed = routed * k / E
per_tok = rest + emb / vocab + per_tok_routed
print(f"{os.path.basename(d)}: file weights {sum(sizes.values())/1e9:.3f} GB; routed experts {routed/1e9:.3f} GB "
      f"(top-{k} of {E}: {per_tok_routed/1e6:.1f} MB/token); other {rest/1e6:.1f} MB (all read per token, embedding row aside); "
      f"per token {per_tok/1e6:.1f} MB, experts {100*per_tok_routed/per_tok:.1f}%")
