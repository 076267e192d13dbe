"""Gemma 3 (text) in our Gemma class, against transformers as the oracle: a tiny random model
saved locally with save_pretrained (nothing downloaded), with its sliding window (4) shorter
than the sequences, so that it matters, query_pre_attn_scalar unlike head_dim, each layer
kind with its own RoPE base, and the norm weights randomised (a fresh Gemma norm's are 0)."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from test_llama import (  # noqa: E402
    V,
    check_shared_pass,
    full_pass,
    hf_greedy,
    hf_logits,
    ragged,
)

from mini_grpo.checkpoint import CheckpointError  # noqa: E402
from mini_grpo.engines.native import generate  # noqa: E402
from mini_grpo.models import attention_mask, build, positions, spec  # noqa: E402
from mini_grpo.models.hf import load_hf_model, save_hf  # noqa: E402

WINDOW = 4
CONFIG = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              query_pre_attn_scalar=24, sliding_window=WINDOW,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                               "full_attention": {"rope_type": "default",
                                                  "rope_theta": 50000.0}},
              max_position_embeddings=128, initializer_range=0.1, rms_norm_eps=1e-6,
              pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)


def make_hf(seed=0, **changes):
    cfg = transformers.Gemma3TextConfig(**{**CONFIG, **changes})
    torch.manual_seed(seed)
    hf = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.ndim == 1:  # norms: (1 + w) with w ~ N(0, 0.3), not a fresh model's 0
                torch.nn.init.normal_(p, 0.0, 0.3)
    return hf


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    hf = make_hf()
    path = tmp_path_factory.mktemp("gemma3") / "hf"
    hf.save_pretrained(path)
    return hf, path


def test_logits_match_transformers_past_the_sliding_window(saved):
    hf, path = saved
    ours = load_hf_model(path).eval()
    assert ours.family == "gemma" and ours.lm_head.weight is ours.embed_tokens.weight
    assert [b.self_attn.window for b in ours.layers] == [WINDOW, None, WINDOW]
    idx, valid = ragged()  # rows of 12, 9 and 5 real tokens: longer than the window
    with torch.no_grad():
        want = hf_logits(hf, idx, valid)
        got = full_pass(ours, idx, valid)
    assert want[valid].std() > 0.3
    torch.testing.assert_close(got[valid], want[valid], rtol=0, atol=1e-5)
    with torch.no_grad():  # unpadded, no mask
        torch.testing.assert_close(ours(idx[:1]), hf(idx[:1]).logits, rtol=0, atol=1e-5)
    # the window, the scalar and the local RoPE base each change the logits: none is inert
    for change in (dict(sliding_window=64), dict(query_pre_attn_scalar=16)):
        other = make_hf(**change)
        with torch.no_grad():
            assert (hf_logits(other, idx, valid) - want)[valid].abs().max() > 1e-3, change


def test_kv_cache_and_shared_prompt_passes_equal_the_full_pass(saved):
    hf, path = saved
    ours = load_hf_model(path).eval()
    idx, valid = ragged()
    B, T = idx.shape
    pos = positions(valid)
    with torch.no_grad():
        full = full_pass(ours, idx, valid)
        cache = ours.new_cache(B, T)
        steps = [ours(idx[:, :3], pos[:, :3], attention_mask(valid[:, :3], 3), cache)]
        for t in range(3, T):
            steps.append(ours(idx[:, t:t + 1], pos[:, t:t + 1],
                              attention_mask(valid[:, :t + 1], 1), cache))
    torch.testing.assert_close(torch.cat(steps, 1)[valid], full[valid], rtol=0, atol=1e-5)
    # the shared-prompt pass (prompts 6 and 3, completions 7: past the window), gradients
    # too, and transformers' pass
    check_shared_pass(ours, hf, hf_atol=1e-5)


def test_greedy_generation_equals_transformers_past_the_window(saved):
    hf, path = saved
    hf.generation_config.eos_token_id = None
    ours = load_hf_model(path).eval()
    a = [5, 17, 42, 8, 9, 23]
    head = list(range(3, 21))  # 18 tokens every prompt starts with: the sampler's shared
    # prefix (native.SHARED_PREFIX_MIN), whose layout pads the rows after it, mid-row
    shared = [head + a, head + [77], head + [31, 4, 60]]
    for prompts in ([a], [a, [77], a, [31, 4, 60]], shared):
        for use_cache in (True, False):
            r = generate(ours, prompts, 10, eos_id=-1, pad_id=0, greedy=True,
                         use_cache=use_cache)
            with torch.no_grad():
                want, want_lp = hf_greedy(hf, prompts, 10)
            assert r.completion_ids.tolist() == want.tolist(), (prompts, use_cache)
            torch.testing.assert_close(r.logprobs, want_lp, rtol=0, atol=1e-4)


def test_saved_back_and_built_from_its_spec_it_loads_in_transformers(saved, tmp_path):
    hf, path = saved
    ours = load_hf_model(path).eval()
    idx, valid = ragged()
    with torch.no_grad():
        want = full_pass(ours, idx, valid)
    for name, model in (("loaded", ours), ("rebuilt", build(spec(ours)))):
        if name == "rebuilt":  # our own config.json, not the one it was loaded with
            model.load_state_dict(ours.state_dict())
            del model.hf_config
        save_hf(model, tmp_path / name, dtype=torch.float32)
        back = transformers.Gemma3ForCausalLM.from_pretrained(tmp_path / name).eval()
        with torch.no_grad():
            torch.testing.assert_close(hf_logits(back, idx, valid)[valid], want[valid],
                                       rtol=0, atol=1e-5, msg=name)


def test_a_hub_style_config_is_read_and_gemma_2_s_is_refused(saved, tmp_path):
    """The hub's config.json spelling (rope_theta, rope_local_base_freq, sliding_window_pattern,
    no layer_types) reads as transformers 5's; softcapping (Gemma 2) is refused by name."""
    hf, path = saved
    config = json.loads((path / "config.json").read_text())
    hub = {k: v for k, v in config.items() if k not in ("layer_types", "rope_parameters")}
    hub.update(rope_theta=50000.0, rope_local_base_freq=100.0, sliding_window_pattern=2)
    d = tmp_path / "hub"
    d.mkdir()
    (d / "model.safetensors").symlink_to(path / "model.safetensors")
    (d / "config.json").write_text(json.dumps(hub))
    a, b = load_hf_model(path).cfg, load_hf_model(d).cfg
    assert a == b
    (d / "config.json").write_text(json.dumps({**hub, "final_logit_softcapping": 30.0}))
    with pytest.raises(CheckpointError, match="final_logit_softcapping is not supported"):
        load_hf_model(d)
    (d / "config.json").write_text(json.dumps({**config, "layer_types": ["full_attention"]}))
    with pytest.raises(CheckpointError, match="layer_types must name each of the 3 layers"):
        load_hf_model(d)


