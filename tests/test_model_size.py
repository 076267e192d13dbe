"""A model's size against this machine's memory, counted from its config before anything is
built: our GPT from the config's fields and a Hugging Face directory's config.json go through
the same check (models.check_size); absurd sizes are one line and exit 2, at once."""

import subprocess
import sys
import types
from dataclasses import asdict

import pytest
import torch
from conftest import ROOT, clean_env, tiny

from mini_grpo import models, run
from mini_grpo.checkpoint import CheckpointError
from mini_grpo.config import ConfigError, load_config
from mini_grpo.models import GPTConfig, LlamaConfig, build, check_size
from mini_grpo.policy import build_policy, gpt_spec

GIB = 2**30


@pytest.mark.parametrize("cfg", [
    GPTConfig(vocab_size=40, block_size=64, n_layer=3, n_head=2, n_embd=32),
    GPTConfig(vocab_size=40, block_size=16, n_layer=1, n_head=1, n_embd=8, n_inner=20,
              tie_word_embeddings=False),
    LlamaConfig(vocab_size=50, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                head_dim=8, n_inner=48),
    LlamaConfig(vocab_size=50, block_size=32, n_layer=2, n_head=4, n_kv_head=1, n_embd=32,
                head_dim=12, n_inner=40, qkv_bias=True, o_bias=True, mlp_bias=True,
                qk_norm=True, tie_word_embeddings=True),
])
def test_param_count_from_the_config_equals_the_built_model(cfg):
    family = "gpt" if isinstance(cfg, GPTConfig) else "llama"
    with torch.device("meta"):
        model = build({"family": family, "config": asdict(cfg)})
    assert cfg.param_count() == sum(p.numel() for p in model.parameters())


def test_the_issues_absurd_sizes_are_refused_from_the_config_alone(monkeypatch):
    """On a 24 GiB machine: n_embd 10^6 (a 12 TB c_attn weight alone) and 100,000 layers."""
    monkeypatch.setattr(models, "memory_bytes", lambda: 24 * GIB)
    for over in ({"n_embd": "1000000", "n_head": "1"}, {"n_layer": "100000"}):
        spec = gpt_spec(load_config("default", over, env={}), 40)
        with pytest.raises(ValueError) as e:
            check_size(spec, "n_layer/n_embd/block_size")
        want = "174.6 TiB" if "n_embd" in over else "294.2 GiB"
        assert str(e.value) == (f"n_layer/n_embd/block_size: the model would hold {want} of "
                                f"parameters (+ gradients and AdamW state to train), more than "
                                f"this machine's memory (24.0 GiB)")
    check_size(gpt_spec(load_config("default", env={}), 40), "n_layer")  # 3.2M: fits
    # a config.json's sizes can be any integer: too many bytes for a float is still one line
    # (the long fuzz profile found an OverflowError here)
    spec = gpt_spec(load_config("default", env={}), 40)
    spec["config"].update(n_embd=10**160, n_head=1)  # 10^320 bytes: no float holds it
    with pytest.raises(ValueError, match="would hold over 1,048,576 TiB of parameters"):
        check_size(spec, "config.json")
    monkeypatch.setattr(models, "memory_bytes", lambda: None)  # a platform that cannot say
    check_size(gpt_spec(load_config("default", {"n_layer": "100000"}, env={}), 40), "n_layer")


def test_memory_bytes_is_this_machines_or_unknown():
    mem = models.memory_bytes()
    assert mem is None or 2**28 < mem < 2**50


def test_build_policy_refuses_before_building(monkeypatch):
    """Every path into a run (the benchmark's too) goes through build_policy: the check runs
    before a module is constructed, so 100,000 layers fail at once."""
    monkeypatch.setattr(models, "memory_bytes", lambda: 24 * GIB)
    monkeypatch.setattr(run, "build", lambda spec: pytest.fail("built"))
    data = types.SimpleNamespace(alphabet="abcdef")
    with pytest.raises(ConfigError, match="n_layer/n_embd/block_size: the model would hold"):
        build_policy(tiny(None, n_layer=100000, n_embd=1024), data)


def test_a_hugging_face_directory_bigger_than_memory_is_refused(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from conftest import tiny_lm_dir

    from mini_grpo.models.hf import load_hf_model

    path = tiny_lm_dir(tmp_path / "lm")
    n = load_hf_model(path).num_params()
    monkeypatch.setattr(models, "memory_bytes", lambda: 4 * n - 1)  # fp32 does not fit
    with pytest.raises(CheckpointError, match=f"{path}/config.json: the model would hold"):
        load_hf_model(path, dtype=torch.float32)
    load_hf_model(path, dtype=torch.bfloat16)  # 2 bytes a parameter do


@pytest.mark.parametrize("args", [["--n_embd=1000000", "--n_head=1"],
                                  ["--n_layer=100000", "--n_embd=4096"]])
def test_the_cli_exits_2_with_one_line_before_any_work(tmp_path, args):
    """Sizes no machine holds (174 TiB; 73 TiB): exit 2 and one line, before the task's data
    is built or the run directory made."""
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, str(ROOT / "distributed_train.py"), *args,
                        f"--out_dir={out}"], capture_output=True, text=True, cwd=ROOT,
                       env=clean_env(), timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: n_layer/n_embd/block_size: the model would hold"), r.stderr[-2000:]
    assert "TiB of parameters" in lines[0] and not out.exists()
