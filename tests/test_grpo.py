"""GRPO functions against values computed by hand (in the comments)."""

import math

import pytest
import torch

from mini_grpo.advantages import group_advantages, zero_spread
from mini_grpo.grpo import LossSettings, grpo_loss
from mini_grpo.logprobs import completion_logprobs


def test_group_advantages_by_hand():
    # group 1: r = [1, 0], mean 0.5, std (population) 0.5 -> [+1, -1] (eps aside)
    # group 2: r = [0.2, 0.2], zero spread -> [0, 0]
    r = torch.tensor([1.0, 0.0, 0.2, 0.2])
    a = group_advantages(r, 2, "group", eps=0.0)
    assert zero_spread(r, 2).tolist() == [False, True]
    torch.testing.assert_close(a, torch.tensor([1.0, -1.0, 0.0, 0.0]))
    # none (Dr. GRPO): just centred -> [0.5, -0.5, 0, 0]
    a = group_advantages(r, 2, "none")
    torch.testing.assert_close(a, torch.tensor([0.5, -0.5, 0.0, 0.0]))
    # batch: centred / batch std. batch mean 0.35; deviations .65 -.35 -.15 -.15;
    # var = (.4225 + .1225 + .0225 + .0225) / 4 = .1475 -> std .38406
    a = group_advantages(r, 2, "batch", eps=0.0)
    s = math.sqrt(0.1475)
    torch.testing.assert_close(a, torch.tensor([0.5 / s, -0.5 / s, 0.0, 0.0]))
    # an externally given (global) std is used as is
    a = group_advantages(r, 2, "batch", eps=0.0, batch_std=2.0)
    torch.testing.assert_close(a, torch.tensor([0.25, -0.25, 0.0, 0.0]))


def test_zero_spread_groups_get_zero_advantage_under_every_scaling():
    r = torch.tensor([0.7, 0.7, 0.7, 0.1, 0.9, 0.5])
    for scale in ("group", "batch", "none"):
        a = group_advantages(r, 3, scale)
        assert zero_spread(r, 3).tolist() == [True, False]
        assert a[:3].abs().max() == 0


# Two sequences with ragged masks: seq 0 has 3 tokens, seq 1 has 1 token (then padding).
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
ADV = torch.tensor([2.0, -1.0])


def settings(**changes) -> LossSettings:
    """The loss these tests state: no KL, a symmetric clip of 0.2, GRPO's aggregation."""
    return LossSettings.default(**{"beta": 0.0, "epsilon_low": 0.2, "epsilon_high": 0.2,
                                   "loss_agg": "grpo", "vllm_is_cap": 0.0, **changes})


def test_first_pass_ratio_one_gives_minus_advantage_for_every_aggregation():
    logp = torch.log(torch.tensor([[0.5, 0.2, 0.1], [0.3, 0.9, 0.9]]))
    # ratio = 1 everywhere: per-token loss = -A -> seq 0: -2 (x3 tokens), seq 1: +1 (x1)
    # grpo: (mean(-2,-2,-2) + mean(+1)) / 2 = (-2 + 1) / 2 = -0.5
    # dapo: (-6 + 1) / 4 tokens = -1.25
    # dr_grpo: (-6 + 1) / (2 seqs x 3 max tokens) = -5/6
    expected = {"grpo": -0.5, "dapo": -1.25, "dr_grpo": -5 / 6}
    for agg, want in expected.items():
        s = settings(loss_agg=agg, max_new_tokens=3)
        loss, stats = grpo_loss(logp, logp.detach(), ADV, MASK, s)
        assert loss.item() == pytest.approx(want)
        assert stats.ratio.item() == pytest.approx(1.0)
        assert stats.clip_low.item() == 0 and stats.clip_high.item() == 0


