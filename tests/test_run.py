"""setup(cfg) -> Run and the entry points around it: bad input is one line and exit 2 before
any work, checkpoints are untrusted input."""

import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, TINY, clean_env, entry, tiny

from mini_grpo import distributed as D
from mini_grpo.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from mini_grpo.config import ConfigError
from mini_grpo.job import train
from mini_grpo.limits import check_world
from mini_grpo.run import setup


def one_line_exit_2(r):
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-2000:]
    return lines[0]


def test_setup_builds_every_part_once_and_close_tears_down(tmp_path):
    cfg = tiny(tmp_path / "run")
    with setup(cfg) as run:
        assert run.task.name == "chess_fen" and run.scorer.keys == ["board_delta", "levenshtein"]
        assert run.net is run.model and run.comm is None and run.reference is None
        assert (tmp_path / "run" / "tokenizer.json").is_file() and run.logger is not None
        run.freeze_reference()
        assert run.reference is not None
    assert run.scorer._pool is None  # closed


def test_fewer_prompts_than_ranks_is_refused_at_the_start():
    cfg = tiny(None, prompts_per_step=1)
    with pytest.raises(ConfigError, match="prompts_per_step: 1 is smaller than the number of "
                                          "processes \\(2\\)"):
        check_world(cfg, D.DistInfo(world_size=2))
    with pytest.raises(ConfigError, match="sft_batch_size"):
        check_world(tiny(None, sft_batch_size=3), D.DistInfo(world_size=4))
    check_world(cfg, D.DistInfo(world_size=1))


def test_fsdp_cpu_offload_on_a_cpu_device_is_refused_at_setup(tmp_path):
    """FSDP's CPU offload moves shards off a GPU; on a CPU device it was pin_memory's
    traceback on every rank: one line naming the field, before any work."""
    cfg = tiny(tmp_path / "run", parallelism="fsdp", fsdp_cpu_offload=True, device="cpu")
    with pytest.raises(ConfigError, match="fsdp_cpu_offload: .* on a CPU device they are "
                                          "there already"):
        setup(cfg)
    assert not (tmp_path / "run").exists()  # refused before the run directory is claimed
    offload = tiny(None, parallelism="fsdp", fsdp_cpu_offload=True)
    check_world(offload, D.DistInfo(world_size=2), torch.device("cuda", 0))  # a GPU's to do
    check_world(tiny(None, fsdp_cpu_offload=True), D.DistInfo(world_size=2),
                torch.device("cpu"))  # DDP does not read it


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_asked_without_a_gpu_exits_2():
    line = one_line_exit_2(entry("--config", "tiny", "--device=cuda", "--mode=grpo"))
    assert "device: cuda" in line and "CUDA is not available" in line


def test_an_out_dir_that_cannot_be_created_exits_2(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    line = one_line_exit_2(entry("--config", "tiny", "--mode=grpo", "--max_steps=1",
                                 f"--out_dir={blocker}/run"))
    assert line == f"error: out_dir {blocker}/run: {blocker} is not a directory"


PLUGIN = '''
from pathlib import Path
Path("PLUGIN_RAN").write_text("imported")
def fn(prompts, completions, targets, metas):
    return [0.0] * len(completions)
'''


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt")
    train(tiny(out, max_steps=1, save_every=1))
    return list_checkpoints(out / "checkpoints")[-1]


def tampered(checkpoint, tmp_path, spec=None, **config):
    """The checkpoint with `config` keys changed, and its model spec changed by `spec`
    (a dict of config keys, or "drop": a checkpoint saved before specs were stored)."""
    state = load_checkpoint(checkpoint)
    state["config"].update(config)
    if spec == "drop":
        del state["model_spec"]
    elif spec:
        state["model_spec"] = {**state["model_spec"], **spec.pop("_", {})}
        state["model_spec"]["config"].update(spec)
    return save_checkpoint(state, tmp_path / "bad", 1)


def evaluate_cmd(path, cwd, *extra):
    return subprocess.run([sys.executable, "-m", "mini_grpo", "evaluate", "--checkpoint",
                           str(path), *extra], capture_output=True, text=True, cwd=cwd,
                          env=clean_env(PYTHONPATH=f"{ROOT}:{cwd}"), timeout=300)


def test_a_checkpoint_never_imports_a_plugin_only_it_names(checkpoint, tmp_path):
    (tmp_path / "evil.py").write_text(PLUGIN)
    path = tampered(checkpoint, tmp_path, rewards=[{"name": "evil:fn", "weight": 1.0}])
    line = one_line_exit_2(evaluate_cmd(path, tmp_path))
    assert "evil:fn" in line and "not imported" in line
    # a config file of the user's that does not name the rewards leaves them the checkpoint's
    (tmp_path / "mine.yaml").write_text("num_eval: 4\n")
    line = one_line_exit_2(evaluate_cmd(path, tmp_path, "--config", "mine.yaml"))
    assert "evil:fn" in line and "not imported" in line
    assert not (tmp_path / "PLUGIN_RAN").exists()
    # named by the user on the command line, it is theirs to run
    r = evaluate_cmd(path, tmp_path, "--rewards=[{name: 'evil:fn'}]", "--num_eval=4")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "PLUGIN_RAN").exists()
    (tmp_path / "PLUGIN_RAN").unlink()  # and so are those their config file names
    (tmp_path / "mine.yaml").write_text("num_eval: 4\nrewards: [{name: 'evil:fn'}]\n")
    r = evaluate_cmd(path, tmp_path, "--config", "mine.yaml")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "PLUGIN_RAN").exists()


