"""Length handling: mask_truncated leaves rows cut off at max_new_tokens out of the loss (DAPO),
overlong_penalty scores lengths sampling recorded, and the step logs the truncated fraction."""

import torch
from conftest import metrics, tiny
from ddp_grad_worker import G, make_batch

from mini_grpo.config import load_config
from mini_grpo.engines.base import Rollout
from mini_grpo.job import train
from mini_grpo.models import GPT, GPTConfig
from mini_grpo.rewards.text import overlong_penalty
from mini_grpo.trainer import policy_pass
from mini_grpo.trajectory import Trajectory


def gradient(r: Rollout, rewards, ref_lp, mask_truncated: bool):
    cfg = load_config(None, {"mask_truncated": str(mask_truncated), "group_size": G,
                             "beta": 0.1, "use_amp": "false", "micro_batch_size": 3}, env={})
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=24, block_size=64, n_layer=2, n_head=2, n_embd=32))
    traj = Trajectory.of(r, rewards, cfg).replace(ref_logp=ref_lp)
    policy_pass(model, traj, cfg)
    return traj, [p.grad.clone() for p in model.parameters()]


def test_truncated_rows_carry_no_loss():
    r, rewards, ref_lp = make_batch(seed=1)
    finished = torch.ones_like(r.finished)
    finished[[1, 6, 7]] = False  # hand-picked rows that hit max_new_tokens without EOS
    r = Rollout(r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, r.logprobs,
                finished, sampling=r.sampling)
    traj, grads = gradient(r, rewards, ref_lp, mask_truncated=True)
    assert not traj.loss_mask[[1, 6, 7]].any() and traj.loss_mask[0].any()
    assert traj.completion_mask[[1, 6, 7]].any()  # still attended: only the loss leaves them
    assert traj.num_seqs.item() == len(rewards) - 3
    # anything the truncated rows hold changes nothing
    ids = r.completion_ids.clone()
    ids[[1, 6, 7]] = torch.randint(4, 24, ids[[1, 6, 7]].shape)
    other = Rollout(r.prompt_ids, r.prompt_mask, ids, r.completion_mask, r.logprobs, finished,
                    sampling=r.sampling)
    _, same = gradient(other, rewards, ref_lp, mask_truncated=True)
    assert all(torch.equal(a, b) for a, b in zip(grads, same))
    # without the switch they do count
    _, counted = gradient(other, rewards, ref_lp, mask_truncated=False)
    _, before = gradient(r, rewards, ref_lp, mask_truncated=False)
    assert any(not torch.equal(a, b) for a, b in zip(counted, before))


def test_overlong_penalty_is_dapos_soft_punishment():
    metas = [{"completion_tokens": n, "max_new_tokens": 100} for n in (10, 80, 90, 100)]
    metas.append({})  # a trivial baseline's answer: no lengths, no penalty
    assert overlong_penalty([], [""] * 5, [], metas) == [0.0, 0.0, -0.5, -1.0, 0.0]


def test_the_step_logs_the_truncated_fraction(tmp_path):
    train(tiny(tmp_path, max_steps=1, max_new_tokens=4, mask_truncated=True,
               rewards=[{"name": "levenshtein"}, {"name": "overlong_penalty", "weight": 0.1}]))
    row = next(m for m in metrics(tmp_path) if "truncated_frac" in m)
    # 4 tokens cannot hold a FEN: nearly every row is cut off, and penalised by the plugin
    assert row["truncated_frac"] > 0.5
    assert row["reward/overlong_penalty/mean"] < -0.5


def test_a_step_whose_rows_all_carry_no_loss_still_runs_one_cheap_pass():
    """Every row cut off under mask_truncated: one row is kept so that every rank runs a
    backward, and it costs one completion column, not its whole completion."""
    r, rewards, _ = make_batch(seed=5)  # row 0: 10 tokens
    r = Rollout(r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, r.logprobs,
                torch.zeros_like(r.finished), sampling=r.sampling)
    cfg = load_config(None, {"mask_truncated": "true", "group_size": G}, env={})
    traj = Trajectory.of(r, rewards, cfg)
    assert not traj.loss_mask.any()
    assert [(c.rows.tolist(), c.width) for c in traj.plan] == [([0], 1)]
    assert int(r.completion_mask[0].sum()) == 10