def test_clipping_by_hand():
    # seq 0 (A = +2): ratios 1.5, 1.0, 0.5 (logp - old = ln ratio); eps_high 0.2 clips 1.5 -> 1.2
    #   tokens: -min(1.5*2, 1.2*2) = -2.4; -min(2, 2) = -2; -min(0.5*2, 0.8*2) = -1.0
    # seq 1 (A = -1): ratio 0.5 -> -min(-0.5, 0.8*-1) = -min(-0.5, -0.8) = 0.8
    # grpo: ((-2.4 - 2 - 1) / 3 + 0.8) / 2 = (-1.8 + 0.8) / 2 = -0.5
    # dapo: (-5.4 + 0.8) / 4 = -1.15
    old = torch.zeros(2, 3)
    logp = torch.log(torch.tensor([[1.5, 1.0, 0.5], [0.5, 1.0, 1.0]]))
    kw = dict(epsilon_low=0.2, epsilon_high=0.2, max_new_tokens=3)
    loss, stats = grpo_loss(logp, old, ADV, MASK, settings(loss_agg="grpo", **kw))
    assert loss.item() == pytest.approx(-0.5)
    loss, stats = grpo_loss(logp, old, ADV, MASK, settings(loss_agg="dapo", **kw))
    assert loss.item() == pytest.approx(-1.15)
    # clip_high: ratio 1.5 > 1.2 with A > 0 -> 1 of 4 tokens; clip_low: ratio 0.5 < 0.8 with A < 0
    # (seq 1) -> 1 of 4. seq 0's 0.5 has A > 0 and does not count as low-clipped.
    assert stats.clip_high.item() == pytest.approx(0.25)
    assert stats.clip_low.item() == pytest.approx(0.25)
    # ratio mean over real tokens: (1.5 + 1 + 0.5 + 0.5) / 4 = 0.875
    assert stats.ratio.item() == pytest.approx(0.875)
    # DAPO clip-higher: eps_high 0.6 no longer clips 1.5 -> token loss -3:
    # dapo: (-3 - 2 - 1 + 0.8) / 4 = -1.3
    s = settings(loss_agg="dapo", epsilon_low=0.2, epsilon_high=0.6)
    loss, stats = grpo_loss(logp, old, ADV, MASK, s)
    assert loss.item() == pytest.approx(-1.3)
    assert stats.clip_high.item() == 0


def test_kl_k3_by_hand_and_zero_when_policy_equals_reference():
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
    kl = settings(beta=0.1, loss_agg="dapo")
    loss0, stats = grpo_loss(logp, logp.detach(), torch.zeros(2), MASK, kl, ref_logp=logp.clone())
    assert stats.kl.item() == 0 and loss0.item() == 0
    # ref prob 0.25 vs policy 0.5 on every token: d = ln(0.25/0.5) = -ln 2
    # k3 = exp(d) - d - 1 = 0.5 + ln 2 - 1 = 0.193147; with A = 0 the loss is beta * k3
    ref = torch.log(torch.full((2, 3), 0.25))
    loss, stats = grpo_loss(logp, logp.detach(), torch.zeros(2), MASK, kl, ref_logp=ref)
    k3 = 0.5 + math.log(2) - 1
    assert stats.kl.item() == pytest.approx(k3)
    assert loss.item() == pytest.approx(0.1 * k3)
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(logp, logp, ADV, MASK, settings(beta=0.1))


def test_global_normalisers_make_micro_batches_sum_to_the_whole():
    torch.manual_seed(0)
    logp = torch.randn(4, 5) * 0.1 - 1
    old = logp + torch.randn(4, 5) * 0.1
    adv = torch.randn(4)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0]],
                        dtype=torch.bool)
    for agg in ("grpo", "dapo", "dr_grpo"):
        s = settings(loss_agg=agg, max_new_tokens=5)
        whole, _ = grpo_loss(logp, old, adv, mask, s)
        kw = dict(num_seqs=4, num_tokens=mask.sum(), num_rows=4)
        parts = sum(grpo_loss(logp[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], s,
                              **kw)[0]
                    for i in (0, 2))
        torch.testing.assert_close(parts, whole)


def test_dr_grpo_divides_by_every_row_of_the_batch_whatever_carries_loss():
    """dr_grpo's normaliser is a constant, rows x max_new_tokens (Dr. GRPO, TRL): rows that
    dynamic sampling or mask_truncated leave out of the loss still count. It counted only the
    rows carrying loss, so the per-token weight changed from step to step (up to 8x)."""
    torch.manual_seed(0)
    logp = torch.randn(4, 5) * 0.1 - 1
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[1:] = False  # one row of four carries loss
    adv = torch.tensor([1.0, -1.0, 0.5, 0.0])
    loss, _ = grpo_loss(logp, logp.detach(), adv, mask, settings(loss_agg="dr_grpo",
                        max_new_tokens=5), num_seqs=1, num_tokens=mask.sum(), num_rows=4)
    torch.testing.assert_close(loss, torch.tensor(-1.0 * 5 / (4 * 5)))