def test_manual_attention_and_gradient_checkpointing_change_nothing(saved):
    ours = load_hf_model(saved[1])
    idx, valid = ragged()
    with torch.no_grad():
        want = full_pass(ours.eval(), idx, valid)
    ours.attn_impl = "manual"  # matmul-softmax with the windowed mask, the scale its own
    with torch.no_grad():
        torch.testing.assert_close(full_pass(ours, idx, valid)[valid], want[valid], rtol=0,
                                   atol=1e-5)
    ours.attn_impl, ours.gradient_checkpointing = "sdpa", True
    ours.train()
    got = full_pass(ours, idx, valid)
    torch.testing.assert_close(got[valid].detach(), want[valid], rtol=0, atol=1e-5)
    got[valid].square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in ours.parameters())


def test_a_checkpoint_s_gemma_spec_is_checked_before_anything_is_built(saved):
    from mini_grpo.models import model_config

    good = spec(load_hf_model(saved[1]))
    assert model_config(good).layer_types == CONFIG["layer_types"]
    for change, needle in ((dict(layer_types=["full_attention"]), "layer_types: must name"),
                           (dict(layer_types=["full_attention", "global", "x"]), "layer_types"),
                           (dict(sliding_window=0), "sliding_window: must be at least 1"),
                           (dict(head_dim=15), "head_dim: 15 must be even")):
        bad = {**good, "config": {**good["config"], **change}}
        with pytest.raises(ValueError, match=needle):
            model_config(bad)


PIECES = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>",
          *[f"<0x{b:02X}>" for b in range(256)], "\u2581", "  ", *"abcdefghij0123456789+=?",
          "\u2581a", "ab", "\u2581ab", "12", "123", "\u25811", "\u258112", "cd", "abcd", "+1"]


