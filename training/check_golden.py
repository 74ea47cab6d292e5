"""check_golden.py - check model.py against the golden micro-kda checkpoint
(../shared/golden/model/micro-kda: independent fp32 PyTorch reference of the
same spec), through the chunked and the token-by-token KDA paths.

  /usr/bin/python3 training/check_golden.py [GOLDEN_MODEL_DIR]
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st  # noqa: E402
from model import KimiLinear  # noqa: E402

here = os.path.dirname(os.path.abspath(__file__))
d = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "../../shared/golden/model/micro-kda")
cfg = json.load(open(os.path.join(d, "config.json")))
m = KimiLinear(cfg).eval()
sd = st.load(os.path.join(d, "model.safetensors"))
missing, unexpected = m.load_state_dict(sd, strict=False)
missing = [k for k in missing if not (cfg.get("tie_word_embeddings") and k == "lm_head.weight")]
assert not missing and not unexpected, (missing, unexpected)
ex = st.load(os.path.join(d, "expected.safetensors"))
ids, want = ex["ids"].long(), ex["logits"]
worst = 0.0
with torch.no_grad():
    for mode, chunk in (("chunked", 16), ("chunked", 5), ("recurrent", 0), ("ext", 0)):
        m.set_kda_mode(mode, chunk=chunk or 8)
        got = m(ids[None])[0]
        rel = ((got - want).abs().max() / want.abs().max()).item()
        worst = max(worst, rel)
        print(f"{d}: {mode} (chunk {chunk}): max err {rel:.3g} of max |logit|")
sys.exit(0 if worst < 1e-5 else 1)