def test_logprobs_and_entropy_of_uniform_logits():
    # a model whose logits are all 0 over 4 tokens: logp = -ln 4, entropy = ln 4 (0 if masked)
    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(3, 4, bias=False)

        def forward(self, idx, prefix, hidden):  # hidden states of zeros: logits of zeros
            return torch.zeros(*idx.shape, 3, requires_grad=True)

    pids, pm = torch.tensor([[1, 2]]), torch.ones(1, 2, dtype=torch.bool)
    cids, cm = torch.tensor([[0, 3]]), torch.tensor([[True, False]])
    logp, ent = completion_logprobs(Flat(), pids, pm, cids, cm, entropy=True)
    torch.testing.assert_close(logp, torch.tensor([[-math.log(4), 0.0]]))
    torch.testing.assert_close(ent, torch.tensor([[math.log(4), 0.0]]))
    assert logp.requires_grad and not ent.requires_grad  # entropy is a metric: no graph


def test_a_padded_position_with_a_very_low_policy_logprob_keeps_the_loss_finite():
    # reference log-prob 0 at padding, policy -95 there: exp(ref - logp) = exp(95) = inf, and
    # inf * 0 (the mask) was NaN in the loss and its gradient
    logp = torch.tensor([[-1.0, -95.0]], requires_grad=True)
    mask = torch.tensor([[True, False]])
    ref = torch.tensor([[-1.2, 0.0]])
    old = torch.tensor([[-1.0, 0.0]])
    for agg in ("grpo", "dapo", "dr_grpo"):
        loss, stats = grpo_loss(logp, old, torch.tensor([1.0]), mask,
                                settings(beta=0.1, loss_agg=agg, max_new_tokens=2),
                                ref_logp=ref)
        logp.grad = None
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all(), agg
        assert logp.grad[0, 1] == 0  # the padded position carries no gradient
        # k3 at the real token: d = -0.2, exp(-0.2) + 0.2 - 1 = 0.018731
        assert stats.kl.item() == pytest.approx(math.exp(-0.2) + 0.2 - 1)


def test_truncated_importance_sampling_by_hand():
    # the engine sampled seq 0's tokens with log-probs 0.7, 0.1, 0.0 below the trainer's
    # (and seq 1's one token 0.5 above): weights exp(0.7) = 2.01 -> cap 2, exp(0.1) = 1.105,
    # 1, and exp(-0.5) = 0.607; masked tokens weigh 1
    old = torch.log(torch.tensor([[0.5, 0.2, 0.1], [0.3, 0.9, 0.9]]))
    engine = old - torch.tensor([[0.7, 0.1, 0.0], [-0.5, 3.0, 3.0]])
    s = settings(loss_agg="dapo", vllm_is_cap=2.0)
    logp = old.clone().requires_grad_()
    loss, stats = grpo_loss(logp, old, ADV, MASK, s, engine_logp=engine)
    # ratio 1: per-token loss -A x weight; dapo: (-2 (2 + 1.10517 + 1) + 1 x 0.60653) / 4
    want = (-2 * (2 + math.exp(0.1) + 1) + math.exp(-0.5)) / 4
    assert loss.item() == pytest.approx(want, rel=1e-6)
    # the mismatch stats: mean |d| = (0.7 + 0.1 + 0 + 0.5) / 4; k3 = e^d - 1 - d per token
    assert stats.engine_diff.item() == pytest.approx(1.3 / 4, rel=1e-6)
    k3 = sum(math.exp(d) - 1 - d for d in (0.7, 0.1, 0.0, -0.5)) / 4
    assert stats.engine_kl.item() == pytest.approx(k3, rel=1e-5)
    # the weights carry no gradient of their own: d loss / d logp = -A w / tokens
    loss.backward()
    torch.testing.assert_close(logp.grad[0], torch.tensor([-4.0, -2 * math.exp(0.1), -2]) / 4)


