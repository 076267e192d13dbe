import torch
from conftest import tiny_gpt

from mini_grpo.engines.native import generate, sample
from mini_grpo.logprobs import completion_logprobs, widen_prompts
from mini_grpo.models import GPT, GPTConfig
from mini_grpo.tokenizer import CharTokenizer

EOS, PAD = 2, 0
PROMPTS = [[1, 5, 6, 7], [1, 8], [1, 9, 10, 11, 12, 13, 14]]


def boost_eos(m, amount):
    """Adds `amount` to the EOS logit of every forward pass (the sampler's and the log-prob
    pass's, whose LM head is a matmul of its own): the final norm's bias moves along EOS's
    row of the head, which moves the other logits a little too."""
    w = m.lm_head.weight[EOS].detach()
    with torch.no_grad():
        m.ln_f.bias += amount * w / w.dot(w)


def test_ragged_batch_greedy_equals_each_prompt_alone():
    m = tiny_gpt()
    batch = generate(m, PROMPTS, 16, EOS, PAD, greedy=True)
    for i, p in enumerate(PROMPTS):
        alone = generate(m, [p], 16, EOS, PAD, greedy=True)
        n = alone.completion_ids.size(1)
        assert batch.completion_ids[i, :n].tolist() == alone.completion_ids[0].tolist()
        torch.testing.assert_close(batch.logprobs[i, :n], alone.logprobs[0], rtol=0, atol=1e-5)


def test_sampling_logprobs_equal_full_forward_pass():
    m = tiny_gpt()
    for temperature in (1.0, 0.7):
        g = torch.Generator().manual_seed(3)
        r = generate(m, PROMPTS, 20, EOS, PAD, temperature=temperature, generator=g)
        lp = completion_logprobs(m, r.prompt_ids, r.prompt_mask, r.completion_ids,
                                 r.completion_mask, temperature=temperature)
        torch.testing.assert_close(lp, r.logprobs, rtol=0, atol=1e-5)


def test_kv_cache_and_recompute_sample_the_same_tokens():
    m = tiny_gpt()
    a = generate(m, PROMPTS, 20, EOS, PAD, generator=torch.Generator().manual_seed(5))
    b = generate(m, PROMPTS, 20, EOS, PAD, generator=torch.Generator().manual_seed(5),
                 use_cache=False)
    assert torch.equal(a.completion_ids, b.completion_ids)
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)


def test_each_row_stops_at_its_own_eos_and_is_masked_after():
    m = tiny_gpt()
    boost_eos(m, 2.0)  # EOS likely, so rows end at different steps
    r = generate(m, PROMPTS * 4, 30, EOS, PAD, generator=torch.Generator().manual_seed(0))
    assert r.finished.any() and r.completion_ids.size(1) <= 30
    ends = set()
    for ids, mask, lp, fin in zip(r.completion_ids.tolist(), r.completion_mask.tolist(),
                                  r.logprobs, r.finished.tolist()):
        n = sum(mask)
        assert mask == [True] * n + [False] * (len(mask) - n)  # 1 up to and including EOS
        if fin:
            assert ids[n - 1] == EOS and EOS not in ids[:n - 1]
            ends.add(n)
        assert all(t == PAD for t in ids[n:])
        assert (lp[n:] == 0).all() and (lp[:n] < 0).all()
    assert len(ends) > 1  # rows really ended at different lengths


def test_stops_when_every_row_has_ended():
    m = tiny_gpt()
    boost_eos(m, 100.0)  # EOS always wins
    r = generate(m, PROMPTS, 30, EOS, PAD, greedy=True)
    assert r.completion_ids.size(1) == 1 and r.finished.all()


def test_greedy_is_deterministic_and_same_seed_same_samples():
    m = tiny_gpt()
    g1 = generate(m, PROMPTS, 20, EOS, PAD, greedy=True)
    g2 = generate(m, PROMPTS, 20, EOS, PAD, greedy=True)
    assert torch.equal(g1.completion_ids, g2.completion_ids)
    s = [generate(m, PROMPTS, 20, EOS, PAD, top_k=10, top_p=0.9,
                  generator=torch.Generator().manual_seed(s)).completion_ids for s in (7, 7, 8)]
    assert torch.equal(s[0], s[1]) and not torch.equal(s[0], s[2])


def test_top_k_one_is_greedy():
    m = tiny_gpt()
    g = generate(m, PROMPTS, 12, EOS, PAD, greedy=True)
    k1 = generate(m, PROMPTS, 12, EOS, PAD, top_k=1, generator=torch.Generator().manual_seed(1))
    assert torch.equal(g.completion_ids, k1.completion_ids)