def gemma_gguf(path, hf):
    """A Gemma 3 GGUF file, written by hand as llama.cpp's converter writes one: its norms
    stored as (1 + w), a SentencePiece vocabulary without merges (tokenizer.ggml.model
    llama), control and byte tokens typed, and none of the keys llama.cpp does not store
    (the local RoPE base, the layer pattern, query_pre_attn_scalar)."""
    gguf = pytest.importorskip("gguf")
    c = hf.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    w.add_sliding_window(c.sliding_window)
    tokens = PIECES + [f"<unused{i}>" for i in range(c.vocab_size - len(PIECES))]
    types = [3] * 7 + [6] * 256 + [1] * (len(PIECES) - 263) + [5] * (c.vocab_size - len(PIECES))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm",
             "post_feedforward_layernorm": "post_ffw_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        stem = name.removeprefix("model.").removesuffix(".weight")
        if stem.startswith("layers."):
            _, i, rest = stem.split(".", 2)
            theirs = f"blk.{i}.{names[rest]}.weight"
        else:
            theirs = {"embed_tokens": "token_embd", "norm": "output_norm"}[stem] + ".weight"
        a = t.detach().float() + (1.0 if name.endswith("norm.weight") else 0.0)
        w.add_tensor(theirs, a.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_gemma_3_gguf_file_loads_as_transformers_loads_it_and_goes_out_again(tmp_path,
                                                                               saved):
    """Our GGUF import of Gemma 3 (names, norm shift, llama.cpp's rules for what the file does
    not say, the SentencePiece vocabulary rebuilt as a BPE with byte fallback) gives the
    logits and the token ids of transformers' own GGUF loader. transformers reads no
    query_pre_attn_scalar (its default, 256) and llama.cpp takes the head size: equal here."""
    from mini_grpo.models.gguf import load_gguf

    hf = make_hf(head_dim=256, num_attention_heads=2, num_key_value_heads=1, vocab_size=320,
                 query_pre_attn_scalar=256, num_hidden_layers=6, layer_types=None,
                 rope_parameters={"sliding_attention": {"rope_type": "default",
                                                        "rope_theta": 10000.0},
                                  "full_attention": {"rope_type": "default",
                                                     "rope_theta": 1e6}})
    assert hf.config.layer_types[5] == "full_attention"  # the pattern: each 6th layer
    file = gemma_gguf(tmp_path / "g.gguf", hf)
    ours, tok = load_gguf(file)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=file.name, dtype=torch.float32).eval()
    their_tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=file.name)
    ids = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = theirs(ids).logits
        torch.testing.assert_close(ours.eval()(ids), want, rtol=0, atol=1e-5)
        torch.testing.assert_close(want, hf(ids).logits, rtol=0, atol=1e-5)  # and the source
    for text in ["ab abcd 123+12=?", "  a  b", "j\u00e9 k\n", "<start_of_turn>a"]:
        mine = tok.encode(text)
        assert mine == their_tok(text, add_special_tokens=False)["input_ids"], text
        assert tok.encode(text, bos=True) == [2, *mine]  # the file's add_bos_token, as llama.cpp
        assert tok.decode(tok.encode(text)) == their_tok.decode(
            their_tok(text)["input_ids"], skip_special_tokens=True), text
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (2, 1, 0)
    saved_dir = saved[1]  # a window pattern and a scalar llama.cpp's files cannot say
    # and out again: our export reads back, in transformers and here, as the file it came from
    from mini_grpo.models.gguf import write_gguf

    out = write_gguf(ours, tok, tmp_path / "out" / "ours.gguf", "f32")
    again, tok2 = load_gguf(out)
    back = transformers.AutoModelForCausalLM.from_pretrained(
        out.parent, gguf_file=out.name, dtype=torch.float32).eval()
    back_tok = transformers.AutoTokenizer.from_pretrained(out.parent, gguf_file=out.name)
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(again.eval()(ids), want, rtol=0, atol=1e-5)
    for text in ["ab abcd 123+12=?", "  a  b", "j\u00e9 k\n", "<start_of_turn>a"]:
        assert tok2.encode(text, bos=True) == tok.encode(text, bos=True), text
        assert back_tok(text, add_special_tokens=False)["input_ids"] == tok.encode(text), text
    with pytest.raises(ValueError, match="llama.cpp's Gemma 3 has each 6th layer full"):
        write_gguf(load_hf_model(saved_dir), tok, tmp_path / "x.gguf")


@pytest.mark.parametrize("lora", [False, True])
def test_a_gemma_directory_trains_with_sft_and_grpo_and_exports(tmp_path, lora):
    """Full fine-tuning and LoRA from a tiny Gemma 3 directory (window 8, shorter than its
    prompts): SFT then GRPO steps run, the weights move, and the export loads in transformers
    with our logits."""
    from conftest import tiny, tiny_lm_dir

    from mini_grpo.checkpoint import list_checkpoints, load_checkpoint
    from mini_grpo.job import train

    lm = tiny_lm_dir(tmp_path / "gemma", "gemma3_text")
    out = tmp_path / "run"
    over = dict(lora_r=4, lora_alpha=8, lr=1e-3) if lora else {}
    train(tiny(out, init_from=str(lm), mode="sft_grpo", sft_steps=3, max_steps=2,
               block_size=256, **over))
    ckpt = load_checkpoint(list_checkpoints(out / "checkpoints")[-1])
    assert ckpt["step"] == 2 and ckpt["model_spec"]["family"] == "gemma"
    start = load_hf_model(lm).state_dict()
    final = load_hf_model(out / "hf").state_dict()
    assert any(not torch.equal(start[k], final[k]) for k in start), "nothing moved"
    ids = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, load_hf_model(out / "hf").eval()(ids),
                                   rtol=0, atol=1e-4)
