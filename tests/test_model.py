import pytest
import torch

from mini_grpo.models import GPT, GPTConfig, attention_mask, positions


def tiny_gpt(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=40, block_size=64, n_layer=2, n_head=2, n_embd=32)
    cfg.update(kw)
    return GPT(GPTConfig(**cfg)).eval()


def test_kv_cache_logits_equal_full_recompute_at_every_position():
    m = tiny_gpt()
    idx = torch.randint(4, 40, (3, 20), generator=torch.Generator().manual_seed(1))
    full = m(idx)  # (B, T, V), plain causal
    cache = m.new_cache(3, 20)
    steps = [m(idx[:, :5], cache=cache)]  # prefill 5, then one token at a time
    for t in range(5, 20):
        valid = torch.ones(3, t + 1, dtype=torch.bool)
        steps.append(m(idx[:, t:t + 1], mask=attention_mask(valid, 1), cache=cache))
    inc = torch.cat(steps, dim=1)
    assert inc.shape == full.shape
    torch.testing.assert_close(inc, full, rtol=1e-5, atol=1e-5)


def test_left_padded_row_matches_the_row_alone():
    m = tiny_gpt()
    row = torch.tensor([[1, 7, 8, 9, 10]])
    alone = m(row)
    padded = torch.tensor([[0, 0, 0, 1, 7, 8, 9, 10]])
    valid = padded != 0
    out = m(padded, positions(valid), attention_mask(valid, valid.size(1)))
    torch.testing.assert_close(out[:, 3:], alone, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all()  # pad rows attend to themselves, never to nothing


def test_positions_and_mask_shapes():
    valid = torch.tensor([[False, False, True, True], [True, True, True, True]])
    assert positions(valid).tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]
    m = attention_mask(valid, 4)
    assert m.shape == (2, 1, 4, 4)
    # row 0, query 3 (2nd real token) sees keys 2 and 3 only
    assert m[0, 0, 3].tolist() == [False, False, True, True]
    # a pad query sees only itself
    assert m[0, 0, 1].tolist() == [False, True, False, False]


def test_logits_from_skips_the_head_for_early_positions():
    m = tiny_gpt()
    idx = torch.randint(4, 40, (2, 10))
    torch.testing.assert_close(m(idx, logits_from=6), m(idx)[:, 6:])


def test_weight_tying_param_count_and_grad_checkpointing_gradients_match():
    m = tiny_gpt().train()
    assert m.lm_head.weight is m.wte.weight
    c = m.cfg
    per_block = 12 * c.n_embd**2 + 13 * c.n_embd
    expected = (c.vocab_size + c.block_size) * c.n_embd + c.n_layer * per_block + 2 * c.n_embd
    assert m.num_params() == expected
    idx = torch.randint(4, 40, (2, 12))
    grads = []
    for ckpt in (False, True):
        m.zero_grad()
        m.gradient_checkpointing = ckpt
        m(idx).square().mean().backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_manual_attention_matches_sdpa_with_and_without_padding():
    m = tiny_gpt()
    idx = torch.randint(4, 40, (2, 9))
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[0, :3] = False
    ref = [m(idx), m(idx, positions(valid), attention_mask(valid, 9))]
    m.attn_impl = "manual"
    got = [m(idx), m(idx, positions(valid), attention_mask(valid, 9))]
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("amx", [False, True])
def test_a_bf16_decode_step_on_a_cpu_attends_as_sdpa_does(amx, monkeypatch):
    """A decode step (one query a row) in bf16 on a CPU without AMX takes grouped matmuls
    instead of SDPA's kernel (Attention._attend), with AMX SDPA itself; grouped-query heads,
    a padded key and the cache's strided keys included, both must attend as SDPA in fp32."""
    from mini_grpo.models import Llama, LlamaConfig, core
    from mini_grpo.models.core import Attention

    monkeypatch.setattr(core, "_AMX", amx)

    torch.manual_seed(0)
    att = Llama(LlamaConfig(vocab_size=24, block_size=64, n_layer=1, n_head=6, n_kv_head=2,
                            n_embd=48, head_dim=8, n_inner=64)).layers[0].self_attn
    q = torch.randn(3, 6, 1, 8, dtype=torch.bfloat16)
    cache = torch.randn(2, 3, 2, 20, 8, dtype=torch.bfloat16)  # (k/v, B, nkv, max_len, hs)
    k, v = cache[0, :, :, :11], cache[1, :, :, :11]  # the filled part: a strided view
    mask = torch.ones(3, 1, 1, 11, dtype=torch.bool)
    mask[0, ..., :4] = False  # a left-padded row
    got = Attention._attend(att, q, k, v, mask, manual=False)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(got.float(), want, rtol=0, atol=2e-2)
