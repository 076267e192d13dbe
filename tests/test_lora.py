"""LoRA (mini_grpo/lora.py) on tiny models: exact at init, only adapters train, the base
with adapters off, merge, PEFT-format files in and out, bad input named."""

import copy
import json

import pytest
import torch
from conftest import tiny_gpt

from mini_grpo.lora import (
    adapters_disabled,
    apply_lora,
    load_adapter,
    lora_state_dict,
    merged_state_dict,
    save_adapter,
)
from mini_grpo.models import Llama, LlamaConfig
from mini_grpo.optim import make_optimizer

IDS = torch.tensor([[1, 5, 6, 7, 8, 9], [1, 9, 10, 11, 3, 4]])


def tiny_llama(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(LlamaConfig(vocab_size=32, block_size=64, n_layer=2, n_head=4, n_kv_head=2,
                             n_embd=64, n_inner=96, head_dim=16, qkv_bias=True))


MODELS = {"llama": tiny_llama, "gpt": lambda: tiny_gpt(vocab_size=32)}


def logits(m):
    with torch.no_grad():
        return m(IDS)


def train_step(m, lr=1e-2):
    opt = make_optimizer(m, lr)
    loss = m(IDS).float().logsumexp(-1).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("family", MODELS)
def test_lora_is_exact_at_init_and_trains_only_its_adapters(family):
    base = MODELS[family]()
    m = copy.deepcopy(base)
    names = apply_lora(m, r=4, alpha=8)
    assert names and all(n.rsplit(".", 1)[-1] in
                         {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                          "down_proj", "c_attn", "c_proj", "c_fc"} for n in names)
    assert torch.equal(logits(m), logits(base))  # B = 0: the base model exactly
    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    train_step(m)
    after = m.state_dict()
    for k, v in before.items():
        if ".lora_" not in k:
            assert torch.equal(after[k], v), k  # every base weight bit-identical
    assert any(not torch.equal(after[k], before[k]) for k in lora_state_dict(m))
    assert not torch.allclose(logits(m), logits(base))
    with adapters_disabled(m):  # the reference policy: the base, after training too
        assert torch.equal(logits(m), logits(base))
    assert not torch.allclose(logits(m), logits(base))  # on again on exit


@pytest.mark.parametrize("family", MODELS)
def test_merged_weights_load_into_a_plain_model(family):
    m = MODELS[family]()
    apply_lora(m, r=4, alpha=8)
    train_step(m)
    live = {k: v.clone() for k, v in m.state_dict().items()}
    plain = MODELS[family]()
    plain.load_state_dict(merged_state_dict(m))
    torch.testing.assert_close(logits(plain), logits(m), atol=1e-5, rtol=1e-5)
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in live.items())  # unchanged


@pytest.mark.parametrize("family", MODELS)
def test_a_saved_adapter_loads_onto_its_base_in_peft_format(family, tmp_path):
    base = MODELS[family]()
    m = copy.deepcopy(base)
    apply_lora(m, r=4, alpha=8)
    train_step(m)
    save_adapter(m, tmp_path / "adapter", base_model="some/base")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["task_type"]) == \
        ("LORA", 4, 8.0, "CAUSAL_LM")
    assert config["fan_in_fan_out"] == (family == "gpt")
    from safetensors.torch import load_file
    keys = set(load_file(str(tmp_path / "adapter" / "adapter_model.safetensors")))
    if family == "llama":
        assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
        assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in keys
    else:
        assert "base_model.model.transformer.h.0.attn.c_attn.lora_A.weight" in keys
        assert "base_model.model.transformer.h.1.mlp.c_fc.lora_B.weight" in keys
    fresh = copy.deepcopy(base)
    load_adapter(fresh, tmp_path / "adapter")
    assert torch.equal(logits(fresh), logits(m))


def test_bad_options_and_adapters_for_another_base_are_named(tmp_path):
    with pytest.raises(ValueError, match="lora_target_modules: no module named 'qkv'"):
        apply_lora(tiny_llama(), r=4, alpha=8, targets=["qkv"])
    with pytest.raises(ValueError, match="lora_r: 65 is larger than"):
        apply_lora(tiny_llama(), r=65, alpha=8)
    with pytest.raises(ValueError, match="lora_r: must be a positive integer"):
        apply_lora(tiny_llama(), r=0, alpha=8)
    m = tiny_llama()
    apply_lora(m, r=4, alpha=8)
    save_adapter(m, tmp_path / "a")
    wider = Llama(LlamaConfig(vocab_size=32, block_size=64, n_layer=2, n_head=4, n_kv_head=2,
                              n_embd=128, n_inner=96, head_dim=32, qkv_bias=True))
    with pytest.raises(ValueError, match="q_proj.lora_A.weight has shape"):
        load_adapter(wider, tmp_path / "a")
    deeper = Llama(LlamaConfig(vocab_size=32, block_size=64, n_layer=3, n_head=4, n_kv_head=2,
                               n_embd=64, n_inner=96, head_dim=16, qkv_bias=True))
    with pytest.raises(ValueError, match="missing base_model.model.model.layers.2"):
        load_adapter(deeper, tmp_path / "a")
    (tmp_path / "a" / "adapter_config.json").write_text('{"r": -1}')
    with pytest.raises(ValueError, match="adapter_config.json: r must be a positive integer"):
        load_adapter(tiny_llama(), tmp_path / "a")