PLANTED = 'from pathlib import Path\nPath("PLANTED_RAN").write_text("imported")\n'
# a checkpoint's config naming code of a module planted where the command runs
STORED_CODE = {"rewards": [{"name": "planted:fn", "weight": 1.0}],
               "tools": ["planted:tool"], "environment": "planted:Env"}


def mini_grpo_cmd(cwd, *args):
    """`python -m mini_grpo ARGS` run from `cwd`, which `python -m` puts first on sys.path."""
    return subprocess.run([sys.executable, "-m", "mini_grpo", *args], capture_output=True,
                          text=True, cwd=cwd, env=clean_env(), timeout=300)


@pytest.mark.parametrize("field", list(STORED_CODE))
def test_code_a_checkpoint_names_is_never_imported(checkpoint, tmp_path, field):
    """rewards, tools, environment: each names code to import (package.module:name), and a
    module planted beside the checkpoint runs under none of the commands that read it."""
    (tmp_path / "planted.py").write_text(PLANTED)
    path = tampered(checkpoint, tmp_path, **{field: STORED_CODE[field]})
    line = one_line_exit_2(mini_grpo_cmd(tmp_path, "evaluate", "--checkpoint", str(path),
                                         "--num_eval=2"))
    value = "planted:" + {"rewards": "fn", "tools": "tool", "environment": "Env"}[field]
    assert f"names {field} mini-grpo does not ship ({value})" in line and "not imported" in line
    (tmp_path / "mine.yaml").write_text("num_eval: 2\n")  # a config file that does not name it
    one_line_exit_2(mini_grpo_cmd(tmp_path, "evaluate", "--checkpoint", str(path),
                                  "--config", "mine.yaml"))
    one_line_exit_2(mini_grpo_cmd(tmp_path, "rft-generate", "--output", "rft.jsonl",
                                  "--checkpoint", str(path)))
    r = mini_grpo_cmd(tmp_path, "sample", "--prompt", "e2e4", "--max_new_tokens=2",
                      "--checkpoint", str(path))
    if field == "rewards":  # sampling scores nothing: the rewards are dropped, not imported
        assert r.returncode == 0, r.stderr[-2000:]
    else:
        one_line_exit_2(r)
    r = mini_grpo_cmd(tmp_path, "export", "--checkpoint", str(path), "--output", "hf")
    assert r.returncode == 0, r.stderr[-2000:]  # what it writes needs none of them
    r = subprocess.run([sys.executable, str(ROOT / "distributed_train.py"), "--config", "tiny",
                        *(f"--{k}={v}" for k, v in TINY.items()), f"--resume={path}",
                        "--out_dir=run", "--max_steps=2"],
                       capture_output=True, text=True, cwd=tmp_path, env=clean_env(),
                       timeout=300)
    # resumed under the user's config: tools and environment are fixed on resume (refused)
    assert r.returncode == (0 if field == "rewards" else 2), r.stderr[-2000:]
    assert not (tmp_path / "PLANTED_RAN").exists()
    # named by the user, the same value is theirs to run (it runs: the marker appears)
    named = {"rewards": "--rewards=[{name: 'planted:fn'}]", "tools": "--tools=[planted:tool]",
             "environment": "--environment=planted:Env"}[field]
    r = mini_grpo_cmd(tmp_path, "evaluate", "--checkpoint", str(path), "--num_eval=2", named)
    assert "not imported" not in r.stderr, r.stderr[-2000:]
    if field != "environment":  # (which needs a chat template, which this model lacks)
        assert (tmp_path / "PLANTED_RAN").exists()


