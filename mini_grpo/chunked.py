"""Per-token log-probs (and entropy) from hidden states and the LM head, chunked over tokens.

Why: with a big vocabulary the one-shot log-prob pass materialises (tokens, V) fp32 logits,
e.g. 64 x 512 tokens x 151k (Qwen) = ~20 GB, plus as much again for log_softmax's output
that autograd keeps for backward. `token_logprobs` instead computes the logits of at most
`chunk_tokens` tokens at a time, keeps only a per-token logsumexp for backward, and recomputes
each chunk's logits there, so (chunk, V) is the largest vocab-sized tensor ever alive.
Gradients flow to the hidden states and to the weight (tied to an embedding or not: they
accumulate into it as usual). Small inputs take the plain one-shot path, identical to today's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LOGITS_BUDGET_BYTES = 256 * 2**20  # one chunk's fp32 logits stay under this by default
# SFT on a CPU: its passes take the LM head over every token of a micro-batch (1024 in the LM
# job), which in one shot keeps ~0.7 GB of (tokens, V) logits for backward. 32 MiB chunks held
# the LM job's SFT stage at 5.0 instead of 5.2-5.4 GB for 6% of its tokens/s; GRPO's passes
# keep the default, where the same chunks cost 12% of the policy pass (docs/results.md)
SFT_CPU_BUDGET_BYTES = 32 * 2**20


def _acc_dtype(dtype):
    # logits/softmax math in fp32 (fp64 stays fp64, so gradcheck can run in float64)
    return torch.promote_types(dtype, torch.float32)


class _ChunkedTokenLogprobs(torch.autograd.Function):

    @staticmethod
    def forward(ctx, h, w, t, temperature, chunk, want_ent):
        # h (N, C), w (V, C), t (N,); autocast casting was done by the caller, so the matmul
        # dtype is the inputs' dtype in forward and backward alike
        acc = _acc_dtype(h.dtype)
        N = h.size(0)
        lse = torch.empty(N, dtype=acc, device=h.device)  # (N,) all backward needs besides inputs
        logp = torch.empty_like(lse)
        ent = torch.empty_like(lse) if want_ent else None
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, N, chunk):
                e = min(s + chunk, N)
                logits = (h[s:e] @ w.T).to(acc).div_(temperature)  # (n, V)
                lse[s:e] = logits.logsumexp(-1)
                logp[s:e] = logits.gather(-1, t[s:e, None]).squeeze(-1) - lse[s:e]
                if want_ent:  # forward runs without autograd: entropy never joins the graph
                    p = (logits - lse[s:e, None]).exp_()  # (n, V)
                    ent[s:e] = lse[s:e] - (p * logits).sum(-1)
        ctx.save_for_backward(h, w, t, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        if want_ent:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g, _g_ent):
        h, w, t, lse = ctx.saved_tensors
        T, chunk, N = ctx.temperature, ctx.chunk, h.size(0)
        need_h, need_w = ctx.needs_input_grad[:2]
        gh = torch.empty_like(h) if need_h else None
        gw = torch.zeros(w.shape, dtype=_acc_dtype(w.dtype), device=w.device) if need_w else None
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, N, chunk):
                e = min(s + chunk, N)
                logits = (h[s:e] @ w.T).to(lse.dtype).div_(T)  # (n, V), recomputed
                gT = (g[s:e] / T)[:, None]  # (n, 1)
                # d logp / d logits = (onehot(target) - softmax) / T, built in place on the logits
                grad = (logits - lse[s:e, None]).exp_().mul_(-gT)  # (n, V)
                grad.scatter_add_(1, t[s:e, None], gT)
                grad = grad.to(h.dtype)  # matmuls in the forward's dtype, like F.linear's backward
                if need_h:
                    gh[s:e] = grad @ w  # (n, C)
                if need_w and gw.dtype == grad.dtype:  # (V, C), summed over chunks
                    gw.addmm_(grad.T, h[s:e])  # in place: no (V, C) temporary per chunk
                elif need_w:
                    gw += grad.T @ h[s:e]  # bf16/fp16 products summed in fp32
        return gh, None if gw is None else gw.to(w.dtype), None, None, None, None


def token_logprobs(hidden, weight, targets, temperature=1.0, chunk_tokens=None, entropy=False,
                   budget_bytes=None):
    """hidden (..., C) final normed hidden states (any float dtype, may be under autocast),
    weight (V, C) LM head, targets (...) long -> logp (...) fp32 =
    log_softmax(hidden @ weight.T / temperature)[target] (fp64 for fp64 inputs);
    with entropy=True returns (logp, ent), ent (...) the fp32 entropy of each token's
    distribution, detached. Every target must be a valid id (mask padding afterwards).

    chunk_tokens: most tokens whose logits exist at once; None = as many as keep a chunk's
    fp32 logits under `budget_bytes` (default LOGITS_BUDGET_BYTES). With no more tokens than
    that, the plain one-shot computation runs (fast path, identical to the unchunked one)."""
    V, C = weight.shape
    if chunk_tokens is None:
        chunk_tokens = max(1, ((budget_bytes or LOGITS_BUDGET_BYTES) // 4) // V)
    if targets.numel() <= chunk_tokens:
        logits = F.linear(hidden, weight)  # (..., V)
        logp_all = F.log_softmax(logits.to(_acc_dtype(logits.dtype)) / temperature, dim=-1)
        logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
        if not entropy:
            return logp
        with torch.no_grad():
            return logp, -(logp_all.exp() * logp_all).sum(-1)
    # a custom Function sees autocast but is not cast by it: cast as F.linear would
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        hidden, weight = (x if x.dtype == torch.float64 else x.to(dt) for x in (hidden, weight))
    logp, ent = _ChunkedTokenLogprobs.apply(hidden.reshape(-1, C), weight, targets.reshape(-1),
                                            temperature, chunk_tokens, entropy)
    logp = logp.view(targets.shape)
    return (logp, ent.view(targets.shape)) if entropy else logp
