"""A training run owns its out_dir (run.claim_out_dir, outputs.claim_run_dir): it writes into a
new, empty or run directory only, checks every output it will write before any work, and
holds a lock for its life, so a second run into the same directory is refused. The cases an
adversarial pass found overwriting a user's folder, each refused with one line."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, entry, metrics, tiny

from mini_grpo.checkpoint import list_checkpoints, save_checkpoint
from mini_grpo.fields import ConfigError
from mini_grpo.job import train
from mini_grpo.outputs import MARKER, RUN_MARKER, claim_run_dir
from mini_grpo.run import setup, start_afresh

ARGS = ["--config", "tiny", "--mode=grpo", "--use_amp=false", "--reward_executor=serial",
        "--num_eval=4"]


def snapshot(root) -> dict:
    """Every file's bytes but a run's claim (which names the process holding it)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != RUN_MARKER}


def users_folder(path):
    """A folder of the user's own files under the names a run writes."""
    path.mkdir(parents=True)
    for name in ("config.yaml", "tokenizer.json", "eval.json", "reward.png"):
        (path / name).write_text(f"the user's {name}\n")
    (path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "par')  # a partial last line
    return path


def refused(out):
    """A training run into `out`, which must exit 2: its output."""
    r = entry(*ARGS, f"--out_dir={out}")
    assert r.returncode == 2, r.stderr[-2000:]
    return r


def test_a_users_folder_is_refused_before_any_work_naming_its_files(tmp_path):
    proj = users_folder(tmp_path / "projA")
    before = snapshot(tmp_path)
    r = refused(proj)
    assert r.stderr.strip().splitlines() == [
        f"error: out_dir {proj}: holds files no mini-grpo run wrote (config.yaml, eval.json, "
        f"metrics.jsonl, ...); not written into (choose a new or empty directory; if an "
        f"earlier mini-grpo wrote it, `touch {proj / RUN_MARKER}` to claim it)"]
    assert snapshot(tmp_path) == before and "task" not in r.stdout  # refused before the task


def test_the_current_directory_and_those_above_it_are_refused(tmp_path, monkeypatch):
    here = tmp_path / "a" / "b"
    here.mkdir(parents=True)
    monkeypatch.chdir(here)
    for out in (".", "..", str(tmp_path), "c/..", os.getcwd()):
        with pytest.raises(ConfigError, match="is the current directory or holds it"):
            claim_run_dir(out)
    os.symlink(here, tmp_path / "link")  # through a symlink too: resolved once
    with pytest.raises(ConfigError, match="is the current directory or holds it"):
        claim_run_dir(tmp_path / "link")
    assert sorted(os.listdir(here)) == []


def test_every_output_a_run_writes_is_checked_at_setup(tmp_path):
    """A marked run directory whose hf/ holds a user's file, or where a run's file name is a
    folder or a link: refused at setup, before the first step, and nothing is written."""
    cases = {"hf": lambda d: (d / "hf").mkdir() or (d / "hf" / "notes.txt").write_text("x"),
             "adapter": lambda d: (d / "adapter").mkdir() or (d / "adapter" / MARKER).write_text(
                 "") or (d / "adapter" / "x.bin").write_text(""),
             "eval.json": lambda d: (d / "eval.json").mkdir(),
             "metrics.jsonl": lambda d: os.symlink(tmp_path / "elsewhere", d / "metrics.jsonl"),
             "checkpoints": lambda d: (d / "checkpoints").write_text("")}
    for name, plant in cases.items():
        out = tmp_path / f"run_{name}"
        out.mkdir()
        (out / RUN_MARKER).write_text("")
        plant(out)
        before = snapshot(tmp_path)
        with pytest.raises(ConfigError, match=name if name in ("hf", "adapter") else
                           f"{name} is not the (file|directory) a run writes there") as e:
            setup(tiny(out))
        assert "\n" not in str(e.value) and snapshot(tmp_path) == before, name


def test_a_second_run_into_the_same_directory_is_refused_while_the_first_lives(tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from mini_grpo.outputs import claim_run_dir; "
        f"claim_run_dir({str(out)!r}); print('held', flush=True); time.sleep(120)")],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert refused(out).stderr.strip().splitlines() == [
            f"error: out_dir {out}: another run is writing into it (mini-grpo run, pid "
            f"{holder.pid} on {os.uname().nodename}); wait for it to end, or choose another "
            f"out_dir"]
    finally:
        holder.send_signal(signal.SIGKILL)  # a killed run: the kernel releases its lock
        holder.wait()
    os.close(claim_run_dir(out))
    with pytest.raises(ConfigError, match="another run is writing into it"):
        fd = claim_run_dir(out)  # and while this process holds it, a second claim is refused
        try:
            claim_run_dir(out)
        finally:
            os.close(fd)


