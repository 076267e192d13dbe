"""The registered advantage and KL estimators (advantages.py, grpo.py) against their formulas
written out by hand on small cases, the KL terms' gradients included; selecting them from the
config, and a user's own advantage estimator from a file."""

import math

import pytest
import torch
from conftest import metrics, tiny

from mini_grpo.advantages import ADVANTAGES, AdvantageInputs, advantages
from mini_grpo.config import ConfigError
from mini_grpo.grpo import KL_ESTIMATORS, LossSettings, grpo_loss

# two groups of three: [1, 0, 0] (mean 1/3) and [2, 2, 5] (mean 3)
R = torch.tensor([[1.0, 0.0, 0.0], [2.0, 2.0, 5.0]])
MEAN = 10 / 6  # of all six
STD = math.sqrt((1 + 0 + 0 + 4 + 4 + 25) / 6 - MEAN**2)
# r - group mean: [2/3, -1/3, -1/3], [-1, -1, 2]; their mean square over the six
CENTERED_STD = math.sqrt((4 / 9 + 1 / 9 + 1 / 9 + 1 + 1 + 4) / 6)


def inputs(scale="group", eps=0.0):
    return AdvantageInputs(R, torch.tensor(MEAN), torch.tensor(STD),
                           torch.tensor(CENTERED_STD), scale, eps)


def test_every_advantage_estimator_by_hand():
    c = [[2 / 3, -1 / 3, -1 / 3], [-1.0, -1.0, 2.0]]
    g1, g2 = math.sqrt(2 / 9), math.sqrt(2.0)  # the groups' population stds
    want = {
        "grpo": [[x / g1 for x in c[0]], [x / g2 for x in c[1]]],
        "dr_grpo": c,
        # r_i - mean of the other two: 1 - 0, 0 - 1/2, ...; 2 - 3.5, 2 - 3.5, 5 - 2
        "rloo": [[1.0, -0.5, -0.5], [-1.5, -1.5, 3.0]],
        "reinforce_pp": [[(x - MEAN) / STD for x in row] for row in R.tolist()],
        "reinforce_pp_baseline": [[x / CENTERED_STD for x in row] for row in c],
    }
    assert set(want) == set(ADVANTAGES)
    for name, w in want.items():
        got = advantages(name, inputs())
        assert torch.allclose(got, torch.tensor(w), atol=1e-6), name
    # grpo's scale_rewards: by the batch's std, or none (then it is dr_grpo's)
    assert torch.allclose(advantages("grpo", inputs("batch")), torch.tensor(c) / STD)
    assert torch.equal(advantages("grpo", inputs("none")), advantages("dr_grpo", inputs()))


def test_a_zero_spread_group_gets_no_signal_from_a_group_baseline():
    flat = AdvantageInputs(torch.tensor([[3.0, 3.0], [0.0, 1.0]]), torch.tensor(1.75),
                           torch.tensor(1.3), torch.tensor(0.25), "group", 1e-4)
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
        assert advantages(name, flat)[0].tolist() == [0.0, 0.0], name
    assert advantages("reinforce_pp", flat)[0].tolist() != [0.0, 0.0]  # no group baseline


# d = log ref - log pi at three tokens
D = torch.tensor([0.5, -2.0, 30.0])


@pytest.mark.parametrize("name, value, grad", [
    # KL(pi || ref) per token as a function of log pi (= log ref - d); grad w.r.t. log pi
    ("k1", lambda d: -d, lambda d: torch.ones_like(d)),
    ("k2", lambda d: d**2 / 2, lambda d: -d),
    ("k3", lambda d: torch.exp(d) - d - 1, lambda d: 1 - torch.exp(d)),
    ("low_var_kl", lambda d: (torch.exp(d) - d - 1).clamp(-10, 10),
     lambda d: torch.where((torch.exp(d) - d - 1).abs() < 10, 1 - torch.exp(d), 0.0)),
])
def test_every_kl_estimator_and_its_gradient_by_hand(name, value, grad):
    ref = torch.zeros(3, dtype=torch.float64)
    logp = (ref - D.double()).requires_grad_()
    kl = KL_ESTIMATORS[name](ref - logp)
    assert torch.allclose(kl, value(D.double()))
    kl.sum().backward()
    assert torch.allclose(logp.grad, grad(D.double()))
    assert KL_ESTIMATORS[name](torch.zeros(2)).tolist() == [0.0, 0.0]  # masked: nothing


def test_the_loss_takes_the_chosen_kl_estimator():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]])
    mask = torch.ones(1, 2)
    for name in KL_ESTIMATORS:
        s = LossSettings.default(beta=1.0, kl_estimator=name, loss_agg="dapo")
        loss, st = grpo_loss(logp, logp.detach(), torch.zeros(1), mask, s, ref_logp=ref)
        want = KL_ESTIMATORS[name](ref - logp.detach()).mean()  # advantage 0: the KL alone
        assert loss.item() == pytest.approx(want.item()) and st.kl.item() == \
            pytest.approx(want.item()), name


