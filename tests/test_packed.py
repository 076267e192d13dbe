"""models/packed.py: linear layers on prepacked bf16 weights (q/k/v and gate/up fused) while
sampling on a CPU compute what autocast's bf16 linears compute, and leave nothing behind."""

import pytest
import torch

from mini_grpo.engines.native import generate
from mini_grpo.lora import apply_lora
from mini_grpo.models import GPT, GPTConfig, Llama, LlamaConfig, attention_mask
from mini_grpo.models.packed import PackedLinear, packed, usable

pytestmark = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="oneDNN without bf16 kernels: packing does not apply")

BF16 = torch.bfloat16


def llama(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=64, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
               head_dim=16, n_inner=96, qkv_bias=True, tie_word_embeddings=True)
    return Llama(LlamaConfig(**{**cfg, **kw})).eval()


def gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=64, block_size=64, n_layer=2, n_head=4, n_embd=64)).eval()


def lora_llama():
    m = llama(qkv_bias=False)
    apply_lora(m, r=4, alpha=8)
    for name, p in m.named_parameters():  # adapters that change the output
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    return m.eval()


def decode_logits(m, packing: bool):
    """bf16 autocast: a 6-token prefill of 3 rows (one left-padded), then 5 decode steps."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (3, 11), generator=g)
    valid = torch.ones(3, 11, dtype=torch.bool)
    valid[0, :2] = False
    out = []
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16), \
            packed(m, BF16 if packing else None, rows=3):
        cache = m.new_cache(3, 11, dtype=BF16)
        pos = (valid.long().cumsum(1) - 1).clamp(min=0)
        out.append(m(ids[:, :6], pos[:, :6], attention_mask(valid[:, :6], 6), cache))
        for t in range(6, 11):
            out.append(m(ids[:, t:t + 1], pos[:, t:t + 1], attention_mask(valid[:, :t + 1], 1),
                         cache))
    return torch.cat(out, 1).float()


@pytest.mark.parametrize("make", [llama, gpt, lora_llama], ids=["llama", "gpt", "lora"])
def test_packed_layers_compute_what_autocast_computes(make):
    m = make()
    plain, fast = decode_logits(m, False), decode_logits(m, True)
    # bf16 outputs: one rounding step of a logit near 1 is 2**-7; a different blocking of
    # the same sums may round a few of them the other way
    torch.testing.assert_close(fast, plain, rtol=0, atol=2e-2)
    assert (fast - plain).abs().mean() < 2e-3


def test_one_fused_matmul_equals_the_layers_it_joins():
    torch.manual_seed(0)
    w = [torch.randn(n, 64) for n in (64, 32, 32)]
    b = [torch.randn(n) for n in (64, 32, 32)]
    x = torch.randn(5, 1, 64)
    fused = PackedLinear(torch.cat(w), torch.cat(b), BF16, rows=5)(x)
    with torch.autocast("cpu", dtype=BF16):
        want = torch.cat([torch.nn.functional.linear(x, wi, bi) for wi, bi in zip(w, b)], -1)
    assert fused.dtype == BF16
    torch.testing.assert_close(fused.float(), want.float(), rtol=0, atol=2e-2)


def test_nothing_is_left_behind_and_gradients_flow_after():
    m = lora_llama()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with packed(m, BF16):
        assert m.layers[0].self_attn.fused is not None and m.layers[0].mlp.fused is not None
        assert isinstance(m.lm_head.forward, PackedLinear)
        assert "forward" not in m.layers[0].self_attn.q_proj.__dict__  # fused: not twice
    assert all("forward" not in x.__dict__ and "fused" not in x.__dict__ for x in m.modules())
    assert m.layers[0].self_attn.fused is None  # the class default again
    after = m.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    m.train()
    m(torch.randint(0, 64, (2, 5))).sum().backward()  # the modules' own forward again
    assert m.layers[0].self_attn.q_proj.lora_B.weight.grad is not None


def test_fp32_packs_the_lm_head_alone_and_other_dtypes_nothing():
    m = llama()
    assert usable(m, BF16) and usable(m, torch.float32)
    assert not usable(m, torch.float16) and not usable(m, None)
    with packed(m, torch.float16):
        assert m.layers[0].mlp.fused is None and "forward" not in m.lm_head.__dict__
    x = torch.randint(0, 64, (3, 7))
    with torch.no_grad():
        plain = m(x)
        with packed(m, torch.float32, rows=3):
            assert isinstance(m.lm_head.forward, PackedLinear)
            assert m.layers[0].mlp.fused is None
            assert all("forward" not in c.__dict__ for c in m.layers.modules())
            fast = m(x)
    assert fast.dtype == torch.float32
    torch.testing.assert_close(fast, plain, rtol=0, atol=1e-5)


def test_adapters_off_pack_the_base():
    """Inside adapters_disabled (the LoRA reference) a packed layer runs the base weight."""
    from mini_grpo.lora import adapters_disabled

    m = lora_llama()
    base = llama(qkv_bias=False)
    base.load_state_dict({k: v for k, v in m.state_dict().items() if "lora_" not in k})
    with adapters_disabled(m):
        off = decode_logits(m, True)
    torch.testing.assert_close(off, decode_logits(base, True), rtol=0, atol=0)


def test_generation_on_packed_weights_samples_what_it_did(monkeypatch):
    """native.generate packs under bf16 autocast: greedy tokens equal those of the modules'
    own forward (packing off), and log-probs agree to bf16 rounding."""
    import mini_grpo.engines.native as native

    m = llama()
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [5, 6, 7]]
    seen = []
    monkeypatch.setattr(native, "packed", lambda model, dtype, rows: (
        seen.append((dtype, rows)), packed(model, dtype, rows))[1])
    with torch.autocast("cpu", dtype=BF16):
        fast = generate(m, prompts, 8, eos_id=-1, pad_id=0, greedy=True)
        assert seen == [(BF16, 3)]
        monkeypatch.setattr(native, "packed", lambda model, dtype, rows: packed(model, None))
        plain = generate(m, prompts, 8, eos_id=-1, pad_id=0, greedy=True)
    assert torch.equal(fast.completion_ids, plain.completion_ids)
    torch.testing.assert_close(fast.logprobs, plain.logprobs, rtol=0, atol=2e-2)