def test_a_run_resumes_its_own_directory_and_resume_never_starts_afresh(tmp_path):
    out = tmp_path / "run"
    train(tiny(out, max_steps=2, save_every=1, num_eval=4))
    (out / "notes.txt").write_text("the user's notes\n")
    steps = [m["step"] for m in metrics(out) if "reward/mean" in m]
    assert steps == [1, 2] and (out / RUN_MARKER).is_file()
    train(tiny(out, max_steps=3, save_every=1, num_eval=4))  # the same owner: resumes 2 -> 3
    assert [m["step"] for m in metrics(out) if "reward/mean" in m] == [1, 2, 3]
    # a later-step checkpoint of the run before must not be resumed from later
    assert [p.name for p in list_checkpoints(out / "checkpoints")][-1] == "step_0000003.pt"
    train(tiny(out, max_steps=1, save_every=1, num_eval=4, resume="never"))
    assert [m["step"] for m in metrics(out) if "reward/mean" in m] == [1]
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step_0000001.pt"]
    assert (out / "notes.txt").read_text() == "the user's notes\n"


def test_resume_never_removes_only_checkpoints_that_are_ours(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / RUN_MARKER).write_text("")
    save_checkpoint({"model": {"w": torch.zeros(2)}, "step": 5}, out / "checkpoints", 5)
    torch.save({"model": {}}, out / "checkpoints" / "step_0000006.pt")  # not ours: stays
    start_afresh(out)
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step_0000006.pt"]


def test_resume_never_under_a_config_that_is_refused_leaves_the_run_before_be(tmp_path):
    """`resume: never` cleared the run before's checkpoints, metrics and events as it
    claimed the directory, before the config was checked: a typo that setup refused had
    cost that run's history."""
    out = tmp_path / "run"
    train(tiny(out, max_steps=1, save_every=1, num_eval=4))
    files = lambda: sorted((str(p.relative_to(out)), p.stat().st_size)
                           for p in out.rglob("*") if p.is_file() and p.name != ".lock")
    before = files()
    assert any("tfevents" in f for f, _ in before)
    with pytest.raises(ConfigError, match="block_size: 8 is too small"):
        train(tiny(out, max_steps=1, resume="never", block_size=8))
    assert files() == before


def test_a_killed_run_leaves_no_lock_behind(tmp_path):
    """kill -9 mid-run: the next run into the directory starts (and resumes) at once."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "distributed_train.py", *ARGS, f"--out_dir={out}",
                             "--max_steps=50", "--save_every=1"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while not list_checkpoints(out / "checkpoints") and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert list_checkpoints(out / "checkpoints")
    os.close(claim_run_dir(out))


def test_a_resumed_run_logs_the_rows_of_the_run_left_alone(tmp_path):
    """A run killed after logging steps past its last checkpoint: the resumed one cuts
    metrics.jsonl back to what that checkpoint had logged, so no step appears twice and the
    rows (times aside) equal those of the run left alone."""
    def rows(out):
        clock = ("time", "per_s", "seconds", "mem/")  # what the machine's state decides
        return [{k: v for k, v in m.items() if not any(t in k for t in clock)}
                for m in metrics(out)]

    straight, killed = tmp_path / "straight", tmp_path / "killed"
    for out in (straight, killed):
        train(tiny(out, max_steps=4, save_every=2, eval_every=3, num_eval=4))
    (killed / "checkpoints" / "step_0000004.pt").unlink()  # killed before step 4's save
    train(tiny(killed, max_steps=4, save_every=2, eval_every=3, num_eval=4))
    assert rows(killed) == rows(straight)
    steps = [m for m in metrics(killed) if "reward/mean" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    assert all(0 < m["mem/rss_gb"] < 64 for m in steps)  # each step logs its memory