@pytest.mark.parametrize("mode, w0, w1", [
    # the same tokens (d = 0.7, 0.1, 0.0 | -0.5), cap 2: a token's ratio, or the sequence's
    # (row 0: e^0.8 = 2.23, row 1: e^-0.5), truncated to the cap or masked past it
    ("token_truncate", [2.0, math.exp(0.1), 1.0], math.exp(-0.5)),
    ("token_mask", [0.0, math.exp(0.1), 1.0], math.exp(-0.5)),
    ("sequence_truncate", [2.0, 2.0, 2.0], math.exp(-0.5)),
    ("sequence_mask", [0.0, 0.0, 0.0], math.exp(-0.5)),
])
def test_every_importance_sampling_mode_by_hand(mode, w0, w1):
    old = torch.log(torch.tensor([[0.5, 0.2, 0.1], [0.3, 0.9, 0.9]]))
    engine = old - torch.tensor([[0.7, 0.1, 0.0], [-0.5, 3.0, 3.0]])
    logp = old.clone().requires_grad_()
    loss, _ = grpo_loss(logp, old, ADV, MASK, settings(loss_agg="dapo", vllm_is_cap=2.0,
                                                       vllm_is_mode=mode), engine_logp=engine)
    assert loss.item() == pytest.approx((-2 * sum(w0) + w1) / 4, rel=1e-6)
    loss.backward()  # the weights carry no gradient of their own
    torch.testing.assert_close(logp.grad[0], torch.tensor([-2 * w for w in w0]) / 4)


def test_off_policy_sequence_masking_drops_drifted_rows_of_negative_advantage():
    # the sampler's log-probs 0.5 above the policy's on every token: a drift of 0.5 per token
    logp = torch.log(torch.tensor([[0.5, 0.2, 0.1], [0.3, 0.9, 0.9]])).requires_grad_()
    sampled = logp.detach() + 0.5
    plain, _ = grpo_loss(logp, logp.detach(), ADV, MASK, settings(loss_agg="dapo"))
    for threshold, kept in ((0.4, [1.0, 0.0]), (0.6, [1.0, 1.0]), (0.0, [1.0, 1.0])):
        s = settings(loss_agg="dapo", off_policy_mask=threshold)
        loss, _ = grpo_loss(logp, logp.detach(), ADV, MASK, s, engine_logp=sampled)
        # ratio 1: row 0 (A = 2) -2 per token, row 1 (A = -1) +1, over the batch's 4 tokens
        assert loss.item() == pytest.approx((-2 * 3 * kept[0] + 1 * kept[1]) / 4), threshold
    assert plain.item() == pytest.approx((-6 + 1) / 4)


def test_top_entropy_masking_keeps_the_policy_term_of_the_highest_entropy_tokens_alone():
    # entropies of the 4 masked tokens: 0.1 0.9 0.5 | 0.7 (the padding's 5.0 is no token's);
    # quantile 0.5 keeps the top half: threshold = torch.quantile([.1 .5 .7 .9], 0.5) = 0.6,
    # so the tokens of 0.9 (row 0) and 0.7 (row 1)
    from mini_grpo.grpo import high_entropy_mask
    ent = torch.tensor([[0.1, 0.9, 0.5], [0.7, 5.0, 5.0]])
    assert high_entropy_mask(ent, MASK, 0.5).tolist() == [[False, True, False],
                                                          [True, False, False]]
    assert high_entropy_mask(ent, MASK, 1.0) is None
    assert high_entropy_mask(ent, MASK, 0.25).tolist() == [[False, True, False],
                                                           [False, False, False]]
    logp = torch.log(torch.tensor([[0.5, 0.2, 0.1], [0.3, 0.9, 0.9]])).requires_grad_()
    s = settings(loss_agg="dapo", top_entropy_quantile=0.5)
    loss, _ = grpo_loss(logp, logp.detach(), ADV, MASK, s, entropy=ent)
    # ratio 1: -A on the kept tokens, over all 4 tokens of the batch: (-2 + 1) / 4
    assert loss.item() == pytest.approx(-0.25)
    loss.backward()
    # d/dlogp of -A r / 4 at r = 1 is -A / 4 on a kept token, 0 on the others
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5, 0.0], [0.25, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="entropy"):
        grpo_loss(logp, logp.detach(), ADV, MASK, s)
    # the KL term is not masked: beta's term stays on every token
    ref = logp.detach() - 0.1
    with_kl, _ = grpo_loss(logp, logp.detach(), ADV, MASK, s.__class__(**{
        **s.__dict__, "beta": 1.0}), entropy=ent, ref_logp=ref)
    k3 = math.exp(-0.1) + 0.1 - 1  # d = ref - logp = -0.1 on each of the 4 tokens
    assert with_kl.item() == pytest.approx(-0.25 + k3, rel=1e-5)


