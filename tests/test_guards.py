"""NaN/Inf guards: skipped steps, the fallback ladder in order, finite checkpoints."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mini_grpo.checkpoint import list_checkpoints, load_checkpoint
from mini_grpo.config import load_config
from mini_grpo.guards import Guard, GuardError
from mini_grpo.trainer import train

ROOT = Path(__file__).resolve().parent.parent
NAN, ONE = torch.tensor(float("nan")), torch.tensor(1.0)


def test_ladder_order_and_inapplicable_rungs_are_passed_over():
    g = Guard(patience=2)
    seen = []
    for _ in range(8):
        assert not g.step_ok(NAN, ONE)
        seen.append(g.rung(amp_on=True, have_checkpoint=True))
    assert seen == [None, "amp_off", None, "halve_lr", None, "restore", None, "stop"]
    g = Guard(patience=1)  # AMP already off and no checkpoint: straight to halve_lr, stop
    assert not g.step_ok(ONE, torch.tensor(float("inf")))
    assert g.rung(amp_on=False, have_checkpoint=False) == "halve_lr"
    assert not g.step_ok(NAN, ONE)
    assert g.rung(amp_on=False, have_checkpoint=False) == "stop"


def test_a_finite_step_resets_the_count():
    g = Guard(patience=2)
    assert not g.step_ok(NAN, ONE)
    assert g.step_ok(ONE, ONE)
    assert not g.step_ok(NAN, ONE)
    assert g.rung(True, True) is None and g.skipped == 2


def events(out_dir):
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").open()]
    return [(r["step"], r["event"]) for r in rows if "event" in r]


def test_injected_nans_walk_down_the_ladder_in_order(tmp_path, monkeypatch):
    # steps 1-2 fine (checkpoint at 2), then NaN from step 3 on, two skips per rung
    monkeypatch.setenv("MINI_GRPO_NAN_STEPS", ",".join(str(s) for s in range(3, 13)))
    cfg = load_config("tiny", {"out_dir": str(tmp_path / "run"), "mode": "grpo",
                               "num_eval": "8", "max_steps": "12", "save_every": "2",
                               "guard_patience": "2", "use_amp": "true",
                               "parallel_rewards": "false"}, env={})
    with pytest.raises(GuardError, match="after every fallback"):
        train(cfg)
    ev = events(tmp_path / "run")
    fallbacks = [(s, e.split(": ", 1)[1]) for s, e in ev if e.startswith("fallback")]
    assert [s for s, _ in fallbacks] == [4, 6, 8]
    assert "autocast turned off" in fallbacks[0][1]
    assert "learning rate halved" in fallbacks[1][1]
    assert "restored" in fallbacks[2][1] and "step_0000002.pt" in fallbacks[2][1]
    assert sum("step skipped" in e for _, e in ev) == 8  # steps 3..10; stop at 10
    for path in list_checkpoints(tmp_path / "run" / "checkpoints"):
        assert all(torch.isfinite(p).all() for p in load_checkpoint(path)["model"].values())


def test_nan_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("USE_AMP", "OUT_DIR")}
    env.update(OMP_NUM_THREADS="1", MINI_GRPO_NAN_STEPS="2", PYTHONPATH=str(ROOT))
    out = tmp_path / "ddp"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node=2", "distributed_train.py", "--config", "tiny",
                        "--mode=grpo", "--num_eval=8", "--max_steps=3", "--save_every=3",
                        "--parallel_rewards=false", f"--out_dir={out}"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    skipped = {row["step"]: row["guard/skipped"] for row in rows if "guard/skipped" in row}
    # the NaN was on rank 1 only; rank 0 (which logs) skipped step 2 as well
    assert skipped == {1: 0, 2: 1, 3: 1}
    state = load_checkpoint(out / "checkpoints" / "step_0000003.pt")
    assert all(torch.isfinite(p).all() for p in state["model"].values())


def test_absurd_learning_rate_neither_crashes_nor_writes_nan(tmp_path):
    out = tmp_path / "lr"
    env = {k: v for k, v in os.environ.items() if k not in ("USE_AMP", "OUT_DIR")}
    r = subprocess.run([sys.executable, "distributed_train.py", "--config", "tiny",
                        "--mode=grpo", "--num_eval=8", "--max_steps=8", "--save_every=2",
                        "--lr=1e3", "--guard_patience=1", "--parallel_rewards=false",
                        f"--out_dir={out}"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.returncode == 0 or (r.returncode == 1 and "after every fallback" in r.stderr)
    for path in list_checkpoints(out / "checkpoints"):
        assert all(torch.isfinite(p).all() for p in load_checkpoint(path)["model"].values())
