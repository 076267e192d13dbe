"""The registered policy losses (losses.py) against their formulas written out by hand on a
small case, their gradients included; choosing one in the config, and a user's own from a
file."""

import math

import pytest
import torch
from conftest import metrics, tiny

from mini_grpo.config import ConfigError
from mini_grpo.grpo import LossSettings, grpo_loss
from mini_grpo.losses import POLICY_LOSSES, PolicyInputs, PolicyTerms, policy_terms

EL, EH, C, TP, TN = 0.2, 0.28, 3.0, 1.0, 1.05
# two rows of two tokens: row 0 has A = +1, row 1 has A = -1; log-ratios d = logp - old
D = [[0.1, 0.5], [-0.5, 2.0]]
A = [1.0, -1.0]
OLD = [[-1.0, -2.0], [-1.5, -3.0]]


def case(name):
    s = LossSettings.default(epsilon_low=EL, epsilon_high=EH, dual_clip_c=C, sapo_tau_pos=TP,
                             sapo_tau_neg=TN, policy_loss=name)
    old = torch.tensor(OLD, dtype=torch.float64)
    logp = (old + torch.tensor(D, dtype=torch.float64)).requires_grad_()
    x = PolicyInputs(logp, old, torch.tensor(A, dtype=torch.float64)[:, None],
                     torch.ones(2, 2, dtype=torch.bool), s)
    t = policy_terms(x)
    t.per_token.sum().backward()
    return t, logp.grad


def clip(r):
    return min(max(r, 1 - EL), 1 + EH)


def ppo(r, a):  # value and d/dlogp (= d/dr * r) of -min(r a, clip(r) a)
    unclipped = r * a <= clip(r) * a
    return -min(r * a, clip(r) * a), (-a * r if unclipped else 0.0)


def by_hand(name, i, j):
    """(loss, gradient w.r.t. logp) of token j of row i."""
    a, r = A[i], math.exp(D[i][j])
    if name == "grpo":
        return ppo(r, a)
    if name == "dual_clip":
        v, g = ppo(r, a)
        return (C * -a, 0.0) if a < 0 and v > C * -a else (v, g)
    if name == "gspo":  # the sequence's ratio, each token's gradient through its own log-prob
        return ppo(math.exp(sum(D[i]) / 2), a)
    if name == "cispo":
        w = min(r, 1 + EH)
        return -w * a * (OLD[i][j] + D[i][j]), -w * a
    if name == "sapo":
        tau = TP if a > 0 else TN
        z = 1 / (1 + math.exp(-tau * (r - 1)))
        return -z * 4 / tau * a, -4 * a * z * (1 - z) * r
    raise KeyError(name)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_policy_loss_and_its_gradient_by_hand(name):
    t, grad = case(name)
    for i in range(2):
        for j in range(2):
            value, g = by_hand(name, i, j)
            assert t.per_token[i, j].item() == pytest.approx(value, rel=1e-9), (i, j)
            assert grad[i, j].item() == pytest.approx(g, rel=1e-9, abs=1e-12), (i, j)


def test_the_clip_statistics_count_the_tokens_each_loss_cut():
    t, _ = case("grpo")  # r = e^0.5 > 1.28 with A > 0; e^2 with A < 0 is not cut by the clip
    assert t.clipped_high.tolist() == [[False, True], [False, False]]
    assert t.clipped_low.tolist() == [[False, False], [True, False]]  # e^-0.5 < 0.8, A < 0
    d, _ = case("dual_clip")  # and dual clip bounds e^2's loss at 3
    assert d.clipped_low.tolist() == [[False, False], [True, True]]


def test_the_loss_of_a_batch_takes_the_chosen_policy_loss():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.2, -1.9]])
    mask = torch.ones(1, 2)
    for name in POLICY_LOSSES:
        s = LossSettings.default(beta=0.0, policy_loss=name, loss_agg="dapo")
        loss, _ = grpo_loss(logp, old, torch.tensor([0.5]), mask, s)
        want = policy_terms(PolicyInputs(logp, old, torch.tensor([[0.5]]), mask.bool(), s))
        assert loss.item() == pytest.approx(want.per_token.mean().item()), name


def test_a_policy_loss_is_chosen_in_the_config_and_a_bad_name_is_one_line():
    assert tiny(None, policy_loss="sapo", sapo_tau_neg=2.0).sapo_tau_neg == 2.0
    with pytest.raises(ConfigError, match=r"policy_loss: unknown loss 'ppo2' \(available: "
                                          r"grpo, dual_clip, gspo, cispo, sapo"):
        tiny(None, policy_loss="ppo2")
    with pytest.raises(ConfigError, match="dual_clip_c"):
        tiny(None, dual_clip_c=0.5)


MINE = '''
from mini_grpo.losses import PolicyTerms

def reinforce(x):
    """Plain REINFORCE: -A log pi, no ratio, nothing cut."""
    zero = x.keep & False
    return PolicyTerms(-x.adv * x.logp, (x.logp - x.old_logp).exp().detach(), zero, zero)

def bare(x):
    return -x.adv * x.logp
'''


def test_a_users_own_policy_loss_from_a_file_trains_and_a_wrong_one_is_one_line(
        tmp_path, monkeypatch):
    from mini_grpo.job import train

    (tmp_path / "my_loss.py").write_text(MINE)
    monkeypatch.syspath_prepend(str(tmp_path))
    train(tiny(tmp_path / "run", policy_loss="my_loss:reinforce", max_steps=2,
               eval_every=100, save_every=100))
    assert [r["step"] for r in metrics(tmp_path / "run") if "loss" in r] == [1, 2]
    s = LossSettings.default(policy_loss="my_loss:bare")
    with pytest.raises(ConfigError, match="policy_loss 'my_loss:bare': must return a "
                                          r"grpo.PolicyTerms of \[1, 2\] tensors, got Tensor"):
        policy_terms(PolicyInputs(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 1),
                                  torch.ones(1, 2, dtype=torch.bool), s))
    assert isinstance(policy_terms(PolicyInputs(
        torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 1),
        torch.ones(1, 2, dtype=torch.bool), LossSettings.default())), PolicyTerms)