def test_sample_decodes_text_without_eos():
    tok = CharTokenizer("abcdefgh:")
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=64, n_layer=1, n_head=1,
                      n_embd=16)).eval()
    r = sample(m, tok, ["ab:", "h:"], 10, generator=torch.Generator().manual_seed(0))
    assert len(r.texts) == 2
    for text, ids in zip(r.texts, r.completion_ids.tolist()):
        assert text == tok.decode(ids)


def test_packed_pass_equals_each_row_alone():
    """Left padding and cut-short rows: each row's log-probs must be those it gets alone."""
    m = tiny_gpt()
    g = torch.Generator().manual_seed(4)
    r = generate(m, PROMPTS * 2, 12, EOS, PAD, generator=g)
    cmask = r.completion_mask.clone()
    cmask[0, 3:] = False  # a row cut short, as dynamic sampling or EOS would
    lp = completion_logprobs(m, r.prompt_ids, r.prompt_mask, r.completion_ids, cmask)
    for i, prompt in enumerate(PROMPTS * 2):
        n = int(cmask[i].sum())
        alone = torch.tensor([prompt + r.completion_ids[i, :n].tolist()])
        logp = m(alone[:, :-1]).log_softmax(-1)[0, len(prompt) - 1:]
        want = logp.gather(-1, alone[0, len(prompt):, None]).squeeze(-1)
        torch.testing.assert_close(lp[i, :n], want, rtol=0, atol=1e-5)
        assert lp[i, n:].eq(0).all()


def test_shared_prompt_pass_equals_the_full_pass_with_gradients():
    """Each prompt computed once (GPT.forward_shared) gives the full pass's log-probs and
    parameter gradients, with either attention implementation, for rows in groups and for
    rows in any order."""
    m = tiny_gpt().train()
    boost_eos(m, 2.5)  # rows end at different steps
    G = 3
    rows = [p for p in PROMPTS for _ in range(G)]
    r = generate(m, rows, 10, EOS, PAD, generator=torch.Generator().manual_seed(1))
    assert r.completion_mask.sum(1).unique().numel() > 1  # ragged completions
    groups = torch.arange(len(PROMPTS)).repeat_interleave(G)
    order = torch.tensor([4, 0, 8, 1, 5])  # a subset of rows, out of order
    for impl in ("sdpa", "manual"):
        m.attn_impl = impl
        grads = []
        for shared in (False, True):
            m.zero_grad()
            if shared:
                lp = completion_logprobs(m, r.prompt_ids[::G], r.prompt_mask[::G],
                                         r.completion_ids, r.completion_mask,
                                         prompt_index=groups)
            else:
                lp = completion_logprobs(m, r.prompt_ids, r.prompt_mask, r.completion_ids,
                                         r.completion_mask)
            (lp * torch.linspace(0.5, 1.5, lp.numel()).view_as(lp)).sum().backward()
            grads.append([p.grad.clone() for p in m.parameters()])
            torch.testing.assert_close(lp, r.logprobs, rtol=0, atol=1e-5)
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        # rows of two prompts (1 and 2 of the three), given in any order
        used = groups[order].unique()
        lp = completion_logprobs(m, r.prompt_ids[used * G], r.prompt_mask[used * G],
                                 r.completion_ids[order], r.completion_mask[order],
                                 prompt_index=torch.searchsorted(used, groups[order]))
        torch.testing.assert_close(lp, r.logprobs[order], rtol=0, atol=1e-5)
        wide = widen_prompts(r.prompt_ids[used * G], r.prompt_mask[used * G], 16)
        assert wide[0].size(1) == 16 > r.prompt_ids.size(1)  # learned positions see pads too
        lp = completion_logprobs(m, *wide, r.completion_ids[order], r.completion_mask[order],
                                 prompt_index=torch.searchsorted(used, groups[order]))
        torch.testing.assert_close(lp, r.logprobs[order], rtol=0, atol=1e-5)


def test_repeated_prompts_are_prefilled_once_with_the_same_result():
    m = tiny_gpt()
    calls = []
    m.wte.register_forward_hook(lambda mod, inp, out: calls.append(inp[0].shape))
    rows = [p for p in PROMPTS for _ in range(4)]  # groups of 4, as GRPO samples them
    r = generate(m, rows, 12, EOS, PAD, generator=torch.Generator().manual_seed(2))
    assert calls[0] == (len(PROMPTS), 7)  # the prefill saw the 3 distinct prompts only
    lp = completion_logprobs(m, r.prompt_ids, r.prompt_mask, r.completion_ids,
                             r.completion_mask)
    torch.testing.assert_close(lp, r.logprobs, rtol=0, atol=1e-5)
    g = generate(m, rows, 12, EOS, PAD, greedy=True)
    for i in range(0, len(rows), 4):  # one prompt, one greedy answer
        assert all(torch.equal(g.completion_ids[i], g.completion_ids[i + j]) for j in range(4))
    alone = generate(m, PROMPTS, 12, EOS, PAD, greedy=True)
    for i in range(len(PROMPTS)):
        n = int(alone.completion_mask[i].sum())
        assert g.completion_ids[4 * i, :n].tolist() == alone.completion_ids[i, :n].tolist()


