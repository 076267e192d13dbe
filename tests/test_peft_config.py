"""adapter_config.json is read by allowlist (mini_grpo/lora.py): an option that is not plain
LoRA on an unchanged base, or a key nobody decided on, is refused naming it; what we and
PEFT write loads."""

import dataclasses
import json

import pytest
from conftest import tiny_gpt

from mini_grpo.lora import ADAPTER_TYPES, PLAIN_LORA, apply_lora, load_adapter, save_adapter

# LoraConfig fields refused at every value: to_dict drops it, PEFT's own loader discards it
REFUSED = {"runtime_config"}


@pytest.fixture
def adapter(tmp_path):
    m = tiny_gpt(vocab_size=32)
    apply_lora(m, r=4, alpha=8)
    save_adapter(m, tmp_path / "a", base_model="some/base")
    return tmp_path / "a"


def load_with(adapter, **changes):
    path = adapter / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return load_adapter(tiny_gpt(vocab_size=32), adapter)


def test_what_save_adapter_writes_loads(adapter):
    assert load_with(adapter)


@pytest.mark.parametrize("init", ["pissa", "olora", "corda", "loftq"])
def test_an_adapter_made_on_a_base_peft_changed_is_refused(adapter, init):
    """PEFT subtracts these inits' first B A from the base: on the plain base the adapter
    gives other logits."""
    with pytest.raises(ValueError, match=f"adapter_config.json: init_lora_weights '{init}' "
                                         f"is not supported"):
        load_with(adapter, init_lora_weights=init)


@pytest.mark.parametrize("key", ["arrow_config", "use_bdlora", "kasa_config",
                                 "monteclora_config", "velora_config"])
def test_peft_0_21s_options_load_only_when_off(adapter, key):
    assert load_with(adapter, **{key: None})  # what PEFT writes when the option is off
    with pytest.raises(ValueError, match=f"adapter_config.json: {key} .* is not supported"):
        load_with(adapter, **{key: {"r": 2}})


@pytest.mark.parametrize("changes, named", [
    ({"lora_magic": 1}, "key 'lora_magic' 1"), ({"a\nb": 1}, r"key 'a\\nb' 1"),
    ({"runtime_config": {}}, "key 'runtime_config' {}"), ({"task_type": 3}, "task_type 3")])
def test_unknown_keys_and_values_of_the_wrong_type_are_one_line(adapter, changes, named):
    with pytest.raises(ValueError, match=f"adapter_config.json: {named} is not supported") as e:
        load_with(adapter, **changes)
    assert "\n" not in str(e.value)


def test_every_lora_config_field_of_the_installed_peft_is_decided():
    """A new PEFT option fails here until someone adds it to PLAIN_LORA with the values
    that leave plain LoRA, or to ADAPTER_TYPES if it only describes the adapter."""
    import peft

    allowed = PLAIN_LORA.keys() | ADAPTER_TYPES.keys()
    assert not REFUSED & allowed
    undecided = {f.name for f in dataclasses.fields(peft.LoraConfig)} - allowed - REFUSED
    assert not undecided, f"peft {peft.__version__}'s LoraConfig: {sorted(undecided)}"


def test_a_stock_peft_config_loads(adapter):
    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc"],
                             fan_in_fan_out=True).to_dict()
    # as save_pretrained writes it: sets as lists
    (adapter / "adapter_config.json").write_text(json.dumps(config, default=list))
    assert load_adapter(tiny_gpt(vocab_size=32), adapter)
