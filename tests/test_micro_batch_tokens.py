"""micro_batch_tokens: a bound on the token positions of one forward/backward, for GRPO's
passes and SFT's steps, which bounds activation memory whatever the completions' lengths and
leaves the gradient as it was (the same sums, in more pieces)."""

from types import SimpleNamespace

import pytest
import torch
from conftest import rows_rollout as rollout
from ddp_grad_worker import G, PlainState, make_batch, sft_rows

from mini_grpo.config import load_config
from mini_grpo.models import GPT, GPTConfig
from mini_grpo.models.llama import Llama, LlamaConfig
from mini_grpo.plan import cut, plan_micro_batches, row_batches
from mini_grpo.sft import sft_loss, sft_pass
from mini_grpo.state import TrainState
from mini_grpo.trainer import policy_pass, step_metrics
from mini_grpo.trajectory import Trajectory


def test_a_budget_cuts_micro_batches_before_they_exceed_it():
    lengths = [5, 1, 4, 2, 3, 9]
    cost = lambda rows: len(rows) * max(lengths[i] for i in rows)  # noqa: E731
    assert plan_micro_batches(lengths, 6) == [[1, 3, 4, 2, 0, 5]]
    # sorted 1 2 3 4 5 9: [1 2 3] costs 9, adding 4 would cost 16; 9 alone exceeds and stays
    assert plan_micro_batches(lengths, 6, cost, 10) == [[1, 3, 4], [2, 0], [5]]
    assert plan_micro_batches(lengths, 2, cost, 100) == [[1, 3], [4, 2], [0, 5]]
    assert plan_micro_batches([], 4, cost, 10) == []


def test_row_batches_keep_the_budget_and_whole_groups_where_they_fit():
    # 4 groups of 2 (prompts of 3 tokens), alike within a group
    r, cmask = rollout([2, 2, 3, 3, 5, 5, 9, 9])
    plan = [b.tolist() for b in row_batches(r.prompt_mask, cmask, 8, 2)]
    assert plan == [[0, 1, 2, 3, 4, 5, 6, 7]]
    # each group once pushes 3 + 2 x (n - 1) positions: 5, 7, 11, 19
    plan = [b.tolist() for b in row_batches(r.prompt_mask, cmask, 8, 2, budget=19)]
    assert plan == [[0, 1, 2, 3], [4, 5], [6, 7]]  # 5 + 7 = 12 <= 19, + 11 would be 23
    # a budget no whole group of the longest fits: its rows are split, each alone (3 + 8)
    plan = [b.tolist() for b in row_batches(r.prompt_mask, cmask, 8, 2, budget=12)]
    assert [6] in plan and [7] in plan
    n, p = cmask.sum(1), r.prompt_mask.sum(1)
    for rows in plan:
        pushed = len({i // 2 for i in rows}) * max(p[rows]) + len(rows) * (max(n[rows]) - 1)
        assert pushed <= 12
    assert sorted(i for b in plan for i in b) == list(range(8))


def grads(micro_batch_tokens: int):
    r, rewards, _ = make_batch(seed=3)
    cfg = load_config(None, {"group_size": G, "beta": 0.0, "use_amp": "false",
                             "micro_batch_size": 64,
                             "micro_batch_tokens": micro_batch_tokens}, env={})
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=24, block_size=64, n_layer=2, n_head=2, n_embd=32))
    traj = Trajectory.of(r, rewards, cfg)
    policy_pass(model, traj, cfg)
    return len(traj.plan), [p.grad for p in model.parameters()]