def test_kl_in_the_reward_penalises_each_row_by_its_summed_kl_and_leaves_the_loss_without():
    from conftest import make_rollout, tiny

    from mini_grpo.fields import ConfigError
    from mini_grpo.grpo import kl_reward_penalty
    from mini_grpo.trajectory import Trajectory

    sampled = torch.log(torch.tensor([[0.5, 0.2, 0.1], [0.3, 0.9, 0.9]]))
    ref = sampled + torch.tensor([[0.1, -0.2, 0.3], [0.4, 7.0, 7.0]])  # padding: no token's
    k3 = lambda d: math.exp(d) - d - 1  # noqa: E731
    # beta 0.5 x the sum over each row's tokens of k3(ref - sampled); k1 is -(ref - sampled)
    want = [0.5 * (k3(0.1) + k3(-0.2) + k3(0.3)), 0.5 * k3(0.4)]
    torch.testing.assert_close(kl_reward_penalty(sampled, ref, MASK, 0.5, "k3"),
                               torch.tensor(want))
    torch.testing.assert_close(kl_reward_penalty(sampled, ref, MASK, 1.0, "k1"),
                               torch.tensor([-0.2, -0.4]))
    # in the loss: measured, not added (the advantages hold it)
    logp = sampled.clone().requires_grad_()
    plain, _ = grpo_loss(logp, sampled, ADV, MASK, settings(loss_agg="dapo"))
    loss, st = grpo_loss(logp, sampled, ADV, MASK, settings(loss_agg="dapo", beta=0.5,
                                                            kl_in_reward=True), ref_logp=ref)
    assert loss.item() == plain.item()
    assert st.kl.item() == pytest.approx((k3(0.1) + k3(-0.2) + k3(0.3) + k3(0.4)) / 4, rel=1e-5)
    # the trajectory's advantages are of the penalised rewards; its rewards stay the task's:
    # group 2's equal rewards (0.5, 0.5) less (0.2, 0) -> (0.3, 0.5), centred -> -0.1, +0.1
    cmask = torch.ones(4, 2, dtype=torch.bool)
    r = make_rollout(torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1, dtype=torch.bool),
                     torch.zeros(4, 2, dtype=torch.long), cmask)
    cfg = tiny(None, group_size=2, beta=0.5, kl_in_reward=True, scale_rewards="none")
    t = Trajectory.of(r, torch.tensor([1.0, 0.0, 0.5, 0.5]), cfg)
    p = t.penalised(r, torch.tensor([0.0, 0.0, 0.2, 0.0]), cfg)
    torch.testing.assert_close(p.advantages, torch.tensor([0.5, -0.5, -0.1, 0.1]))
    assert p.rewards.tolist() == [1.0, 0.0, 0.5, 0.5] and p.zero_spread.tolist() == [False, True]
    with pytest.raises(ConfigError, match="kl_in_reward"):
        tiny(None, beta=0.0, kl_in_reward=True)


def test_without_a_cap_the_engine_is_measured_but_not_corrected():
    old = torch.log(torch.tensor([[0.5, 0.2, 0.1], [0.3, 0.9, 0.9]]))
    engine = old - 0.3
    plain, _ = grpo_loss(old, old, ADV, MASK, settings(loss_agg="dapo"))
    loss, stats = grpo_loss(old, old, ADV, MASK, settings(loss_agg="dapo"), engine_logp=engine)
    assert loss.item() == plain.item()
    assert stats.engine_diff.item() == pytest.approx(0.3, rel=1e-5)


