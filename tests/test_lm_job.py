"""The LM jobs in CI: countdown from scratch on the tiny character GPT, and countdown_qwen's
tiny twin on a tiny random Llama-family model with a BPE tokenizer and a chat template
(built locally, nothing downloaded): data -> GRPO -> <out_dir>/hf, as a user launches it."""

import json

import pytest
import torch
from conftest import entry, tiny, tiny_lm_dir

from mini_grpo.checkpoint import list_checkpoints, load_checkpoint
from mini_grpo.job import train


def test_countdown_from_scratch_on_the_tiny_config(tmp_path):
    result = train(tiny(tmp_path, task="countdown", mode="sft_grpo"))
    after = result["after"]["greedy"]
    assert {"solved", "numbers_3/solved", "numbers_4/solved"} <= set(after)
    assert set(result["baselines"]) >= {"sum_all", "echo_target"}
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_countdown_qwen_twin_runs_end_to_end(tmp_path):
    transformers = pytest.importorskip("transformers")
    lm = tiny_lm_dir(tmp_path / "model", "llama")
    out = tmp_path / "run"
    r = entry("--config", "countdown_tiny_lm", f"--init_from={lm}", f"--out_dir={out}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "task countdown" in r.stdout and "exported" in r.stdout
    state = load_checkpoint(list_checkpoints(out / "checkpoints")[-1])
    assert state["step"] == 2 and state["model_spec"]["hf_config"]["model_type"] == "llama"
    eval_ = json.loads((out / "eval.json").read_text())
    assert "numbers_3/solved" in eval_["after"]["greedy"]
    config = json.loads((out / "hf" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "hf")
    for name, p in model.named_parameters():  # the final weights, in bf16
        ours = state["model"][name.removeprefix("model.")]
        assert torch.equal(p.detach(), ours.bfloat16()), name