def test_a_budget_leaves_the_policy_gradient_as_it_was():
    one, whole = grads(0)
    many, cut = grads(24)
    assert one == 1 and many > 3
    for a, b in zip(whole, cut):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_rows_of_zero_advantage_are_left_out_of_the_passes_when_beta_is_0():
    """With beta 0 the rows of a zero-spread group (advantage exactly 0) add nothing to the
    loss or its gradient: the plan leaves them out, prompts and all, and the gradient is still
    the whole batch's (the normalisers count them); the step's statistics are of the tokens
    the passes carried (the ratio of a first pass: exactly 1). With beta > 0 (the KL term
    has a gradient) every row is carried."""
    r, rewards, _ = make_batch(seed=3)
    opts = {"group_size": G, "beta": 0.0, "use_amp": "false", "micro_batch_size": 64}
    cfg = load_config(None, opts, env={})
    traj = Trajectory.of(r, rewards, cfg)
    assert traj.zero_spread.tolist()[0] and not traj.zero_spread[1:].any()
    B = len(rewards)
    assert sorted(i for c in traj.plan for i in c.rows.tolist()) == list(range(G, B))
    every = traj.replace(plan=tuple(cut(rows, traj.loss_mask, r.prompt_mask, G) for rows in
                                    row_batches(r.prompt_mask, traj.loss_mask, 64, G)))
    assert sum(len(c.rows) for c in every.plan) == B
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=24, block_size=64, n_layer=2, n_head=2, n_embd=32))
    out = {}
    for name, t in (("skipped", traj), ("every", every)):
        model.zero_grad(set_to_none=True)
        stats, _ = policy_pass(model, t, cfg)
        out[name] = stats, [p.grad.clone() for p in model.parameters()]
    (left, g_left), (whole, g_whole) = out["skipped"], out["every"]
    torch.testing.assert_close(left.loss, whole.loss, rtol=1e-5, atol=1e-7)
    for a, b in zip(g_left, g_whole):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert left.tokens == traj.loss_mask[G:].sum() and whole.tokens == traj.loss_mask.sum()
    assert left.positions < whole.positions
    m = step_metrics(traj, SimpleNamespace(columns={}, metrics={}), left, cfg, {}, 1.0)
    assert m["ratio"] == pytest.approx(1.0) and m["clip_low"] == 0.0
    kl = Trajectory.of(r, rewards, load_config(None, {**opts, "beta": 0.1}, env={}))
    assert sorted(i for c in kl.plan for i in c.rows.tolist()) == list(range(B))


class BF16State(PlainState):
    """bf16 autocast, and TrainState's weights cast once a pass where `model` is the net."""
    def __init__(self, model):
        self.model, self.guard = model, SimpleNamespace(amp=True)
        self.precision = SimpleNamespace(dtype=torch.bfloat16)

    def autocast(self):
        return torch.autocast("cpu", dtype=torch.bfloat16)

    cast_once = TrainState.cast_once


