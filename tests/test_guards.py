"""NaN/Inf guards: skipped steps, the fallback ladder in order, finite checkpoints."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import events, metrics, ranks_env, tiny, tiny_gpt
from fault_worker import installed

from mini_grpo.checkpoint import list_checkpoints, load_checkpoint
from mini_grpo.config import ConfigError, load_config
from mini_grpo.guards import Guard, GuardError, NonFiniteError
from mini_grpo.job import train

ROOT = Path(__file__).resolve().parent.parent
NAN, ONE = torch.tensor(float("nan")), torch.tensor(1.0)


def walk(g: Guard, have_checkpoint: bool, n: int) -> list:
    """n non-finite steps; what the guard did after each (None, a message, or "GuardError")."""
    seen = []
    for _ in range(n):
        assert not g.check(NAN, ONE)
        try:
            seen.append(g.fallback(have_checkpoint, lambda: "ckpt.pt"))
        except GuardError:
            seen.append("GuardError")
    return seen


def test_ladder_order_and_inapplicable_rungs_are_passed_over():
    g = Guard(patience=2, amp=True)
    seen = walk(g, True, 8)
    assert seen[0::2] == [None] * 4
    assert "autocast turned off" in seen[1] and "learning rate halved" in seen[3]
    assert seen[5] == "restored ckpt.pt" and seen[7] == "GuardError"
    assert (g.amp, g.lr_scale) == (False, 0.5)
    g = Guard(patience=1, amp=False)  # AMP already off and no checkpoint: halve_lr, stop
    assert not g.check(ONE, torch.tensor(float("inf")))
    assert "halved" in g.fallback(False, lambda: "x")
    assert walk(g, False, 1) == ["GuardError"]


def test_a_finite_step_resets_the_count_and_bad_flags_count_as_non_finite():
    g = Guard(patience=2)
    assert not g.check(NAN, ONE)
    assert g.check(ONE, ONE, torch.tensor(True))
    assert not g.check(ONE, ONE, torch.tensor(False))  # e.g. non-finite logits at sampling
    assert g.fallback(True, lambda: "x") is None and g.skipped == 2


def test_guard_state_round_trips():
    g = Guard(patience=1, amp=True)
    walk(g, False, 2)  # amp off, lr halved
    again = Guard(patience=1, amp=True)
    again.load_state_dict(g.state_dict())
    assert (again.amp, again.lr_scale, again.next_rung, again.skipped) == (False, 0.5, 2, 2)


def test_injected_nans_walk_down_the_ladder_in_order(tmp_path):
    # steps 1-2 fine (checkpoint at 2), then NaN from step 3 on, two skips per rung
    cfg = load_config("tiny", {"out_dir": str(tmp_path / "run"), "mode": "grpo",
                               "num_eval": "8", "max_steps": "12", "save_every": "2",
                               "guard_patience": "2", "use_amp": "true", "amp_dtype": "bfloat16",
                               "reward_executor": "serial"}, env={})
    with installed(nan_steps=range(3, 13)), pytest.raises(GuardError,
                                                          match="after every fallback"):
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
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **ranks_env(2))
    out = tmp_path / "ddp"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node=2", "tests/fault_worker.py", "--nan_steps=2", "--",
                        "--config", "tiny",
                        "--mode=grpo", "--num_eval=8", "--max_steps=3", "--save_every=3",
                        f"--out_dir={out}"],
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
                        "--lr=1e6", "--guard_patience=1",
                        f"--out_dir={out}"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.returncode == 0 or (r.returncode == 1 and "after every fallback" in r.stderr)
    for path in list_checkpoints(out / "checkpoints"):
        assert all(torch.isfinite(p).all() for p in load_checkpoint(path)["model"].values())


def test_a_resumed_run_keeps_amp_off_and_the_lr_halved(tmp_path, monkeypatch):
    """fp16 (else bf16): NaN at steps 2 and 3 with patience 1 turn autocast off, then halve
    the lr; the checkpoint at step 4 carries that, and the run resumed from it keeps both.
    Before, a resumed run forgot both, and an fp16 one could not load its empty scaler."""
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            torch.ones(2, 2) @ torch.ones(2, 2)
        dtype = "float16"
    except RuntimeError:
        dtype = "bfloat16"
    over = dict(use_amp=True, amp_dtype=dtype, guard_patience=1, save_every=4)
    import mini_grpo.job as job
    calls, real = [], job.evaluate
    monkeypatch.setattr(job, "evaluate", lambda run, **kw: calls.append(kw["amp"]) or
                        real(run, **kw))
    with installed(nan_steps=(2, 3)):
        train(tiny(tmp_path / "run", max_steps=4, **over))
    assert calls == [True, True, False, False]  # before GRPO, then after AMP was cut
    state = load_checkpoint(tmp_path / "run" / "checkpoints" / "step_0000004.pt")
    assert state["guard"]["amp"] is False and state["guard"]["lr_scale"] == 0.5
    train(tiny(tmp_path / "run", max_steps=6, **over))
    rows = {r["step"]: r for r in metrics(tmp_path / "run") if "guard/amp" in r}
    assert rows[1]["guard/amp"] == 1.0
    assert [(rows[s]["guard/amp"], rows[s]["guard/lr_scale"]) for s in (5, 6)] == \
        [(0.0, 0.5), (0.0, 0.5)]


def test_sampling_survives_non_finite_logits_and_reports_them():
    m = tiny_gpt()
    m.lm_head.register_forward_hook(lambda mod, inp, out: out * float("nan"))
    from mini_grpo.engines.native import generate

    for greedy in (True, False):
        r = generate(m, [[1, 5, 6], [1, 7]], 6, 2, 0, greedy=greedy,
                     generator=torch.Generator().manual_seed(0))
        assert bool(r.nonfinite) and r.completion_ids.size(1) == 1  # stopped at once
    r = generate(tiny_gpt(), [[1, 5, 6]], 6, 2, 0, greedy=True)
    assert not bool(r.nonfinite)


def test_sft_that_blows_up_writes_nothing_and_a_sane_rerun_trains(tmp_path):
    out = tmp_path / "sft"
    with pytest.raises((GuardError, NonFiniteError)):
        train(tiny(out, mode="sft", sft_steps=12, sft_lr=1e6, guard_patience=1))
    assert not list((out / "sft").glob("step_*.pt"))  # no NaN checkpoint to reuse
    train(tiny(out, mode="sft", sft_steps=12))
    state = load_checkpoint(out / "sft" / "step_0000012.pt")
    assert all(torch.isfinite(v).all() for v in state["model"].values())


def test_a_finished_sft_stage_is_reused_only_with_the_same_options(tmp_path, capsys):
    out = tmp_path / "sft"
    train(tiny(out, mode="sft", sft_steps=4))
    capsys.readouterr()
    train(tiny(out, mode="sft", sft_steps=4))
    assert "[sft] reusing finished stage" in capsys.readouterr().out
    train(tiny(out, mode="sft", sft_steps=4, sft_lr=1e-4))
    text = capsys.readouterr().out
    assert "not reusing" in text and "sft_lr" in text and "[sft] done" in text


def test_a_reused_sft_stage_hands_grpo_the_rng_the_stage_left(tmp_path):
    """A run killed after SFT, before GRPO's first checkpoint, and started again reuses the
    stage: GRPO then draws its dropout from where SFT left the RNG, as the straight run does
    (it drew from where building the model left it: every tensor of the weights differed)."""
    opts = dict(mode="sft_grpo", sft_steps=3, max_steps=2, save_every=1, dropout=0.1, lr=1e-2)
    train(tiny(tmp_path / "straight", **opts))
    out = tmp_path / "again"
    train(tiny(out, **opts))
    for path in list_checkpoints(out / "checkpoints"):
        path.unlink()
    (out / "eval.json").unlink()
    train(tiny(out, **opts))
    want = load_checkpoint(list_checkpoints(tmp_path / "straight" / "checkpoints")[-1])
    got = load_checkpoint(list_checkpoints(out / "checkpoints")[-1])
    assert got["step"] == want["step"] == 2
    assert [k for k in want["model"] if not torch.equal(want["model"][k], got["model"][k])] == []


def test_a_stage_saved_by_an_older_version_is_compared_after_migration():
    from mini_grpo.sft import stage_changes

    cfg = tiny(None)
    old = cfg.to_dict()
    old.pop("task_args")
    old.update(num_train=256, min_plies=2, max_plies=12, move_format="uci", pgn_path="",
               parallel_rewards=False)  # top-level keys of the version before task_args
    old.pop("report_to")
    old.pop("reward_executor")
    assert stage_changes(old, cfg) == []
    assert stage_changes({**old, "max_plies": 8}, cfg) == ["task_args"]
    assert stage_changes({**old, "lrr": 1}, cfg) == ["config (unreadable)"]


def test_a_finished_stage_is_not_reused_after_its_data_file_changed_in_place(tmp_path, capsys):
    """Only the data_path string was compared: a file edited in place (the same alphabet,
    other targets) had its stale stage reused, and the run evaluated and exported it."""
    data = tmp_path / "data.jsonl"
    rows = lambda target: "".join(json.dumps({"prompt": f"q{i}:", "target": target}) + "\n"
                                  for i in range(8))
    data.write_text(rows("ab"))
    opts = dict(mode="sft", sft_steps=3, task="jsonl", data_path=str(data), num_eval=2)
    out = tmp_path / "run"
    train(tiny(out, **opts))
    train(tiny(out, **opts))
    assert "[sft] reusing finished stage" in capsys.readouterr().out
    data.write_text(rows("ba"))
    train(tiny(out, **opts))
    text = capsys.readouterr().out
    assert "not reusing" in text and "trained with other data" in text and "[sft] done" in text


def test_a_finished_stage_of_fewer_steps_beside_one_of_more_is_reused(tmp_path, capsys):
    """sft_steps 8, then 4: both stages stay (prune keeps the later step). The newest was
    the only one looked at, so the 4-step stage was trained again on every later run."""
    out = tmp_path / "run"
    for steps in (8, 4):
        train(tiny(out, mode="sft", sft_steps=steps))
    capsys.readouterr()
    train(tiny(out, mode="sft", sft_steps=4))
    text = capsys.readouterr().out
    assert "[sft] reusing finished stage" in text and "step_0000004" in text
    assert "[sft] done" not in text


def test_grpo_resumed_under_other_sft_options_keeps_its_stage_and_reference(tmp_path, capsys):
    """sft_lr changed on resume: the stage was trained again (its checkpoint overwritten, its
    rows logged after GRPO's) and GRPO went on against the new stage as its KL reference
    (kl 2.6e-7 at the last step, 5e-3 at the next). Now the stages before GRPO are not
    trained again: the reference is the stage the checkpoint started from."""
    out = tmp_path / "run"
    opts = dict(mode="sft_grpo", sft_steps=4, save_every=1, num_eval=4, lr=1e-2)
    train(tiny(out, max_steps=2, **opts))
    stage = (out / "sft" / "step_0000004.pt").read_bytes()
    straight = tmp_path / "straight"
    train(tiny(straight, max_steps=3, **opts))
    capsys.readouterr()
    train(tiny(out, max_steps=3, **{**opts, "sft_lr": 2e-3}))
    text = capsys.readouterr().out
    assert "[sft] done" not in text and "the KL reference: the stage GRPO started from" in text
    assert (out / "sft" / "step_0000004.pt").read_bytes() == stage
    steps = [m["step"] for m in metrics(out) if "sft/loss" in m or "reward/mean" in m]
    assert steps == [1, 2, 3, 4, 1, 2, 3]  # SFT's rows, then GRPO's: none logged again
    kl = lambda d: [m["kl"] for m in metrics(d) if "kl" in m]
    assert kl(out) == pytest.approx(kl(straight), rel=1e-4, abs=1e-9)
    # nor does a checkpoint go on under another mode (its reference was another model)
    with pytest.raises(ConfigError, match="cannot resume with a different mode"):
        train(tiny(out, max_steps=4, **{**opts, "mode": "grpo"}))


def test_a_checkpoint_of_another_run_directory_leaves_this_one_s_log_whole(tmp_path):
    """--resume=PATH of another directory: its byte count cut this directory's
    metrics.jsonl, mid-row."""
    a, b = tmp_path / "a", tmp_path / "b"
    train(tiny(a, mode="grpo", max_steps=1, save_every=1, num_eval=4))
    train(tiny(b, mode="sft", sft_steps=30, num_eval=4))
    before = (b / "metrics.jsonl").read_bytes()
    assert len(before) > load_checkpoint(a / "checkpoints" / "step_0000001.pt")["logged"]
    train(tiny(b, mode="grpo", max_steps=2, num_eval=4,
               resume=str(a / "checkpoints" / "step_0000001.pt")))
    assert (b / "metrics.jsonl").read_bytes().startswith(before)
    metrics(b)  # every row JSON
