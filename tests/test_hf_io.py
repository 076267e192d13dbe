"""GPT-2 checkpoints into our GPT, against transformers as the oracle: tiny random models
saved locally with save_pretrained (nothing downloaded)."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from mini_grpo.checkpoint import CheckpointError  # noqa: E402
from mini_grpo.engines.native import generate  # noqa: E402
from mini_grpo.logprobs import completion_logprobs  # noqa: E402
from mini_grpo.models.hf import load_hf_model  # noqa: E402


def tiny_gpt2(tmp_path, name="gpt2", shard=None, **kw):
    """A 2-layer, 64-wide GPT-2 with random weights, saved as safetensors."""
    cfg = transformers.GPT2Config(vocab_size=96, n_positions=64, n_embd=64, n_layer=2,
                                  n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  **kw)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    out = tmp_path / name
    hf.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    return hf, out


@pytest.mark.parametrize("kw", [{}, {"activation_function": "gelu", "n_inner": 96,
                                     "layer_norm_epsilon": 1e-6}])
def test_gpt2_logits_match_transformers(tmp_path, kw):
    hf, path = tiny_gpt2(tmp_path, **kw)
    ours = load_hf_model(path).eval()
    assert ours.lm_head.weight is ours.wte.weight  # tied, as GPT-2 is
    idx = torch.randint(0, 96, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(idx).logits
        got = ours(idx)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)


def test_gpt2_keeps_what_makes_our_trainer_fast_and_right(tmp_path):
    """KV-cached sampling from a loaded GPT-2 gives the log-probs of the shared-prompt pass
    and of transformers' own forward over prompt + completion."""
    hf, path = tiny_gpt2(tmp_path)
    ours = load_hf_model(path).eval()
    prompts = [[5, 6, 7, 8], [9, 10]]
    r = generate(ours, prompts, 8, eos_id=-1, pad_id=0,
                 generator=torch.Generator().manual_seed(0))
    lp = completion_logprobs(ours, r.prompt_ids, r.prompt_mask, r.completion_ids,
                             r.completion_mask)
    torch.testing.assert_close(lp, r.logprobs, rtol=0, atol=1e-5)
    for i, p in enumerate(prompts):  # transformers alone, one unpadded row at a time
        seq = torch.tensor([p + r.completion_ids[i].tolist()])
        with torch.no_grad():
            logp = hf(seq).logits.log_softmax(-1)[0, len(p) - 1:-1]
        want = logp.gather(-1, seq[0, len(p):, None]).squeeze(-1)
        torch.testing.assert_close(lp[i], want, rtol=0, atol=1e-5)


def test_sharded_weights_and_dtype(tmp_path):
    hf, path = tiny_gpt2(tmp_path, shard="100KB")
    assert (path / "model.safetensors.index.json").is_file()
    ours = load_hf_model(path, dtype=torch.bfloat16)
    assert ours.wte.weight.dtype == torch.bfloat16
    torch.testing.assert_close(ours.blocks[1].mlp.c_fc.weight.float(),
                               hf.transformer.h[1].mlp.c_fc.weight.t().bfloat16().float())


def test_bad_model_directories_are_named(tmp_path):
    hf, path = tiny_gpt2(tmp_path)
    config = json.loads((path / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no config.json"):
        load_hf_model(tmp_path)
    (path / "config.json").write_text(json.dumps({**config, "model_type": "bert",
                                                  "architectures": ["BertModel"]}))
    with pytest.raises(CheckpointError, match="'bert' \\(BertModel\\) is not supported "
                                              "\\(supported: gpt2, llama, qwen2, "):
        load_hf_model(path)
    # a config that asks for more than its weights hold: refused before anything is read
    (path / "config.json").write_text(json.dumps({**config, "n_layer": 10**9}))
    with pytest.raises(CheckpointError, match="says n_layer 1000000000, its weights hold 2"):
        load_hf_model(path)
    (path / "config.json").write_text(json.dumps({**config, "n_embd": 128}))
    with pytest.raises(CheckpointError, match="says n_embd 128, its weights hold 64"):
        load_hf_model(path)
    (path / "config.json").write_text(json.dumps({**config, "n_inner": 128}))
    with pytest.raises(CheckpointError, match="mismatched weights: blocks.0.mlp.c_fc.weight"):
        load_hf_model(path)
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="cannot read safetensors"):
        load_hf_model(path)
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="never pickles"):
        load_hf_model(path)