def test_sft_passes_with_the_weights_cast_once_give_autocasts_gradients_bit_for_bit():
    """SFT's micro-batches under bf16 autocast, the Linear weights cast once a step
    (precision.linear_weights_cast_once) against once a micro-batch: the same loss and
    fp32 gradients, bit for bit, on a Llama with a tied head."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=48, block_size=64, n_layer=2, n_head=4, n_kv_head=2,
                              n_embd=64, head_dim=16, n_inner=128, tie_word_embeddings=True))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(4, 48, (6, 20), generator=g)
    y = torch.where(torch.arange(20) >= 8, x, -1)
    out = {}
    for once in (False, True):
        model.zero_grad(set_to_none=True)
        loss = sft_pass(model, x, y, 48, BF16State(model if once else None))
        out[once] = loss, [p.grad.clone() for p in model.parameters()]
    assert torch.equal(out[True][0], out[False][0])
    for a, b in zip(out[True][1], out[False][1]):
        assert a.dtype == torch.float32 and torch.equal(a, b)


def test_sft_micro_batches_leave_the_loss_and_gradient_as_they_were():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=24, block_size=64, n_layer=2, n_head=2, n_embd=32))
    x, y = sft_rows([3, 11, 6, 20, 8, 2], seed=1)
    with torch.no_grad():
        expected = sft_loss(model, x, y)
    whole = sft_pass(model, x, y, 0, PlainState())
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    calls = []
    forward = model.forward
    model.forward = lambda idx, **kw: calls.append(idx.shape) or forward(idx, **kw)
    cut = sft_pass(model, x, y, 24, PlainState())
    assert len(calls) > 2 and all(b * t <= 24 or b == 1 for b, t in calls)
    torch.testing.assert_close(whole, expected)
    torch.testing.assert_close(cut, expected, rtol=1e-5, atol=1e-6)
    for a, p in zip(ref, model.parameters()):
        torch.testing.assert_close(p.grad, a, rtol=1e-5, atol=1e-6)


def test_sft_loss_takes_the_lm_head_at_the_target_tokens_alone(monkeypatch):
    """The cross-entropy of the full logits over the target tokens, loss and gradient alike,
    with the head's logits made for those tokens only; a pass with no target gives a zero
    loss whose backward still runs (zero gradients)."""
    from mini_grpo import chunked

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=24, block_size=64, n_layer=2, n_head=2, n_embd=32))
    x = torch.randint(4, 24, (3, 10))
    y = torch.full((3, 10), -1)
    y[0, 6:] = x[0, 6:]
    y[2, 3:8] = x[2, 3:8]  # row 1: prompt alone
    logits = model(x)
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-1)
    want.backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    rows = []
    real = chunked._ChunkedTokenLogprobs.apply
    monkeypatch.setattr(chunked._ChunkedTokenLogprobs, "apply",
                        lambda h, *a: rows.append(h.size(0)) or real(h, *a))
    got = sft_loss(model, x, y)
    got.backward()
    assert rows == [int((y >= 0).sum())] == [9]
    torch.testing.assert_close(got, want)
    for a, p in zip(ref, model.parameters()):
        torch.testing.assert_close(p.grad, a)
    model.zero_grad(set_to_none=True)
    none = sft_loss(model, x, torch.full_like(y, -1))
    none.backward()
    assert none.item() == 0 and rows[-1] == x.numel()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_the_cuts_are_the_cheapest_of_every_way_to_cut_the_order():
    # every segmentation of a few random orders, against the dynamic programme's
    from itertools import combinations

    from mini_grpo.plan import _cuts

    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        m, group = 7, int(torch.randint(1, 4, (1,), generator=gen))
        n = torch.randint(1, 30, (m,), generator=gen).tolist()
        p = [int(torch.randint(1, 20, (1,), generator=gen))] * m
        for i in range(m):
            p[i] = p[i // group * group]  # a group's rows share their prompt
        order = torch.randperm(m, generator=gen).tolist()
        size, budget, pass_cost = 1 + trial % 5, [0, 40, 90][trial % 3], [0, 10, 60][trial % 2]

        def pushed(rows, n=n, p=p, group=group):
            return len({i // group for i in rows}) * max(p[i] for i in rows) + \
                len(rows) * (max(n[i] for i in rows) - 1)

        best = None
        for k in range(m):
            for at in combinations(range(1, m), k):
                plan = [order[a:b] for a, b in zip((0, *at), (*at, m))]
                if any(len(b) > size or (budget and len(b) > 1 and pushed(b) > budget)
                       for b in plan):
                    continue
                cost = sum(pass_cost + pushed(b) for b in plan)
                best = cost if best is None else min(best, cost)
        cost, plan = _cuts(order, n, p, group, size, budget, pass_cost)
        assert [i for b in plan for i in b] == order
        assert all(len(b) <= size and (not budget or len(b) == 1 or pushed(b) <= budget)
                   for b in plan)
        assert cost == sum(pass_cost + pushed(b) for b in plan) == best, (trial, plan)


def test_a_job_shaped_step_computes_each_prompt_about_once():
    # 8 groups of 8 (prompts of 60 tokens), each with one completion at the 80-token cap and
    # the rest 20-35 tokens, in micro-batches of at most 16 rows and 384 positions (the LM
    # job's before it took 512): no whole group fits, yet each group's short rows go
    # together, its long one beside other groups' long ones
    lengths = [20 + (3 * i) % 16 if i % 8 else 80 for i in range(64)]
    r, cmask = rollout(lengths, plen=60)
    plan = [b.tolist() for b in row_batches(r.prompt_mask, cmask, 16, 8, budget=384)]
    assert sorted(i for b in plan for i in b) == list(range(64))
    prompts = sum(len({i // 8 for i in b}) for b in plan)
    assert len(plan) <= 12 and prompts <= 16, plan
    for b in plan:
        assert len(b) <= 16
        assert len({i // 8 for i in b}) * 60 + len(b) * (max(lengths[i] for i in b) - 1) <= 384


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_the_policy_gradient_is_each_rows_own_computed_alone(arch):
    """The passes' gradient (shared prompts, ragged rows, left padding, the plan's cuts) is
    the one of the loss written out row by row: each row alone through the model, prompt then
    completion, log-softmax(logits / T) at its completion tokens, -A x log p over the batch's
    loss tokens (ratio 1, dapo). A GPT, and a Llama (RoPE positions, GQA, tied head) as
    SmolLM2 is."""
    r, rewards, _ = make_batch(seed=3)
    cfg = load_config(None, {"group_size": G, "beta": 0.0, "use_amp": "false",
                             "micro_batch_size": 64, "loss_agg": "dapo"}, env={})
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=24, block_size=64, n_layer=2, n_head=2, n_embd=32)) \
        if arch == "gpt" else Llama(LlamaConfig(
            vocab_size=24, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
            head_dim=8, n_inner=64, tie_word_embeddings=True))
    traj = Trajectory.of(r, rewards, cfg)
    policy_pass(model, traj, cfg)
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    loss, T = 0.0, r.sampling.temperature
    for b in range(len(rewards)):
        p, n = r.prompt_ids[b][r.prompt_mask[b]], int(r.completion_mask[b].sum())
        out = model(torch.cat([p, r.completion_ids[b][:n]])[None])
        logits = out[0] if isinstance(out, tuple) else out
        logp = torch.log_softmax(logits[0, len(p) - 1:len(p) - 1 + n].float() / T, -1)
        tok = logp.gather(1, r.completion_ids[b][:n, None]).squeeze(1)
        loss = loss - (traj.advantages[b] * tok * traj.loss_mask[b][:n]).sum()
    (loss / traj.loss_mask.sum()).backward()
    assert (traj.advantages != 0).sum() > 4
    for a, w in zip(got, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-7)