def test_the_estimators_are_chosen_in_the_config_and_a_bad_name_is_one_line():
    assert tiny(None, advantage_estimator="rloo", kl_estimator="k2").kl_estimator == "k2"
    with pytest.raises(ConfigError, match="advantage_estimator: unknown estimator 'ppo' "
                                          r"\(available: grpo, dr_grpo, rloo"):
        tiny(None, advantage_estimator="ppo")
    with pytest.raises(ConfigError, match="kl_estimator"):
        tiny(None, kl_estimator="k4")


MINE = '''
import torch

def centered(x):
    """r - group mean, doubled: a user's own estimator."""
    return 2 * (x.rewards - x.rewards.mean(dim=1, keepdim=True))

def flat(x):
    return x.rewards.reshape(-1)
'''


def test_a_users_own_estimator_from_a_file_trains_and_a_wrong_one_is_one_line(tmp_path,
                                                                            monkeypatch):
    from mini_grpo.job import train

    (tmp_path / "my_adv.py").write_text(MINE)
    monkeypatch.syspath_prepend(str(tmp_path))
    train(tiny(tmp_path / "run", advantage_estimator="my_adv:centered", max_steps=2,
               eval_every=100, save_every=100, kl_estimator="low_var_kl"))
    assert [r["step"] for r in metrics(tmp_path / "run") if "loss" in r] == [1, 2]
    with pytest.raises(ConfigError, match=r"advantage_estimator 'my_adv:flat': must return a "
                                          r"tensor of the rewards' shape \[2, 4\], got \[8\]"):
        advantages("my_adv:flat", AdvantageInputs(torch.zeros(2, 4), *[torch.zeros(())] * 3,
                                                  "group", 1e-4))
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module'"):
        train(tiny(tmp_path / "run2", advantage_estimator="no_such_module:fn", max_steps=1))


def test_kl_in_the_reward_and_top_entropy_masking_train(tmp_path):
    """A run with beta's KL in the rewards (kl_in_reward) and the loss on the top half of the
    tokens by entropy: both steps logged, finite; the KL measured once the policy moved."""
    from mini_grpo.job import train

    train(tiny(tmp_path / "run", beta=0.5, kl_in_reward=True, top_entropy_quantile=0.5,
               max_steps=2, eval_every=100, save_every=100))
    rows = [r for r in metrics(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["kl"]) for r in rows)
    assert rows[0]["kl"] == 0.0 < rows[1]["kl"]  # the reference is step 1's policy


def test_dynamic_sampling_keeps_the_groups_with_signal_first():
    """signal_first by hand; Rollout.take and ScoreResult.take pick the same rows."""
    import numpy as np
    from conftest import make_rollout

    from mini_grpo.advantages import signal_first
    from mini_grpo.scoring import ScoreResult

    # groups of 2: (1, 1) none, (0, 1) signal, (0, 0) none, (1, 0) signal
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    assert signal_first(rewards, 2, 2) == [2, 3, 6, 7]
    assert signal_first(rewards, 2, 3) == [0, 1, 2, 3, 6, 7]  # short: the first zero-spread
    assert signal_first(rewards, 2, 1) == [2, 3]
    ids = torch.arange(8)[:, None]
    ones = torch.ones(8, 1, dtype=torch.bool)
    r = make_rollout(ids, ones, ids + 10, ones, ids.float(), texts=[str(i) for i in range(8)])
    t = r.take([2, 3, 6, 7])
    assert t.prompt_ids.view(-1).tolist() == [2, 3, 6, 7] and t.texts == ["2", "3", "6", "7"]
    assert t.completion_ids.view(-1).tolist() == [12, 13, 16, 17] and t.sampling is r.sampling
    res = ScoreResult(rewards.numpy().astype(np.float64), {"a": np.arange(8.0)}, {"x": 1.0})
    kept = res.take([2, 3, 6, 7])
    assert kept.total.tolist() == [0.0, 1.0, 1.0, 0.0]
    assert kept.columns["a"].tolist() == [2, 3, 6, 7]
    with pytest.raises(ConfigError, match="dynamic_sampling_factor: 3 .* needs dynamic_samp"):
        tiny(None, dynamic_sampling_factor=3)


def test_dynamic_sampling_refills_the_batch_with_groups_that_carry_signal(tmp_path,
                                                                          monkeypatch):
    """A run drawing 3x the prompts keeps prompts_per_step groups, those with signal first:
    the kept zero-spread groups are exactly those the signal ones could not fill. The reward
    is binary (an answer of even length), so some groups of 4 have none."""
    from mini_grpo.job import train

    (tmp_path / "parity_reward.py").write_text(
        "def even(prompts, completions, targets, metas):\n"
        "    return [float(len(c) % 2 == 0) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = tiny(tmp_path / "run", dynamic_sampling=True, dynamic_sampling_factor=3, max_steps=3,
               eval_every=100, save_every=100, rewards=[{"name": "parity_reward:even"}])
    train(cfg)
    rows = [r for r in metrics(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    P = cfg.prompts_per_step
    for r in rows:
        signal = round((1 - r["zero_spread_frac/sampled"]) * 3 * P)
        assert round(r["zero_spread_frac"] * P) == max(0, P - signal)
        assert 0 <= r["reward/sampled_mean"] <= 1 and math.isfinite(r["loss"])
    assert any(0 < r["zero_spread_frac/sampled"] < 1 for r in rows), "no step tells anything"