@pytest.mark.parametrize("activation", ["gelu", "gelu_new"])
def test_our_gpt_saved_as_gpt2_loads_in_transformers_with_the_same_logits(tmp_path,
                                                                          activation):
    from mini_grpo.models import GPT, GPTConfig
    from mini_grpo.models.hf import save_hf

    torch.manual_seed(0)
    ours = GPT(GPTConfig(vocab_size=44, block_size=48, n_layer=2, n_head=2, n_embd=32,
                         activation=activation)).eval()
    path = save_hf(ours, tmp_path / "hf")
    assert not list(tmp_path.glob(".hf.tmp*"))
    hf = transformers.GPT2LMHeadModel.from_pretrained(path).eval()
    idx = torch.randint(0, 44, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, ours(idx), rtol=0, atol=2e-5)
    again = load_hf_model(path).eval()  # and back
    for (k, a), b in zip(ours.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), k


def test_an_untied_gpt2_keeps_its_own_head(tmp_path):
    hf, path = tiny_gpt2(tmp_path, tie_word_embeddings=False)
    ours = load_hf_model(path).eval()
    assert ours.lm_head.weight is not ours.wte.weight
    idx = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, rtol=0, atol=2e-5)
    from mini_grpo.models.hf import save_hf

    again = transformers.GPT2LMHeadModel.from_pretrained(save_hf(ours, tmp_path / "out"))
    with torch.no_grad():
        torch.testing.assert_close(again(idx).logits, hf(idx).logits, rtol=0, atol=0)


@pytest.mark.parametrize("key", ["tie_word_embeddings", "attention_bias", "mlp_bias"])
def test_a_boolean_of_config_json_is_true_or_false_never_a_truthy_string(tmp_path, key):
    """"false" is not false: refused, not read as true (a tied head the weights never had)."""
    from conftest import tiny_lm_dir

    path = tiny_lm_dir(tmp_path / "llama", "llama") if key != "tie_word_embeddings" else \
        tiny_gpt2(tmp_path, tie_word_embeddings=False)[1]
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, key: "false"}))
    with pytest.raises(CheckpointError, match=f"config.json: {key} must be true or false, "
                                              f"got 'false'"):
        load_hf_model(path)
    (path / "config.json").write_text(json.dumps({**config, key: None}))  # null: the default
    load_hf_model(path)


def test_a_weight_in_two_shards_is_refused(tmp_path):
    """Which copy is read would be the order of the files: neither is."""
    from safetensors.torch import load_file, save_file

    _, path = tiny_gpt2(tmp_path, shard="100KB")
    first, *_, last = sorted(path.glob("model-*.safetensors"))
    a, b = load_file(first), load_file(last)
    name = next(iter(a))
    save_file({**b, name: torch.zeros_like(a[name])}, last, metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        load_hf_model(path)
    ours = name.removeprefix("transformer.").replace("h.", "blocks.", 1)
    assert str(e.value) == (f"{path}: weight {ours} is stored twice ({name} in {first.name}, "
                            f"{name} in {last.name})")


@pytest.mark.parametrize("named, want", [("bfloat16", torch.bfloat16), ("float64", torch.float32),
                                         ("auto", torch.float32), (None, torch.float32),
                                         (["float16"], torch.float32)])
def test_export_in_auto_takes_the_config_s_dtype_where_it_is_one_we_write(named, want):
    """A config.json of "float64" loaded, then ended the finished run in a traceback at its
    export (export_dtype: auto)."""
    from mini_grpo.models.hf import export_dtype

    class Model:
        hf_config = {"torch_dtype": named}

    assert export_dtype(Model()) == want
    assert export_dtype(Model(), "float16") == torch.float16
