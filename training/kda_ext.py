"""kda_ext.py - the KDA delta rule as a torch autograd Function backed by the
C loops of kda_ext.c (built on first use into $KDS_EXT_DIR, default
/tmp/kds_ext, with gcc -O3 -march=native -fopenmp; loaded with ctypes).

Same contract as model.kda_recurrent: q, k, g [B,H,T,K] (q already scaled),
v [B,H,T,V], beta [B,H,T], float32, zero initial state; returns o.
`check_ext()` compares forward and gradients with the pure-torch recurrence.
"""
import ctypes
import hashlib
import os
import subprocess

import torch

_here = os.path.dirname(os.path.abspath(__file__))
_lib = None
CK = 16  # tokens per checkpointed segment


def lib():
    global _lib
    if _lib is None:
        src = os.path.join(_here, "kda_ext.c")
        tag = hashlib.sha256(open(src, "rb").read()).hexdigest()[:12]
        d = os.environ.get("KDS_EXT_DIR", "/tmp/kds_ext")
        os.makedirs(d, exist_ok=True)
        so = os.path.join(d, f"kda_ext_{tag}.so")
        if not os.path.exists(so):
            tmp = f"{so}.{os.getpid()}"
            subprocess.run(["gcc", "-O3", "-march=native", "-ffp-contract=off", "-fopenmp",
                            "-shared", "-fPIC", "-o", tmp, src, "-lm"], check=True)
            os.replace(tmp, so)
        _lib = ctypes.CDLL(so)
        _lib.kda_set_threads(torch.get_num_threads())
    return _lib


def _p(t):
    return ctypes.c_void_p(t.data_ptr())


class KDAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta):
        q, k, v, g, beta = (x.detach().float().contiguous() for x in (q, k, v, g, beta))
        B, H, T, K = q.shape
        V = v.shape[-1]
        o = torch.empty(B, H, T, V)
        states = torch.empty(B * H, T // CK + 1, K, V)
        lib().kda_fwd(B * H, T, K, V, CK, _p(q), _p(k), _p(v), _p(g), _p(beta), _p(o),
                      _p(states))
        ctx.save_for_backward(q, k, v, g, beta, states)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, g, beta, states = ctx.saved_tensors
        do = do.float().contiguous()
        B, H, T, K = q.shape
        V = v.shape[-1]
        dq, dk, dg = (torch.empty_like(q) for _ in range(3))
        dv, dbeta = torch.empty_like(v), torch.empty_like(beta)
        work = torch.empty(B * H, CK + 1, K, V)
        lib().kda_bwd(B * H, T, K, V, CK, _p(q), _p(k), _p(v), _p(g), _p(beta), _p(states),
                      _p(do), _p(dq), _p(dk), _p(dv), _p(dg), _p(dbeta), _p(work))
        return dq, dk, dv, dg, dbeta


def kda_ext(q, k, v, g, beta):
    return KDAFunction.apply(q, k, v, g, beta)


def check_ext():
    from model import kda_recurrent, l2norm
    torch.manual_seed(0)
    B, H, T, K = 2, 3, 53, 16
    q = (l2norm(torch.randn(B, H, T, K)) * K ** -0.5).requires_grad_()
    k = l2norm(torch.randn(B, H, T, K)).requires_grad_()
    v = torch.randn(B, H, T, K).requires_grad_()
    g = (-torch.rand(B, H, T, K) * 2).requires_grad_()
    beta = torch.rand(B, H, T).requires_grad_()
    do = torch.randn(B, H, T, K)
    ins = (q, k, v, g, beta)
    o1, _ = kda_recurrent(*ins)
    g1 = torch.autograd.grad(o1, ins, do)
    o2 = kda_ext(*ins)
    g2 = torch.autograd.grad(o2, ins, do)
    errs = [(o1 - o2).abs().max().item()] + [(a - b).abs().max().item() for a, b in zip(g1, g2)]
    print("kda_ext vs torch recurrence: max abs err o, dq, dk, dv, dg, dbeta:",
          " ".join(f"{e:.2e}" for e in errs))
    assert max(errs) < 1e-4, errs


if __name__ == "__main__":
    check_ext()
