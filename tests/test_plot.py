"""plot.py: the reward curve from metrics.jsonl, resumed rows and torn lines included; an
existing reward.png replaced only where mini-grpo wrote it."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, clean_env

from mini_grpo.config import ConfigError
from mini_grpo.outputs import RUN_MARKER
from mini_grpo.plot import MARK, plot_rewards, png_software, read_metrics


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


def metrics_dir(path):
    path.mkdir(exist_ok=True)
    (path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    return path


def test_a_users_reward_png_is_never_replaced_ours_is(tmp_path, monkeypatch):
    """A file of the user's named reward.png, beside a metrics.jsonl: refused naming it (the
    command: one line, exit 2), left as it was; a PNG of ours, or any reward.png in a run's
    own directory, is replaced, through a temporary name of this process's own."""
    plt = pytest.importorskip("matplotlib.pyplot")
    user = metrics_dir(tmp_path / "notes")
    (user / "reward.png").write_text("my notes\n")
    with pytest.raises(ConfigError, match="reward.png: exists and was not written"):
        plot_rewards(user)
    r = subprocess.run([sys.executable, "-m", "mini_grpo.plot", str(user)], cwd=ROOT,
                       capture_output=True, text=True, env=clean_env(), timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: output ") and \
        len(r.stderr.splitlines()) == 1 and str(user / "reward.png") in r.stderr, r.stderr
    assert (user / "reward.png").read_text() == "my notes\n"
    assert sorted(os.listdir(user)) == ["metrics.jsonl", "reward.png"]  # no temporary left
    # another program's PNG is no more ours than a text file
    (user / "reward.png").unlink()
    plt.figure().savefig(user / "reward.png", format="png")
    with pytest.raises(ConfigError):
        plot_rewards(user)

    temps = []
    savefig = plt.Figure.savefig

    def spy(fig, fname, **kw):
        temps.append(fname)
        return savefig(fig, fname, **kw)

    monkeypatch.setattr(plt.Figure, "savefig", spy)
    mine = metrics_dir(tmp_path / "mine")
    for _ in range(2):  # new, then our own again
        assert png_software(plot_rewards(mine)) == MARK
    run = metrics_dir(tmp_path / "run")
    (run / RUN_MARKER).write_text("")
    (run / "reward.png").write_text("a run claims the names it writes\n")
    assert png_software(plot_rewards(run)) == MARK
    assert all(f".reward.png.tmp{os.getpid()}" == t.name for t in temps) and len(temps) == 3