def test_completions_of_one_token_each_go_through_the_shared_pass():
    """Every row ended at its first token (EOS at once, or sampling stopped on non-finite
    logits): the shared pass has no completion inputs at all and must still work."""
    m = tiny_gpt()
    boost_eos(m, 100.0)
    r = generate(m, PROMPTS, 8, EOS, PAD, greedy=True)
    assert r.completion_ids.size(1) == 1
    lp = completion_logprobs(m, r.prompt_ids, r.prompt_mask, r.completion_ids,
                             r.completion_mask)
    torch.testing.assert_close(lp, r.logprobs, rtol=0, atol=1e-5)


def test_sampling_draws_from_the_tempered_truncated_distribution():
    """20,000 draws from one 5-token distribution at temperature 0.7: every token's frequency
    is within 0.015 of its probability (about 4 standard errors at p = 0.5; the seed is
    fixed, so the test is deterministic), with top_k and top_p renormalising over the tokens
    they keep. A wrong sampler misses by far more: plain argmax by 0.52, probabilities
    without the temperature by 0.08 (0.40 against 0.48 for the first token)."""
    from mini_grpo.engines.native import _pick

    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    T, n = 0.7, 20_000
    tempered = (probs.log() / T).softmax(-1)  # [0.482, 0.247, 0.180, 0.067, 0.025]
    logits = probs.log().expand(n, 5).contiguous()
    keep_3 = torch.tensor([1.0, 1, 1, 0, 0])
    keep_2 = torch.tensor([1.0, 1, 0, 0, 0])  # top_p 0.7: 0.482 + 0.247 reaches it
    g = torch.Generator().manual_seed(0)
    for top_k, top_p, keep in [(0, 1.0, torch.ones(5)), (3, 1.0, keep_3), (0, 0.7, keep_2),
                               (4, 0.7, keep_2)]:
        tok, lp = _pick(logits, T, top_k, top_p, False, g)
        freq = torch.bincount(tok, minlength=5) / n
        want = tempered * keep / (tempered * keep).sum()
        assert (freq - want).abs().max() < 0.015, (top_k, top_p, freq, want)
        torch.testing.assert_close(lp, tempered.log()[tok])  # before truncation


def test_every_eos_id_ends_a_row():
    # a tokenizer may name several ids that end a completion (Llama 3: <|eot_id|> and
    # <|end_of_text|>): a row ends at whichever comes first
    m = tiny_gpt()
    boost_eos(m, 100.0)  # EOS (2) always wins, so a row ends at once only if 2 counts
    r = generate(m, PROMPTS, 5, [7, EOS], PAD, greedy=True)
    assert r.finished.all() and r.completion_ids[:, 0].tolist() == [EOS] * 3
    r = generate(m, PROMPTS, 5, [7], PAD, greedy=True)  # EOS alone no longer ends a row
    assert not r.finished.any() and r.completion_ids.size(1) == 5


def test_frozen_weights_are_cast_once_per_generation_and_stay_frozen():
    # under autocast a frozen weight (LoRA's base and head) is cast once for the whole
    # generation, as a trainable one is: the same tokens, and its flags as they were
    from mini_grpo.lora import apply_lora

    m = tiny_gpt()
    apply_lora(m, r=2, alpha=4)
    frozen = {n for n, p in m.named_parameters() if not p.requires_grad}
    assert "lm_head.weight" in frozen or "wte.weight" in frozen
    prompts = [[1, 5, 6, 7], [1, 8, 9]]
    outs = []
    for flip in (True, False):
        if not flip:  # all trainable: autocast caches every cast
            m.requires_grad_(True)
        g = torch.Generator().manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs.append(generate(m, prompts, 8, eos_id=2, pad_id=0, generator=g))
        if flip:
            assert {n for n, p in m.named_parameters() if not p.requires_grad} == frozen
    assert torch.equal(outs[0].completion_ids, outs[1].completion_ids)
    assert torch.equal(outs[0].logprobs, outs[1].logprobs)


