"""Length handling: mask_truncated leaves rows cut off at max_new_tokens out of the loss (DAPO),
overlong_penalty scores lengths sampling recorded, the step logs the truncated fraction, and an
SFT row longer than block_size is refused before any work."""

import json
import os
from dataclasses import replace

import pytest
import torch
from conftest import metrics, tiny
from ddp_grad_worker import G, make_batch

from mini_grpo.config import ConfigError, load_config
from mini_grpo.data import batch_indices
from mini_grpo.engines.base import Rollout
from mini_grpo.job import STAGES, train
from mini_grpo.limits import SFT_MODES, check_sft_lengths
from mini_grpo.models import GPT, GPTConfig
from mini_grpo.outputs import RUN_MARKER
from mini_grpo.rewards.text import overlong_penalty
from mini_grpo.tasks import Example
from mini_grpo.tokenizer import CharTokenizer
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
    r = replace(r, finished=finished)
    traj, grads = gradient(r, rewards, ref_lp, mask_truncated=True)
    assert not traj.loss_mask[[1, 6, 7]].any() and traj.loss_mask[0].any()
    assert traj.completion_mask[[1, 6, 7]].any()  # still attended: only the loss leaves them
    assert traj.num_seqs.item() == len(rewards) - 3
    # anything the truncated rows hold changes nothing
    ids = r.completion_ids.clone()
    ids[[1, 6, 7]] = torch.randint(4, 24, ids[[1, 6, 7]].shape)
    other = replace(r, completion_ids=ids)
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
    r = replace(r, finished=torch.zeros_like(r.finished))
    cfg = load_config(None, {"mask_truncated": "true", "group_size": G}, env={})
    traj = Trajectory.of(r, rewards, cfg)
    assert not traj.loss_mask.any()
    assert [(c.rows.tolist(), c.width) for c in traj.plan] == [([0], 1)]
    assert int(r.completion_mask[0].sum()) == 10


def test_an_sft_row_longer_than_the_block_is_refused_naming_its_line(tmp_path):
    """block_size 100, max_new_tokens 40: the prompts fit, but SFT reads prompt + target.
    Row 4's 'q3' (BOS + 2 characters) and a target of 97 characters + EOS are 101 tokens, 100
    positions read: it trains; one character more was an IndexError deep in the model, and is
    now refused at setup naming the file's line and the lengths, before any work."""
    def run(long: int):
        data = tmp_path / f"rows{long}.jsonl"
        data.write_text("".join(json.dumps({"prompt": f"q{i}", "target": "x" * (
            long if i == 3 else 5)}) + "\n" for i in range(40)))
        out = tmp_path / f"run{long}"
        train(tiny(out, task="jsonl", data_path=data, mode="sft", sft_steps=3, block_size=100,
                   max_new_tokens=40, num_eval=4))  # 3 steps of 16 read all 36 train rows
        return data, out

    run(97)
    with pytest.raises(ConfigError) as e:
        run(98)
    data, out = tmp_path / "rows98.jsonl", tmp_path / "run98"
    assert str(e.value) == (
        f"block_size: 100 is too small for SFT on {data}:4 (prompt 'q3'): its prompt (3 "
        f"tokens) and target (99 tokens, EOS included) need 101 positions (the last token is "
        f"predicted, not read)")
    assert os.listdir(out) == [RUN_MARKER]


def test_only_the_rows_sft_reads_are_checked():
    """SFT reads sft_steps x sft_batch_size rows in batch_indices' order: a long row it never
    reaches costs nothing (and is not encoded); one it reads is refused. Without an SFT stage
    nothing is checked."""
    cfg = tiny(mode="sft", sft_steps=1, sft_batch_size=1, block_size=20, max_new_tokens=4)
    tok = CharTokenizer("abx")
    read = batch_indices(2, 1, 0, cfg.seed)[0]
    rows = [Example("a", "b"), Example("a", "b")]
    rows[1 - read] = Example("a", "x" * 50)
    check_sft_lengths(cfg, tok, rows)
    rows[read] = Example("a", "x" * 50)
    with pytest.raises(ConfigError, match=f"SFT on training row {read + 1} "):
        check_sft_lengths(cfg, tok, rows)
    check_sft_lengths(tiny(mode="grpo", block_size=20, max_new_tokens=4), tok, rows)
    assert set(SFT_MODES) == {mode for mode, stages in STAGES.items() if "sft" in stages}
