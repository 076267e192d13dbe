"""The one completion log-prob pass, wired to the chunked LM head: with a budget that forces
many chunks it equals the plain full-logits computation (values, entropy, gradients) for a
tied and an untied model, under DDP-free and reference (offloaded) paths alike."""

import pytest
import torch
import torch.nn.functional as F

import mini_grpo.chunked as chunked
from mini_grpo.logprobs import completion_logprobs
from mini_grpo.models import GPT, GPTConfig, Llama, LlamaConfig
from mini_grpo.reference import Reference
from mini_grpo.trajectory import MicroBatch


def models():
    torch.manual_seed(0)
    yield GPT(GPTConfig(vocab_size=50, block_size=32, n_layer=2, n_head=2, n_embd=32))
    yield Llama(LlamaConfig(vocab_size=50, block_size=32, n_layer=2, n_head=4, n_kv_head=2,
                            n_embd=32, head_dim=8, n_inner=48))  # untied head


def batch():
    g = torch.Generator().manual_seed(1)
    pids = torch.randint(4, 50, (2, 5), generator=g)
    pm = torch.ones(2, 5, dtype=torch.bool)
    pm[1, :2] = False
    cids = torch.randint(4, 50, (3, 6), generator=g)
    cm = torch.ones(3, 6, dtype=torch.bool)
    cm[2, 4:] = False
    return pids, pm, cids, cm, torch.tensor([0, 0, 1])


def reference_pass(model, pids, pm, cids, cm, index):
    """Full (B, N, V) logits through the model's own LM head, log_softmax, gather."""
    logits = model(cids, prefix=(pids, pm, index)) / 0.7
    logp_all = F.log_softmax(logits.float(), -1)
    logp = logp_all.gather(-1, cids[..., None]).squeeze(-1).masked_fill(~cm, 0)
    ent = -(logp_all.exp() * logp_all).sum(-1).masked_fill(~cm, 0)
    return logp, ent.detach()


@pytest.mark.parametrize("model", list(models()), ids=["gpt-tied", "llama-untied"])
def test_chunked_pass_equals_full_logits(model, monkeypatch):
    pids, pm, cids, cm, index = batch()
    want, want_ent = reference_pass(model, pids, pm, cids, cm, index)
    w = torch.randn(want.shape)
    (want * w).sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    monkeypatch.setattr(chunked, "LOGITS_BUDGET_BYTES", 4 * 50 * 4)  # 4 tokens a chunk
    calls = []
    real = chunked._ChunkedTokenLogprobs.apply
    monkeypatch.setattr(chunked._ChunkedTokenLogprobs, "apply",
                        lambda *a: calls.append(1) or real(*a))
    got, ent = completion_logprobs(model, pids, pm, cids, cm, 0.7, index, entropy=True)
    assert calls, "the chunked path did not run"
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, want_ent, rtol=0, atol=1e-5)
    (got * w).sum().backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[k], rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.parametrize("model", list(models()), ids=["gpt-tied", "llama-untied"])
def test_offloaded_reference_equals_the_resident_one(model):
    pids, pm, cids, cm, index = batch()
    mb = MicroBatch(torch.arange(cids.size(0)), pids, pm, index, cids, cm, cm, 0.7)
    want = Reference(model, torch.device("cpu")).logprobs(mb)
    got = Reference(model, torch.device("cpu"), offload=True).logprobs(mb)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    ref = Reference(model, torch.device("cpu"), offload=True)
    assert ("lm_head.weight" in ref.cpu_state) == (ref.model.tied_head() is None)


def test_sft_on_a_cpu_takes_the_lm_head_in_smaller_chunks(monkeypatch):
    """SFT's passes (every token of a 1024-token micro-batch) chunk a 49k vocabulary at
    SFT_CPU_BUDGET_BYTES (170 tokens), where the default budget would take 1365 at once."""
    from mini_grpo.sft import sft_loss

    V = 49152
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=V, block_size=256, n_layer=1, n_head=2, n_embd=8))
    calls = []
    real = chunked._ChunkedTokenLogprobs.apply
    monkeypatch.setattr(chunked._ChunkedTokenLogprobs, "apply",
                        lambda *a: calls.append(a[4]) or real(*a))
    x = torch.randint(V, (2, 100))
    sft_loss(model, x, x)
    assert calls == [chunked.SFT_CPU_BUDGET_BYTES // 4 // V]
    assert chunked.LOGITS_BUDGET_BYTES // 4 // V > x.numel()  # the default: one shot