def test_rows_that_ended_drop_out_of_the_batch_and_the_rest_sample_as_alone():
    """Once a quarter of the batch has ended, the decode steps run on the other rows alone
    (fewer rows per forward), and every row's tokens and log-probs are those it gets alone."""
    m = tiny_gpt()
    boost_eos(m, 0.3)  # 8 rows end at once, 2 after 5 tokens, 2 run to the cap
    prompts = [[1, 5 + i % 9, 6 + i % 5] for i in range(12)]
    rows = []
    forward = m.forward
    m.forward = lambda idx, *a, **kw: rows.append(idx.size(0)) or forward(idx, *a, **kw)
    for use_cache in (True, False):
        rows.clear()
        batch = generate(m, prompts, 24, EOS, PAD, greedy=True, use_cache=use_cache)
        lengths = batch.completion_mask.sum(1)
        assert lengths.min() < lengths.max()  # rows end at different steps
        assert rows[0] == len(prompts) or use_cache  # cache: the prefill computes each prompt once
        assert min(rows[1:]) < len(prompts)  # decode steps without the rows that ended
        assert rows[1:] == sorted(rows[1:], reverse=True)
        for i, p in enumerate(prompts):
            alone = generate(m, [p], 24, EOS, PAD, greedy=True, use_cache=use_cache)
            n = alone.completion_ids.size(1)
            assert int(lengths[i]) == n and batch.finished[i] == alone.finished[0]
            assert batch.completion_ids[i, :n].tolist() == alone.completion_ids[0].tolist()
            torch.testing.assert_close(batch.logprobs[i, :n], alone.logprobs[0], rtol=0,
                                       atol=1e-5)


def test_a_prefix_every_prompt_shares_is_computed_once_with_the_same_result():
    """Prompts that open alike (a system prompt, a tool list) have that part computed once,
    laid out before their own tokens: each row samples as it would alone, and the log-probs
    are those of the training pass over the rollout's layout."""
    from mini_grpo.engines import native

    m = tiny_gpt()
    head = [1] + [4 + (i * 7) % 19 for i in range(20)]  # 21 shared tokens
    prompts = [head + [5, 6, 7], head + [8], head + [9, 10, 11, 12, 13], head + [8]]
    assert native._shared_prefix(prompts) == 21
    assert native._shared_prefix([head, head + [3]]) == 20  # each keeps a token of its own
    assert native._shared_prefix([[1, 2, 3], [1, 2, 4]]) == 0  # too short to bother
    batch = generate(m, prompts, 12, EOS, PAD, greedy=True)
    assert batch.prompt_mask[:, :21].all()  # the shared part first, padding after it
    for i, p in enumerate(prompts):
        alone = generate(m, [p], 12, EOS, PAD, greedy=True)
        n = alone.completion_ids.size(1)
        assert batch.completion_ids[i, :n].tolist() == alone.completion_ids[0].tolist()
        torch.testing.assert_close(batch.logprobs[i, :n], alone.logprobs[0], rtol=0, atol=1e-5)
    r = generate(m, prompts, 12, EOS, PAD, generator=torch.Generator().manual_seed(1))
    lp = completion_logprobs(m, r.prompt_ids, r.prompt_mask, r.completion_ids,
                             r.completion_mask)
    torch.testing.assert_close(lp, r.logprobs, rtol=0, atol=1e-5)
    # and the no-cache path, which never shares, samples the same tokens
    again = generate(m, prompts, 12, EOS, PAD, generator=torch.Generator().manual_seed(1),
                     use_cache=False)
    assert torch.equal(again.completion_ids, r.completion_ids)


def test_rows_that_ended_leave_the_cache_in_place():
    """Dropping rows moves the kept rows' keys and values to the front of the same storage,
    in order, one layer at a time: a second cache gathered beside the first at every drop
    took the LM job's evaluations to 4.5 GiB on a CPU, 3.9 in place."""
    from mini_grpo.models.core import KVCache
    torch.manual_seed(0)
    c = KVCache(3, 5, 2, 8, 4, torch.device("cpu"), torch.float32)
    c.k.normal_()
    c.v.normal_()
    c.len = 6
    k0, v0, storage = c.k.clone(), c.v.clone(), c.k.untyped_storage().data_ptr()
    keep = torch.tensor([True, False, True, True, False])
    c.keep(keep)
    assert c.k.shape == c.v.shape == (3, 3, 2, 8, 4)
    assert c.k.untyped_storage().data_ptr() == storage  # no new cache
    torch.testing.assert_close(c.k[..., :6, :], k0[:, keep, :, :6], rtol=0, atol=0)
    torch.testing.assert_close(c.v[..., :6, :], v0[:, keep, :, :6], rtol=0, atol=0)
    k, _ = c.update(1, torch.ones(3, 2, 1, 4), torch.ones(3, 2, 1, 4))  # goes on from there
    assert k.shape == (3, 2, 7, 4) and bool((k[:, :, 6] == 1).all())
    torch.testing.assert_close(k[:, :, :6], k0[1, keep, :, :6], rtol=0, atol=0)