def test_only_the_vllm_engine_is_corrected():
    from conftest import tiny
    assert LossSettings.of(tiny(None)).vllm_is_cap == 0.0  # native: the weight is exactly 1
    vllm = tiny(None, rollout_engine="vllm", vllm_is_cap=3, init_from="some/model")
    assert LossSettings.of(vllm).vllm_is_cap == 3.0


def test_loss_settings_take_the_configs_defaults_and_have_none_of_their_own():
    import dataclasses

    from mini_grpo.config import GRPOConfig
    assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(LossSettings))
    cfg = GRPOConfig()
    s = LossSettings.default()
    assert (s.beta, s.epsilon_low, s.epsilon_high, s.loss_agg) == (
        cfg.beta, cfg.epsilon_low, cfg.epsilon_high, cfg.loss_agg)
    assert LossSettings.default(beta=0.5).beta == 0.5


def test_the_batch_std_of_offset_rewards_is_exact():
    """scale_rewards: batch divides by the global batch's std, from moments summed in one
    all-reduce: in float32, rewards of 100 + U(0, 0.1) got a std of 0 and advantages of ~760."""
    from conftest import make_rollout, tiny

    from mini_grpo.trajectory import Trajectory

    g = torch.Generator().manual_seed(0)
    B, G = 128, 8
    ones = torch.ones(B, 3, dtype=torch.bool)
    r = make_rollout(torch.ones(B, 2, dtype=torch.long), torch.ones(B, 2, dtype=torch.bool),
                     torch.ones(B, 3, dtype=torch.long), ones)
    cfg = tiny(None, group_size=G, scale_rewards="batch", beta=0.0)
    for base, spread in [(100.0, 0.1), (1000.0, 1.0)]:
        rewards = base + spread * torch.rand(B, generator=g)
        t = Trajectory.of(r, rewards, cfg)
        exact = rewards.double().std(unbiased=False)
        assert t.reward_std.item() == pytest.approx(exact.item(), rel=1e-5)
        want = group_advantages(rewards.double(), G, "batch", batch_std=exact)
        torch.testing.assert_close(t.advantages, want, rtol=1e-3, atol=1e-3)


def test_the_batch_statistics_come_from_the_function_the_record_is_given():
    """Trajectory.of's normalisers are `stats`' (global_stats: one all-reduce): two ranks
    holding the same rows normalise as one process holding both, so the moments stay and
    the counts double; the advantages are the same."""
    from conftest import make_rollout, tiny

    from mini_grpo.trajectory import Trajectory, global_stats, local_stats

    B, G = 4, 2
    r = make_rollout(torch.zeros(B, 1, dtype=torch.long), torch.ones(B, 1, dtype=torch.bool),
                     torch.zeros(B, 3, dtype=torch.long),
                     torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]]).bool())
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0])
    cfg = tiny(None, group_size=G, scale_rewards="batch", beta=0.0)
    calls = []

    def two_ranks(rw, g, seqs, tokens):
        calls.append((rw.tolist(), g, int(seqs), int(tokens)))
        return global_stats(rw, g, seqs, tokens, reduce=lambda t: t * 2)

    one = Trajectory.of(r, rewards, cfg, stats=local_stats)
    two = Trajectory.of(r, rewards, cfg, stats=two_ranks)
    assert calls == [([1.0, 0.0, 0.5, 2.0], 2, 4, 9)]  # 4 rows carry loss, 9 tokens
    assert (one.num_rows.item(), one.num_seqs.item(), one.num_tokens.item()) == (4, 4, 9)
    assert (two.num_rows.item(), two.num_seqs.item(), two.num_tokens.item()) == (8, 8, 18)
    assert one.reward_mean.item() == two.reward_mean.item() == pytest.approx(0.875)
    assert one.reward_std.item() == pytest.approx(rewards.std(unbiased=False).item())
    torch.testing.assert_close(one.advantages, two.advantages)
    # the default is the collective: in a single process, the same as this rank's alone
    torch.testing.assert_close(Trajectory.of(r, rewards, cfg).advantages, one.advantages)
