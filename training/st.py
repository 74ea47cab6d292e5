"""st.py - read and write safetensors files (stdlib + torch; no extra package).

Supports F32, BF16, F16, I32, I64 and U8. Tensors are written in the order given,
8-byte aligned header, no metadata beyond {"format": "pt"}.
"""
import json
import struct

import numpy as np
import torch

_DT = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
       "I32": torch.int32, "I64": torch.int64, "U8": torch.uint8}
_NAME = {v: k for k, v in _DT.items()}


def load(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        dt = _DT[info["dtype"]]
        raw = bytearray(data[a:b])
        if dt == torch.bfloat16:
            t = torch.frombuffer(raw, dtype=torch.int16).view(torch.bfloat16)
        else:
            t = torch.frombuffer(raw, dtype=dt)
        out[name] = t.reshape(info["shape"]).clone()
    return out


def save(path, tensors):
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        if t.dtype == torch.bfloat16:
            b = t.view(torch.int16).numpy().tobytes()
        else:
            b = t.numpy().tobytes()
        header[name] = {"dtype": _NAME[t.dtype], "shape": list(t.shape),
                        "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
