"""token_logprobs (chunked over tokens) against the plain one-shot log_softmax computation."""

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mini_grpo import chunked
from mini_grpo.chunked import token_logprobs

B, N, C, V = 3, 7, 16, 50


def make(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, N, C, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(V, C, generator=g, dtype=dtype) * 0.5).requires_grad_()
    t = torch.randint(0, V, (B, N), generator=g)
    mask = torch.rand(B, N, generator=g) > 0.3  # a masked loss, as in training
    up = torch.randn(B, N, generator=g)  # a random upstream gradient
    return h, w, t, mask, up


def reference(h, w, t, T=1.0):
    logp_all = F.log_softmax((h @ w.T).float() / T, -1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, t[..., None]).squeeze(-1), ent.detach()


def loss(logp, mask, up):
    return (logp * up).masked_fill(~mask, 0.0).sum()


@pytest.mark.parametrize("T", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [4, 1, 1000])  # chunked, one token at a time, fast path
def test_values_entropy_and_grads_match_reference(T, chunk):
    h, w, t, mask, up = make()
    ref, ref_ent = reference(h, w, t, T)
    gh_ref, gw_ref = torch.autograd.grad(loss(ref, mask, up), (h, w))
    logp, ent = token_logprobs(h, w, t, temperature=T, chunk_tokens=chunk, entropy=True)
    assert logp.dtype == ent.dtype == torch.float32 and logp.shape == ent.shape == (B, N)
    assert not ent.requires_grad
    torch.testing.assert_close(logp, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    gh, gw = torch.autograd.grad(loss(logp, mask, up), (h, w))
    torch.testing.assert_close(gh, gh_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(gw, gw_ref, atol=1e-5, rtol=0)
    # without entropy: the bare log-probs, same values
    torch.testing.assert_close(token_logprobs(h, w, t, T, chunk), ref, atol=1e-5, rtol=0)


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 5, (2, 3), generator=g)
    assert torch.autograd.gradcheck(lambda h, w: token_logprobs(h, w, t, 0.7, chunk_tokens=4),
                                    (h, w))


def test_autocast_bf16_cpu():
    h, w, t, mask, up = make()
    ref, ref_ent = reference(h, w, t)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, ent = token_logprobs(h, w, t, chunk_tokens=4, entropy=True)
    assert logp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(logp, ref, atol=0.1, rtol=0.02)
    torch.testing.assert_close(ent, ref_ent, atol=0.1, rtol=0.02)
    loss(logp, mask, up).backward()
    assert h.grad.dtype == w.grad.dtype == torch.float32  # cast back to the leaves' dtype
    gh_ref, gw_ref = torch.autograd.grad(loss(ref, mask, up), (h, w))
    torch.testing.assert_close(h.grad, gh_ref, atol=0.05, rtol=0.05)
    torch.testing.assert_close(w.grad, gw_ref, atol=0.05, rtol=0.05)


def test_tied_embedding_weight():
    torch.manual_seed(2)
    emb = torch.nn.Embedding(V, C)
    ids = torch.randint(0, V, (B, N))
    t = torch.randint(0, V, (B, N))
    mask, up = torch.rand(B, N) > 0.3, torch.randn(B, N)
    grads = []
    for fn in (lambda h: reference(h, emb.weight, t)[0],
               lambda h: token_logprobs(h, emb.weight, t, chunk_tokens=4)):
        emb.zero_grad()
        h = torch.tanh(emb(ids))  # the same weight feeds the input and the head
        loss(fn(h), mask, up).backward()
        grads.append(emb.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=0)


def fresh_tensors(func, out):
    """The tensors an op made (not views, not written in place), for the dispatch modes below."""
    if any(r.alias_info is not None for r in func._schema.returns):
        return []
    return [o for o in (out if isinstance(out, (tuple, list)) else [out])
            if isinstance(o, torch.Tensor)]


class LargestVocabTensor(TorchDispatchMode):
    """Numel of the largest freshly allocated (not a view, not in place) op output whose last
    dimension is the vocabulary: counts allocations, no timing."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.largest = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in fresh_tensors(func, out):
            if o.dim() and o.shape[-1] == self.vocab:
                self.largest = max(self.largest, o.numel())
        return out


@pytest.mark.parametrize("entropy", [False, True])
def test_peak_logits_bounded_by_chunk(entropy):
    h, w, t, mask, up = make()
    chunk = 4

    def run(fn):
        with LargestVocabTensor(V) as probe:
            out = fn()
            loss(out[0] if entropy else out, mask, up).backward()
        return probe.largest

    # the probe does flag the one-shot pass: it holds all tokens' logits at once
    assert run(lambda: reference(h, w, t) if entropy else reference(h, w, t)[0]) == B * N * V
    largest = run(lambda: token_logprobs(h, w, t, chunk_tokens=chunk, entropy=entropy))
    assert 0 < largest <= chunk * V


class LiveVocabBytes(TorchDispatchMode):
    """The most bytes of vocabulary-sized tensors alive at once (fresh op outputs whose last
    dimension is the vocabulary, freed when nothing holds them): counts, no timing."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.live, self.peak = vocab, 0, 0

    def _freed(self, n):
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in fresh_tensors(func, out):
            if o.dim() and o.shape[-1] == self.vocab:
                n = o.numel() * o.element_size()
                self.live += n
                self.peak = max(self.peak, self.live)
                weakref.finalize(o, self._freed, n)
        return out


@pytest.mark.parametrize("autocast", [False, True])
def test_one_chunk_keeps_its_logits_and_holds_fewer_bytes_than_log_softmax(autocast, monkeypatch):
    """Inputs that fit one chunk: the forward's softmax serves the backward (no second matmul)
    and, entropy taken 4 rows at a time, the pass holds at most 8 bytes a logit at once (the
    logits and their log-softmax), plus entropy's rows; log_softmax's autograd held 12+."""
    monkeypatch.setattr(chunked, "ENTROPY_ROWS", 4)
    h, w, t, mask, up = make()
    peaks = []
    for fn in (lambda: reference(h, w, t), lambda: token_logprobs(h, w, t, entropy=True)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            with LiveVocabBytes(V) as probe:
                logp, _ = fn()
                loss(logp, mask, up).backward()
        peaks.append(probe.peak / (B * N * V))
    rows = 4 * 4 / (B * N)  # entropy's (4, V) fp32 temporary, per logit
    assert peaks[1] <= 8 + rows + 1e-9 and peaks[0] >= 12, peaks


class WeightShapedOps(TorchDispatchMode):
    """(op name, dtype) of every fresh op output shaped like the LM head's weight (V, C)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.seen += [(func.__name__, o.dtype) for o in fresh_tensors(func, out)
                      if tuple(o.shape) == (V, C)]
        return out


@pytest.mark.parametrize("chunk", [4, 1000])  # several chunks, one
def test_weight_grad_under_autocast_comes_back_in_fp32_without_a_round_trip(chunk):
    """Under bf16 autocast the (V, C) weight gradient is made in fp32 from the chunks' bf16
    products: no zero-filled (V, C) buffer, no bf16 copy of the sum cast back to fp32 (each a
    pass over 113 MB for SmolLM2's tied head, every micro-batch), and the sum of several chunks
    is not rounded to bf16 on the way."""
    h, w, t, mask, up = make()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp = token_logprobs(h, w, t, chunk_tokens=chunk)
    with WeightShapedOps() as probe:
        loss(logp, mask, up).backward()
    assert w.grad.dtype == torch.float32
    ops = [name for name, _ in probe.seen]
    assert not any(n.startswith(("zeros", "zero_", "fill_", "new_zeros")) for n in ops), ops
    bf16 = [name for name, dt in probe.seen if dt == torch.bfloat16]
    # the bf16 products only (one a chunk: 6 chunks of 4 of the 21 tokens, or one)
    assert len(bf16) == -(-B * N // min(chunk, B * N)) and all(n.startswith("mm") for n in bf16)
    assert len(probe.seen) == len(bf16) + 1, probe.seen  # and the one fp32 sum / cast
