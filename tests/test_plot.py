"""plot.py: the reward curve from metrics.jsonl, resumed rows and torn lines included."""

import json

import pytest

from mini_grpo.plot import plot_rewards, read_metrics


def test_reads_train_and_eval_rewards_and_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"step": 0, "eval_greedy/reward": 0.1, "eval_greedy/reward_se": 0.01},
            {"step": 1, "reward/mean": 0.2}, {"step": 2, "reward/mean": 0.3},
            {"step": 2, "reward/mean": 0.35},  # the same step again, after a resume
            {"step": 2, "event": "resumed"}, {"sft/step": 1, "sft/loss": 2.0},
            {"step": 2, "eval_sampled/reward": 0.25, "eval_sampled/reward_se": 0.02}]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "reward/me')
    train, evals = read_metrics(tmp_path / "metrics.jsonl")
    assert train == {1: 0.2, 2: 0.35}
    assert evals == {"greedy": {0: (0.1, 0.01)}, "sampled": {2: (0.25, 0.02)}}
    png = plot_rewards(tmp_path)
    assert png == tmp_path / "reward.png" and png.read_bytes()[:4] == b"\x89PNG"
    assert plot_rewards(tmp_path / "missing") is None


def test_a_multi_turn_run_draws_its_tool_calls_too(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"step": s, "reward/mean": 0.1 * s, "tools/calls": 0.5 + 0.1 * s} for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    calls: dict = {}
    train, _ = read_metrics(tmp_path / "metrics.jsonl", calls)
    assert train == {1: 0.1, 2: 0.2} and calls == {1: 0.6, 2: 0.7}
    assert plot_rewards(tmp_path).read_bytes()[:4] == b"\x89PNG"
