"""Multi-process training under torchrun on CPU (gloo, loopback, --standalone free ports)."""

import json
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, clean_env, ranks_env, torchrun

from mini_grpo.checkpoint import list_checkpoints, load_checkpoint

# tiny GRPO run: 2 ranks x 2 prompts x 4 completions; checkpoints at steps 2 and 4
TINY = ["--config", "tiny", "--mode=grpo", "--num_eval=8", "--max_steps=4", "--save_every=2",
        "--num_threads=1"]


def test_two_ranks_compute_the_single_process_gradient(tmp_path):
    worker = str(ROOT / "tests" / "ddp_grad_worker.py")
    one = subprocess.run([sys.executable, worker, str(tmp_path / "one.pt")], cwd=ROOT,
                         capture_output=True, text=True, env=clean_env(), timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    r = torchrun(worker, str(tmp_path / "two.pt"))
    assert r.returncode == 0, r.stderr[-3000:]
    single, ddp = (torch.load(tmp_path / f"{n}.pt") for n in ("one", "two"))
    assert len(single) == 14  # 3 aggregations x 2 reward scalings x 1-2 passes, + 2 Llama
    for case in single:
        assert any(g.abs().max() > 0 for g in single[case]), case  # a real gradient
        d = max((a - b).abs().max().item() for a, b in zip(single[case], ddp[case]))
        assert d < 1e-6, (case, d)


def test_torchrun_end_to_end_writes_one_set_of_logs_and_checkpoints(tmp_path):
    out = tmp_path / "run"
    r = torchrun("distributed_train.py", *TINY, f"--out_dir={out}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == \
        ["step_0000002.pt", "step_0000004.pt"]
    state = load_checkpoint(out / "checkpoints" / "step_0000004.pt")
    assert len(state["rng"]) == 2  # one sampling RNG state per rank
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    steps = [row["step"] for row in rows if "reward/mean" in row]
    assert steps == [1, 2, 3, 4]  # rank 0 alone logs: no duplicated rows
    assert "2 processes" in r.stdout
    assert (out / "eval.json").is_file()


def test_train_sh_with_amp_and_two_processes(tmp_path):
    out = tmp_path / "sh"
    r = subprocess.run(["bash", "train.sh", "--mode=grpo", "--num_eval=8", "--max_steps=2",
                        "--num_threads=1"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env=clean_env(USE_AMP="true", AMP_DTYPE="bfloat16", NPROC="2", CONFIG="tiny",
                               OUT_DIR=str(out), PYTHON=sys.executable, **ranks_env(2)))
    assert r.returncode == 0, r.stderr[-3000:]
    saved = (out / "config.yaml").read_text()
    assert "use_amp: true" in saved and "amp_dtype: bfloat16" in saved
    assert load_checkpoint(out / "checkpoints" / "step_0000002.pt")["step"] == 2


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_killed_rank_restarts_and_resumes_from_the_checkpoint(tmp_path, parallelism):
    out = tmp_path / "elastic"
    r = torchrun("--max-restarts=1", "tests/fault_worker.py", "--fault=crash:3", "--", *TINY,
                 f"--out_dir={out}", f"--parallelism={parallelism}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[fault] rank 1 exits abruptly at step 3" in r.stdout
    assert "resuming GRPO from step 2" in r.stdout
    assert set(json.loads((out / "eval.json").read_text())) == {"before", "after", "baselines"}
    last = list_checkpoints(out / "checkpoints")[-1]  # a .pt file, or fsdp's .dcp shards
    assert last.stem == "step_0000004" and load_checkpoint(last)["step"] == 4
    from safetensors.torch import load_file
    params = load_file(out / "hf" / "model.safetensors")  # the final weights, exported
    assert all(torch.isfinite(p).all() for p in params.values())


def test_a_rank_that_raises_ends_the_job_quickly(tmp_path):
    # the survivors must not wait out dist_timeout (900 s) in a collective: a job that did
    # would run into the launch's own timeout (300 s) and fail here, however busy the machine
    r = torchrun("tests/fault_worker.py", "--fault=raise:2", "--", *TINY,
                 f"--out_dir={tmp_path / 'raise'}", "--dist_timeout=900", timeout=300)
    assert r.returncode != 0
    assert "injected fault on rank 1 at step 2" in r.stderr


def test_rank0_working_alone_longer_than_dist_timeout_does_not_end_the_run(tmp_path):
    """Rank 0 evaluates alone (before GRPO, then the final evaluation and the export) while
    the others wait: their wait is not bounded by dist_timeout (5 s here, each of rank 0's
    two spells 10 s longer), or a long final evaluation ended a finished run."""
    out = tmp_path / "slow"
    r = torchrun("tests/fault_worker.py", "--slow_rank0=10", "--", *TINY, f"--out_dir={out}",
                 "--max_steps=1", "--dist_timeout=5", "--parallelism=fsdp", "--use_amp=false",
                 "--reward_executor=serial")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("[fault] rank 0 works alone 10 s longer") == 2
    assert set(json.loads((out / "eval.json").read_text())) == {"before", "after", "baselines"}
    assert (out / "hf" / "model.safetensors").is_file()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL")
def test_nccl_end_to_end(tmp_path):
    r = torchrun("distributed_train.py", *TINY, f"--out_dir={tmp_path / 'nccl'}",
                 "--device=auto")
    assert r.returncode == 0, r.stderr[-3000:]


def test_a_second_process_group_in_one_process_under_torchrun(tmp_path):
    """benchmark.py builds a run, tears it down and builds the next: the second process
    group must not pick up the first's addresses from torchrun's store (it hung in DDP's
    parameter check until the timeout)."""
    script = tmp_path / "twice.py"
    script.write_text(
        "import torch\n"
        "from mini_grpo import distributed as D\n"
        "for i in range(2):\n"
        "    info = D.init(timeout_s=30, use_cuda=False)\n"
        "    net, _ = D.wrap_ddp(torch.nn.Linear(2, 2), torch.device('cpu'))\n"
        "    t = D.all_reduce_sum(torch.ones(1))\n"
        "    assert t.item() == 2, t\n"
        "    del net\n"
        "    D.cleanup()\n"
        "print('twice ok')\n")
    r = torchrun(str(script), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("twice ok") == 2


def test_the_comm_timer_splits_a_step_at_its_mark():
    from mini_grpo.distributed import CommTimer

    timer, cpu = CommTimer(), torch.device("cpu")
    for pause, mark in ((0.01, True), (0.02, False)):
        token = timer.start(cpu)
        time.sleep(pause)
        timer.stop(token)
        if mark:
            timer.mark()  # what follows is the policy update's
    before, after = timer.pop()
    assert before >= 0.01 and after >= 0.02
    token = timer.start(cpu)  # a pop starts over, before the mark
    timer.stop(token)
    before, after = timer.pop()
    assert before > 0 and after == 0.0


_FINALIZED = """
import atexit, runpy, sys
atexit.register(lambda: print("finalized", flush=True))
runpy.run_module("mini_grpo", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("entry", ["module", "script"])
def test_a_rank_under_torchrun_leaves_without_interpreter_finalization(tmp_path, entry):
    """`python -m mini_grpo ...` and distributed_train.py, as a rank under torchrun
    (TORCHELASTIC_RUN_ID set), exit with their code but skip finalization, where a finished
    rank aborted in CI (SIGABRT: distributed_train.py once, rft-generate under torchrun
    once); run plainly, they finalize as usual."""
    code = _FINALIZED if entry == "module" else _FINALIZED.replace(
        'runpy.run_module("mini_grpo", run_name="__main__", alter_sys=True)',
        f'runpy.run_path({str(ROOT / "distributed_train.py")!r}, run_name="__main__")')
    args = ["evaluate", "--checkpoint", str(tmp_path / "none.pt")] if entry == "module" \
        else ["--config", "tiny", "--lr=fast"]
    for rank, finalized in ((True, False), (False, True)):
        env = clean_env(**({"TORCHELASTIC_RUN_ID": "test"} if rank else {}))
        r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                           cwd=ROOT, env=env, timeout=120)
        assert r.returncode == 2 and "error:" in r.stderr, r.stderr[-2000:]
        assert ("finalized" in r.stdout) == finalized, (rank, r.stdout)


PEER_WORKER = """
import os, sys, time
from mini_grpo import distributed as D
from mini_grpo.cli import _guarded
info = D.init(30.0)
if info.rank == 0:  # ends while the other waits for its work alone
    time.sleep(1)
    os._exit(0)
sys.exit(_guarded(D.wait_for_main))
"""


def test_a_rank_whose_rank_0_ends_while_it_waits_says_so_in_one_line(tmp_path):
    """A rank waiting for rank 0's solo work (an evaluation, the export) when rank 0 ends:
    a RuntimeError traceback, now one line and exit 1."""
    port = subprocess.run([sys.executable, "-c", "import socket; s = socket.socket(); "
                           "s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"],
                          capture_output=True, text=True).stdout.strip()
    procs = [subprocess.Popen([sys.executable, "-c", PEER_WORKER], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=clean_env(**ranks_env(2), RANK=str(r), LOCAL_RANK=str(r),
                                            WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                                            MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for r in (0, 1)]
    out = [p.communicate(timeout=120) for p in procs]
    assert procs[1].returncode == 1, out[1]
    lines = out[1][1].strip().splitlines()
    assert lines[-1].startswith("error: rank 0 ended while rank 1 waited for it:"), out[1][1]
    assert "Traceback" not in out[1][1]
