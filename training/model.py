"""model.py - the Kimi-Linear forward pass (pure KDA + MoE) in plain PyTorch.

Written from ../shared/reference/kda-model-spec.md with the conventions of
../shared/golden/README.md; `check_golden.py` checks it against the golden
micro-kda checkpoint. Only what the default model uses is implemented: every
layer is KDA (no MLA), layer 0 (first_k_dense_replace) has a dense SwiGLU
MLP, the other layers a sigmoid-routed MoE with a shared expert.

Parameter names are the Hugging Face names (model.layers.{l}.self_attn...,
block_sparse_moe.experts.{e}.w1 ...), so `state_dict()` is the checkpoint.

  * RMSNorm: x * rsqrt(mean(x^2) + rms_norm_eps) * w, in float32.
  * KDA (spec 3): q/k/v projections, depthwise causal conv (weights [C,1,W],
    tap W-1 on the current token) + SiLU, L2 norm of q and k (eps 1e-6),
    scale K^-1/2, gate g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias),
    beta = sigmoid(b_proj x), the delta rule with per-key-dim decay (chunked
    WY form of spec 4.1, exact), sigmoid-gated RMSNorm per head (o_norm,
    eps rms_norm_eps), o_proj.
  * MoE (spec 6.1): scores s = sigmoid(W_r x) in float32; experts chosen by
    top-k of s + e_score_correction_bias; weights s_i / sum s_j over the
    chosen, times routed_scaling_factor; plus the shared expert. The bias
    gets no gradient: training moves it (auxiliary-loss-free balancing).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

L2_EPS = 1e-6


class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def l2norm(x):
    return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + L2_EPS)


def kda_recurrent(q, k, v, g, beta, S=None):
    """Reference delta rule, token by token (spec 3.5). q,k,g [B,H,T,K] (q
    already scaled), v [B,H,T,V], beta [B,H,T]. Returns o [B,H,T,V], S."""
    B, H, T, K = q.shape
    V = v.shape[-1]
    if S is None:
        S = q.new_zeros(B, H, K, V)
    out = []
    for t in range(T):
        S = S * g[:, :, t].exp().unsqueeze(-1)
        u = v[:, :, t] - torch.einsum("bhk,bhkv->bhv", k[:, :, t], S)
        S = S + beta[:, :, t, None, None] * k[:, :, t].unsqueeze(-1) * u.unsqueeze(-2)
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))
    return torch.stack(out, 2), S


def kda_chunked(q, k, v, g, beta, C=16, S=None):
    """The same recurrence in the chunked WY form (spec 4.1), differentiable.
    Every exponent is a difference Gamma_r - Gamma_j with j <= r (or relative
    to the chunk start/end), so nothing can overflow; the [C, C, K] decay
    factors are formed explicitly (exact per key dim)."""
    B, H, T, K = q.shape
    V = v.shape[-1]
    pad = (-T) % C
    if pad:  # zero k, v, beta and g: padded tokens change nothing
        q, k, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, g))
        v = F.pad(v, (0, 0, 0, pad))
        beta = F.pad(beta, (0, pad))
    N = (T + pad) // C
    q, k, g = (x.reshape(B, H, N, C, K) for x in (q, k, g))
    v = v.reshape(B, H, N, C, V)
    beta = beta.reshape(B, H, N, C)

    G = g.cumsum(-2)                                        # Gamma_r  [B,H,N,C,K]
    incl = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device))
    diff = G.unsqueeze(-2) - G.unsqueeze(-3)                # [.., r, j, K] = Gamma_r - Gamma_j
    E = diff.masked_fill(~incl[:, :, None], float("-inf")).exp()   # 0 above the diagonal
    Y = E * k.unsqueeze(-3)                                 # [.., r, j, K]: k_j decayed to r
    qk = torch.stack([q, k], -1)                            # [.., r, K, 2]
    A = (Y @ qk).unbind(-1)                                 # [.., r, j] each
    A_qk = A[0]                                             # j <= r (diagonal included)
    A_kk = torch.tril(A[1], -1) * beta.unsqueeze(-1)        # strictly lower, row r times beta_r
    I = torch.eye(C, dtype=q.dtype, device=q.device)
    eG = G.exp()
    rhs = torch.cat([beta.unsqueeze(-1) * k * eG, beta.unsqueeze(-1) * v], -1)
    WU = torch.linalg.solve_triangular(I + A_kk, rhs, upper=False, unitriangular=True)
    W, U = WU[..., :K], WU[..., K:]
    Qt = q * eG                                             # q~
    GC = G[..., -1:, :]                                     # Gamma_C  [.., 1, K]
    Kb = (k * (GC - G).exp()).transpose(-1, -2)             # k-bar^T  [.., K, C]
    decay = GC.transpose(-1, -2).exp()                      # [B,H,N,K,1]

    if S is None:
        S = q.new_zeros(B, H, K, V)
    outs = []
    for W_n, U_n, Q_n, A_n, K_n, d_n in zip(W.unbind(2), U.unbind(2), Qt.unbind(2),
                                            A_qk.unbind(2), Kb.unbind(2), decay.unbind(2)):
        nu = U_n - W_n @ S
        outs.append(Q_n @ S + A_n @ nu)
        S = d_n * S + K_n @ nu
    o = torch.stack(outs, 2).reshape(B, H, N * C, V)[:, :, :T]
    return o, S


class CausalConv(nn.Module):
    """Depthwise causal conv, weight [C, 1, W] (tap W-1 = current token), then SiLU."""

    def __init__(self, channels, width):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, width))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.width = width

    def forward(self, x):  # [B, T, C]
        y = F.conv1d(F.pad(x.transpose(1, 2), (self.width - 1, 0)), self.weight,
                     groups=x.shape[-1])
        return F.silu(y.transpose(1, 2))


class KDA(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        D = cfg["hidden_size"]
        la = cfg["linear_attn_config"]
        self.H, self.K = la["num_heads"], la["head_dim"]
        HK, W = self.H * self.K, la["short_conv_kernel_size"]
        self.q_proj = nn.Linear(D, HK, bias=False)
        self.k_proj = nn.Linear(D, HK, bias=False)
        self.v_proj = nn.Linear(D, HK, bias=False)
        self.q_conv1d = CausalConv(HK, W)
        self.k_conv1d = CausalConv(HK, W)
        self.v_conv1d = CausalConv(HK, W)
        self.f_a_proj = nn.Linear(D, self.K, bias=False)
        self.f_b_proj = nn.Linear(self.K, HK, bias=False)
        self.A_log = nn.Parameter(torch.empty(1, 1, self.H, 1))
        self.dt_bias = nn.Parameter(torch.empty(HK))
        self.b_proj = nn.Linear(D, self.H, bias=False)
        self.g_a_proj = nn.Linear(D, self.K, bias=False)
        self.g_b_proj = nn.Linear(self.K, HK, bias=False)
        self.o_norm = RMSNorm(self.K, cfg["rms_norm_eps"])
        self.o_proj = nn.Linear(HK, D, bias=False)
        # fla's initialisation: A in [1, 16], dt in [1e-3, 1e-1] (inverse softplus)
        with torch.no_grad():
            self.A_log.copy_(torch.empty(self.H).uniform_(1, 16).log().view(1, 1, self.H, 1))
            dt = torch.exp(torch.rand(HK) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        self.chunk = 8
        self.mode = "chunked"  # "chunked", "recurrent" (torch) or "ext" (kda_ext.c)

    def forward(self, x):
        B, T, _ = x.shape
        H, K = self.H, self.K
        q = l2norm(self.q_conv1d(self.q_proj(x)).view(B, T, H, K)) * K ** -0.5
        k = l2norm(self.k_conv1d(self.k_proj(x)).view(B, T, H, K))
        v = self.v_conv1d(self.v_proj(x)).view(B, T, H, K)
        f = self.f_b_proj(self.f_a_proj(x)).view(B, T, H, K)
        g = -self.A_log.view(H, 1).exp() * F.softplus(f + self.dt_bias.view(H, K))
        beta = torch.sigmoid(self.b_proj(x))                # [B, T, H]
        tr = lambda t: t.transpose(1, 2)
        if self.mode == "ext":
            from kda_ext import kda_ext
            o = kda_ext(tr(q), tr(k), tr(v), tr(g), tr(beta))
        elif self.mode == "recurrent":
            o, _ = kda_recurrent(tr(q), tr(k), tr(v), tr(g), tr(beta))
        else:
            o, _ = kda_chunked(tr(q), tr(k), tr(v), tr(g), tr(beta), C=self.chunk)
        o = tr(o)                                           # [B, T, H, V]
        z = self.g_b_proj(self.g_a_proj(x)).view(B, T, H, K)
        o = self.o_norm(o) * torch.sigmoid(z)
        return self.o_proj(o.reshape(B, T, H * K))


class MLP(nn.Module):
    def __init__(self, D, I):
        super().__init__()
        self.gate_proj = nn.Linear(D, I, bias=False)
        self.up_proj = nn.Linear(D, I, bias=False)
        self.down_proj = nn.Linear(I, D, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Expert(nn.Module):
    def __init__(self, D, I):
        super().__init__()
        self.w1 = nn.Linear(D, I, bias=False)  # gate
        self.w3 = nn.Linear(D, I, bias=False)  # up
        self.w2 = nn.Linear(I, D, bias=False)  # down

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Gate(nn.Module):
    def __init__(self, D, E):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(E, D))
        nn.init.normal_(self.weight, std=0.02)
        self.register_buffer("e_score_correction_bias", torch.zeros(E))


class MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        D, I = cfg["hidden_size"], cfg["moe_intermediate_size"]
        self.E, self.k = cfg["num_experts"], cfg["num_experts_per_token"]
        self.scale = cfg["routed_scaling_factor"]
        self.renorm = cfg.get("moe_renormalize", True)
        self.gate = Gate(D, self.E)
        self.experts = nn.ModuleList(Expert(D, I) for _ in range(self.E))
        self.shared_experts = MLP(D, I * cfg["num_shared_experts"])
        self.last_load = None  # tokens per expert in the last forward (training)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        s = torch.sigmoid(x.float() @ self.gate.weight.float().t())          # [N, E]
        sel = torch.topk(s.detach() + self.gate.e_score_correction_bias, self.k, -1).indices
        w = s.gather(-1, sel)
        if self.renorm:
            w = w / w.sum(-1, keepdim=True)
        w = w * self.scale
        out = self.shared_experts(x)
        for e in range(self.E):
            tok, slot = (sel == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            y = self.experts[e](x[tok]) * w[tok, slot].unsqueeze(-1).to(x.dtype)
            out = out.index_add(0, tok, y)
        if self.training:
            self.last_load = torch.bincount(sel.flatten(), minlength=self.E)
        return out.view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, l):
        super().__init__()
        eps = cfg["rms_norm_eps"]
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.self_attn = KDA(cfg)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)
        moe = (cfg.get("num_experts") and l >= cfg["first_k_dense_replace"]
               and l % cfg.get("moe_layer_freq", 1) == 0)
        if moe:
            self.block_sparse_moe = MoE(cfg)
        else:
            self.mlp = MLP(cfg["hidden_size"], cfg["intermediate_size"])

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        h = self.post_attention_layernorm(x)
        ffn = self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp
        return x + ffn(h)


class Inner(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(cfg, l) for l in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])


class KimiLinear(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        la = cfg["linear_attn_config"]
        assert not la.get("full_attn_layers"), "MLA layers are not implemented here"
        assert la.get("num_v_heads", la["num_heads"]) == la["num_heads"]
        assert "gate_lower_bound" not in la, "only the softplus gate is implemented"
        self.cfg = cfg
        self.model = Inner(cfg)
        self.tied = cfg.get("tie_word_embeddings", False)
        if not self.tied:
            self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        self.init_weights()

    def init_weights(self):
        std = self.cfg.get("initializer_range", 0.02)
        out_std = std / math.sqrt(2 * self.cfg["num_hidden_layers"])
        for name, p in self.named_parameters():
            if p.dim() == 2:
                last = name.endswith(("o_proj.weight", "down_proj.weight", "w2.weight"))
                nn.init.normal_(p, std=out_std if last else std)

    def set_kda_mode(self, mode="chunked", chunk=8):
        for layer in self.model.layers:
            layer.self_attn.mode = mode
            layer.self_attn.chunk = chunk

    def forward(self, ids):
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x)
        x = self.model.norm(x)
        w = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        return x @ w.t()

    def moe_layers(self):
        return [l.block_sparse_moe for l in self.model.layers if hasattr(l, "block_sparse_moe")]

    def hf_state_dict(self):
        """Tensors under their Hugging Face names (tied: no lm_head.weight)."""
        return {k: v for k, v in self.state_dict().items()}
