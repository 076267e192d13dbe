"""Per-token log-probs (and entropy) from hidden states and the LM head, chunked over tokens.

Why: with a big vocabulary the one-shot log-prob pass materialises (tokens, V) fp32 logits,
e.g. 64 x 512 tokens x 151k (Qwen) = ~20 GB, plus as much again for log_softmax's output
that autograd keeps for backward. `token_logprobs` instead computes the logits of at most
`chunk_tokens` tokens at a time, keeps only a per-token logsumexp for backward, and recomputes
each chunk's logits there, so (chunk, V) is the largest vocab-sized tensor ever alive.
Gradients flow to the hidden states and to the weight (tied to an embedding or not: they
accumulate into it as usual). Inputs that fit one chunk keep their softmax for backward (made
in place of the log-softmax) instead of computing the logits again.
"""

from __future__ import annotations

import torch

LOGITS_BUDGET_BYTES = 256 * 2**20  # one chunk's fp32 logits stay under this by default
# SFT on a CPU: its passes take the LM head over every target token of a micro-batch (up to
# 1024 in RFT's SFT), which in one shot keeps ~0.7 GB of (tokens, V) logits for backward. 32 MiB
# chunks held the LM job's SFT stage at 5.0 instead of 5.2-5.4 GB for 6% of its tokens/s (then
# over every token); GRPO's passes keep the default, where the same chunks cost 12% of the
# policy pass (docs/results.md)
SFT_CPU_BUDGET_BYTES = 32 * 2**20
ENTROPY_ROWS = 64  # entropy's (rows, V) temporary, beside a chunk's logits


def _acc_dtype(dtype):
    # logits/softmax math in fp32 (fp64 stays fp64, so gradcheck can run in float64)
    return torch.promote_types(dtype, torch.float32)


class _ChunkedTokenLogprobs(torch.autograd.Function):

    @staticmethod
    def forward(ctx, h, w, t, temperature, chunk, want_ent, mm_dtype):
        # h (N, C), w (V, C), t (N,); the caller cast h as autocast would; w is cast here to
        # mm_dtype (None: its own), so backward hands its gradient back in w's own dtype with
        # no (V, C) cast in between: the matmuls run in mm_dtype, forward and backward alike
        ctx.w_dtype = w.dtype
        if mm_dtype is not None and w.dtype != mm_dtype:
            w = w.to(mm_dtype)
        acc = _acc_dtype(h.dtype)
        N = h.size(0)
        lse = torch.empty(N, dtype=acc, device=h.device)  # (N,) logsumexp, for recomputing
        logp = torch.empty_like(lse)
        ent = torch.empty_like(lse) if want_ent else None
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, N, chunk):
                e = min(s + chunk, N)
                logits = (h[s:e] @ w.T).to(acc)  # (n, V)
                if temperature != 1.0:
                    logits.div_(temperature)
                lsm = torch.log_softmax(logits, -1)  # one fused kernel (logsumexp keeps 2 temps)
                if N > chunk:  # recomputing backward's softmax needs it; at the max, exactly
                    top, at = logits.max(-1, keepdim=True)
                    lse[s:e] = (top - lsm.gather(-1, at)).squeeze(-1)
                del logits
                logp[s:e] = lsm.gather(-1, t[s:e, None]).squeeze(-1)
                for a in range(s, e, ENTROPY_ROWS) if want_ent else ():  # no autograd here:
                    z = lsm[a - s:min(a + ENTROPY_ROWS, e) - s]  # entropy never joins the graph
                    ent[a:a + z.size(0)] = -z.exp().mul_(z).sum(-1)
        # one chunk: its softmax is kept for backward (made from the log-softmax in place)
        # instead of the logits computed again there
        ctx.save_for_backward(h, w, t, lse, lsm.exp_() if N <= chunk else None)
        ctx.temperature, ctx.chunk = temperature, chunk
        if want_ent:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g, _g_ent):
        h, w, t, lse, kept = ctx.saved_tensors
        T, chunk, N = ctx.temperature, ctx.chunk, h.size(0)
        need_h, need_w = ctx.needs_input_grad[:2]
        gh = torch.empty_like(h) if need_h else None
        gw = None  # (V, C) in fp32 (or fp64), made by the first chunk's product: no zero-fill
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, N, chunk):
                e = min(s + chunk, N)
                gT = (g[s:e] / T)[:, None]  # (n, 1)
                # d logp / d logits = (onehot(target) - softmax) / T, built in place on the
                # softmax: the forward's (one chunk; a second backward of this graph fails
                # autograd's check that saved tensors were not modified) or recomputed
                p = kept if kept is not None else \
                    (h[s:e] @ w.T).to(lse.dtype).div_(T).sub_(lse[s:e, None]).exp_()
                grad = p.mul_(-gT)  # (n, V)
                grad.scatter_add_(1, t[s:e, None], gT)
                grad = grad.to(h.dtype)  # matmuls in the forward's dtype, like F.linear's backward
                if need_h:
                    gh[s:e] = grad @ w  # (n, C)
                if not need_w:
                    continue
                if gw is None:  # (V, C), summed over chunks in fp32
                    gw = (grad.T @ h[s:e]).to(_acc_dtype(grad.dtype))
                elif gw.dtype == grad.dtype:
                    gw.addmm_(grad.T, h[s:e])  # in place: no (V, C) temporary per chunk
                else:
                    gw += grad.T @ h[s:e]  # bf16/fp16 products summed in fp32
        # one cast to the weight's own dtype (none for an fp32 master weight under autocast)
        return gh, None if gw is None else gw.to(ctx.w_dtype), None, None, None, None, None


def token_logprobs(hidden, weight, targets, temperature=1.0, chunk_tokens=None, entropy=False,
                   budget_bytes=None):
    """hidden (..., C) final normed hidden states (any float dtype, may be under autocast),
    weight (V, C) LM head, targets (...) long -> logp (...) fp32 =
    log_softmax(hidden @ weight.T / temperature)[target] (fp64 for fp64 inputs);
    with entropy=True returns (logp, ent), ent (...) the fp32 entropy of each token's
    distribution, detached. Every target must be a valid id (mask padding afterwards).

    chunk_tokens: most tokens whose logits exist at once; None = as many as keep a chunk's
    fp32 logits under `budget_bytes` (default LOGITS_BUDGET_BYTES). With no more tokens than
    that, one chunk: its softmax is kept for backward, which makes the gradient in its place,
    so the pass computes the logits once and holds 8 bytes a logit at most, with entropy (the
    log_softmax autograd path before held 14 under bf16 autocast, 16 in fp32)."""
    V, C = weight.shape
    if chunk_tokens is None:
        chunk_tokens = max(1, ((budget_bytes or LOGITS_BUDGET_BYTES) // 4) // V)
    # a custom Function sees autocast but is not cast by it: cast as F.linear would (the
    # weight inside it, so its gradient comes back in the master dtype without a round trip)
    dev, mm_dtype = hidden.device.type, None
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        hidden = hidden if hidden.dtype == torch.float64 else hidden.to(dt)
        mm_dtype = None if weight.dtype == torch.float64 else dt
    logp, ent = _ChunkedTokenLogprobs.apply(hidden.reshape(-1, C), weight, targets.reshape(-1),
                                            temperature, chunk_tokens, entropy, mm_dtype)
    logp = logp.view(targets.shape)
    return (logp, ent.view(targets.shape)) if entropy else logp