def test_an_advantage_estimator_a_checkpoint_names_is_dropped_never_imported(checkpoint,
                                                                            tmp_path):
    """Only training computes advantages and losses: evaluate, sample and rft-generate take
    the defaults of advantage_estimator and policy_loss; a resume takes the user's config's."""
    (tmp_path / "planted.py").write_text(PLANTED)
    path = tampered(checkpoint, tmp_path, advantage_estimator="planted:adv",
                    policy_loss="planted:loss")
    for args in (["evaluate", "--num_eval=2"], ["sample", "--prompt", "e2e4",
                                                "--max_new_tokens=2"]):
        r = mini_grpo_cmd(tmp_path, *args, "--checkpoint", str(path))
        assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run([sys.executable, str(ROOT / "distributed_train.py"), "--config", "tiny",
                        *(f"--{k}={v}" for k, v in TINY.items()), f"--resume={path}",
                        "--out_dir=run", "--max_steps=2"],
                       capture_output=True, text=True, cwd=tmp_path, env=clean_env(),
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not (tmp_path / "PLANTED_RAN").exists()


@pytest.mark.parametrize("config, needle", [
    # the model a checkpoint describes is compared with its weights before it is built
    ({"spec": {"n_layer": 10**9}}, "its model has 1000000000 layers, its weights 2"),
    ({"spec": {"n_embd": 64}}, "mismatched weights"),  # on the meta device
    ({"spec": {"_": {"family": "bert"}}}, "model family 'bert' is not one of gpt, llama"),
    ({"spec": {"n_heads": 3}}, "unknown keys ['n_heads']"),
    # saved before specs were stored: the config's model fields describe it
    ({"spec": "drop", "n_layer": 3}, "its model has 3 layers, its weights 2"),
    ({"spec": "drop", "n_embd": 64}, "mismatched weights"),
    ({"lrr": 0.1}, "config key lrr: unknown key"),
    ({"lr": "fast"}, "lr: expected a number"),
    ({"temperature": float("nan")}, "temperature: must be a finite number"),
])
def test_a_checkpoint_config_is_checked_like_a_users(checkpoint, tmp_path, config, needle):
    line = one_line_exit_2(evaluate_cmd(tampered(checkpoint, tmp_path, **config), tmp_path))
    assert needle in line


def test_a_plugin_that_fails_every_row_exits_2_with_one_line(tmp_path):
    (tmp_path / "broken.py").write_text("def fn(prompts, completions, targets, metas):\n"
                                        "    raise KeyError('no such column')\n")
    line = one_line_exit_2(entry(
        "--config", "tiny", "--mode=grpo", "--max_steps=1", f"--out_dir={tmp_path / 'r'}",
        "--rewards=[{name: 'broken:fn'}, {name: levenshtein}]",
        env={"PYTHONPATH": f"{ROOT}:{tmp_path}"}))
    assert "reward plugin 'fn' failed on" in line and "KeyError: 'no such column'" in line


def _children(pid: int) -> list[int]:
    """The live processes whose parent is `pid` (from /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d))
    return out


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process tree from /proc")
def test_a_terminated_run_stops_its_reward_workers(tmp_path):
    """SIGTERM (kill, a scheduler) to distributed_train.py: the run ends as an exception ends
    it (exit 143), and its reward worker processes end with it instead of lingering as
    orphans (they did: the trainer died on the signal's default, cleaning up nothing)."""
    import signal

    p = subprocess.Popen([sys.executable, str(ROOT / "distributed_train.py"), "--config", "tiny",
                          *(f"--{k}={v}" for k, v in TINY.items()), "--out_dir=run",
                          "--mode=grpo", "--max_steps=100000", "--reward_executor=process",
                          "--num_reward_workers=2", "--log_every=1"],
                         cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        for line in p.stdout:  # the first step's line: the workers have scored a batch
            if line.startswith("step 1/"):
                break
        workers = _children(p.pid)
        assert workers, "no reward workers to watch"
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 128 + signal.SIGTERM
    for _ in range(100):  # they are told to stop, then joined: give them a moment
        alive = [w for w in workers if os.path.exists(f"/proc/{w}")
                 and open(f"/proc/{w}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]
        if not alive:
            break
        time.sleep(0.1)
    assert not alive, f"reward workers left running: {alive}"
