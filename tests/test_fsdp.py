"""FSDP2 beside DDP, on CPU with gloo and 2 ranks: the same parameters after 3 GRPO steps as
DDP and as one process (HSDP too, on 4 ranks; LoRA's adapters too, the base untouched; our
GPT, a Llama and a Gemma 3), half
the bytes per rank, and a run that trains, checkpoints and resumes under torchrun (also onto
another number of ranks, both ways)."""

import shutil
import subprocess
import sys

import torch
from conftest import ROOT, clean_env, entry, metrics, plant_in_shard, ranks_env, torchrun
from fsdp_worker import build
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from mini_grpo.checkpoint import list_checkpoints, load_checkpoint


def worker(tmp_path, parallelism: str, nproc: int):
    out = tmp_path / f"{parallelism}{nproc}.pt"
    script = str(ROOT / "tests" / "fsdp_worker.py")
    if nproc == 1:
        r = subprocess.run([sys.executable, script, str(out), parallelism], cwd=ROOT,
                           capture_output=True, text=True, timeout=300,
                           env=clean_env(**ranks_env(4)))  # the device of the runs it is held to
    else:
        r = torchrun(script, str(out), parallelism, nproc=nproc)
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(out)


def test_fsdp_trains_to_the_parameters_of_ddp_and_of_one_process(tmp_path):
    one = worker(tmp_path, "ddp", 1)
    ddp = worker(tmp_path, "ddp", 2)
    fsdp = worker(tmp_path, "fsdp", 2)
    hsdp = worker(tmp_path, "hsdp", 4)  # 2 replicas of a model sharded over 2 ranks each
    # one SFT step's gradient: the whole batch's mean, however the rows are spread over ranks
    # (fsdp's through the compile wrapper run.net is under compile_model, its passes padded)
    for other in (ddp, fsdp, hsdp):
        for got, want in zip(other["sft"], one["sft"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    for family in ("gpt", "llama", "llama_lora", "gemma"):
        assert fsdp[f"{family}/passes"][0] != fsdp[f"{family}/passes"][1]  # padding ran
        init = build(family).state_dict()
        moved = max((one[family][k] - v).abs().max().item() for k, v in init.items())
        assert moved > 1e-2  # three AdamW steps at lr 1e-2: far beyond the tolerance below
        if family == "llama_lora":  # only the adapters trained, under every parallelism
            for run in (one, ddp, fsdp, hsdp):
                for k, v in init.items():
                    assert ".lora_" in k or torch.equal(run[family][k], v), (family, k)
        for name, want in one[family].items():
            # DDP itself differs from one process by rounding (~2e-5 after AdamW rescales
            # tiny gradients); FSDP must stay as close
            for other in (ddp, fsdp, hsdp):
                torch.testing.assert_close(other[family][name], want, rtol=0, atol=1e-4,
                                           msg=f"{family} {name}")
            torch.testing.assert_close(fsdp[family][name], ddp[family][name], rtol=0,
                                       atol=1e-4, msg=f"{family} {name}")
        # a one-process (or DDP) optimizer state continues under fsdp exactly
        assert fsdp[f"{family}/from_plain"] == 0.0
        # the reference: a copy of the trained weights made from the shards, sharded alike;
        # and rank 0's full weights sent into shards that started on the meta device
        for sharded in (fsdp, hsdp):
            for name, want in sharded[family].items():
                assert torch.equal(sharded[f"{family}/from_rank0"][name], want), name
            for name, want in sharded[family].items():
                assert torch.equal(sharded[f"{family}/reference"][name], want), name
            assert sharded[f"{family}/reference_bytes"] == [
                m["params"] + m["frozen"] for m in sharded[f"{family}/memory"]]
        # each rank holds about half of what a DDP rank holds (HSDP's too: shards of 2 ranks)
        full = ddp[f"{family}/memory"][0]
        for rank_mem in fsdp[f"{family}/memory"] + hsdp[f"{family}/memory"]:
            for key in ("params", "grads", "optimizer"):
                assert 0.4 * full[key] <= rank_mem[key] <= 0.6 * full[key], (family, key)


TINY = ["--config", "tiny", "--mode=grpo", "--use_amp=false", "--reward_executor=serial",
        "--parallelism=fsdp"]


def test_a_fsdp_run_checkpoints_in_shards_and_resumes_also_on_fewer_ranks(tmp_path):
    from safetensors.torch import load_file

    straight, split = tmp_path / "straight", tmp_path / "split"
    r = torchrun("distributed_train.py", *TINY, f"--out_dir={straight}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rank 1 holds (fsdp over 2)" in r.stdout
    steps = [m for m in metrics(straight) if "time/step" in m]
    # FSDP's collectives are timed: gathers for sampling and the reference, then the update's
    assert all(m["time/comm_rollout"] > 0 and m["time/comm"] > 0 for m in steps), steps
    r = torchrun("distributed_train.py", *TINY, f"--out_dir={split}", "--max_steps=2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [p.name for p in list_checkpoints(split / "checkpoints")] == ["step_0000002.dcp"]
    # a later save whose shard was cut short (a full disk, a copy broken off): skipped with a
    # warning, the run goes on from the older good one and ends as if never interrupted
    bad = split / "checkpoints" / "step_0000003.dcp"
    shutil.copytree(split / "checkpoints" / "step_0000002.dcp", bad)
    shard = sorted(bad.glob("*.distcp"))[-1]
    shard.write_bytes(shard.read_bytes()[:64])
    r = torchrun("distributed_train.py", *TINY, f"--out_dir={split}")  # resumes: 2 -> 4
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming GRPO from step 2" in r.stdout and f"{shard.name} is cut short" in r.stderr
    a, b = (load_file(d / "hf" / "model.safetensors") for d in (straight, split))
    for k in a:  # the final weights, exactly as if never interrupted
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, msg=k)
    assert load_checkpoint(list_checkpoints(split / "checkpoints")[-1])["step"] == 4
    # the shards continue in one process (DCP reshards them), and the CLI reads them
    r = subprocess.run([sys.executable, "distributed_train.py", *TINY, f"--out_dir={split}",
                        "--max_steps=5"], cwd=ROOT, capture_output=True, text=True,
                       env=clean_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming GRPO from step 4" in r.stdout
    assert [m["step"] for m in metrics(split) if "reward/mean" in m][-1] == 5
    ckpt = split / "checkpoints" / "step_0000004.dcp"
    r = subprocess.run([sys.executable, "-m", "mini_grpo", "export", "--checkpoint", str(ckpt),
                        "--output", str(tmp_path / "hf")], cwd=ROOT, capture_output=True,
                       text=True, env=clean_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    exported = load_file(tmp_path / "hf" / "model.safetensors")  # step 4's weights
    for k in a:
        torch.testing.assert_close(exported[k], a[k], rtol=0, atol=0, msg=k)
    # a pickle planted in a shard's byte item (the optimizer's lr) is refused, never run:
    # under torchrun and in one process
    marker = tmp_path / "ran"
    plant_in_shard(list_checkpoints(straight / "checkpoints")[-1], "optim.param_groups.0.lr",
                   marker)
    for launch in (lambda *a: torchrun("distributed_train.py", *a), entry):
        r = launch(*TINY, f"--out_dir={straight}", "--max_steps=5")
        assert r.returncode != 0 and not marker.exists(), r.stderr[-3000:]
        assert "item optim.param_groups.0.lr holds more than tensors and plain values, which " \
               "are never unpickled" in r.stderr


def test_a_one_process_checkpoint_resumes_under_fsdp_on_more_ranks(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "distributed_train.py", *TINY, f"--out_dir={out}",
                        "--max_steps=2"], cwd=ROOT, capture_output=True, text=True,
                       env=clean_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step_0000002.pt"]
    r = torchrun("distributed_train.py", *TINY, f"--out_dir={out}")  # 1 process -> 2 ranks
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming GRPO from step 2" in r.stdout
    # rank 1 has no saved stream: it samples from its own seed, not a copy of rank 0's
    assert ("rank 1 step 2: resumed without restoring rank 1's sampling generator (1 rank(s) "
            "wrote the checkpoint)") in r.stdout
    assert [m["step"] for m in metrics(out) if "reward/mean" in m][-1] == 4
    assert load_checkpoint(list_checkpoints(out / "checkpoints")[-1])["step"] == 4


def test_compile_model_under_fsdp_trains_as_without(tmp_path):
    steps = {}
    for compiled in ("false", "true"):
        out = tmp_path / compiled
        r = torchrun("distributed_train.py", *TINY, f"--out_dir={out}", "--max_steps=2",
                     f"--compile_model={compiled}")
        assert r.returncode == 0, r.stderr[-3000:]
        assert "uncompiled" not in r.stderr  # compiled: neither unavailable nor failed
        steps[compiled] = [m for m in metrics(out) if "time/step" in m]
    assert len(steps["true"]) == 2
    for eager, compiled in zip(steps["false"], steps["true"]):
        for key in ("loss", "grad_norm", "reward/mean"):
            assert abs(compiled[key] - eager[key]) <= 1e-4, (key, eager[key], compiled[key])


def test_the_sft_stage_under_fsdp_is_saved_in_shards_and_reused(tmp_path):
    out = tmp_path / "run"
    base = ["--config", "tiny", "--use_amp=false", "--reward_executor=serial", "--sft_steps=4"]
    full = [*base, "--parallelism=fsdp", f"--out_dir={out}"]  # SFT, then GRPO
    r = torchrun("distributed_train.py", *full, "--max_steps=1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [p.name for p in list_checkpoints(out / "sft")] == ["step_0000004.dcp"]
    r = torchrun("distributed_train.py", *full, "--max_steps=2")  # GRPO resumes; SFT reused
    assert r.returncode == 0, r.stderr[-3000:]
    assert "the KL reference: the stage GRPO started from" in r.stdout and \
        "resuming GRPO from step 1" in r.stdout
    # the shards hold the trained stage: the weights DDP trains (to rounding)
    ddp = tmp_path / "ddp"
    r = torchrun("distributed_train.py", *base, f"--out_dir={ddp}", "--mode=sft")
    assert r.returncode == 0, r.stderr[-3000:]
    want = load_checkpoint(ddp / "sft" / "step_0000004.pt")["model"]
    dcp_to_torch_save(out / "sft" / "step_0000004.dcp", tmp_path / "sft.pt")
    got = torch.load(tmp_path / "sft.pt")["model"]
    assert got.keys() == want.keys()
    for k in want:  # each of 4 AdamW steps at sft_lr moves a weight by ~1e-3: far beyond 1e-4
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-4, msg=k)
