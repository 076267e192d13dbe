"""HFTokenizer against transformers as an independent oracle: tiny tokenizers built and saved
locally (nothing downloaded), encoded, decoded and chat-templated both ways."""

import json
import re

import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from mini_grpo.tokenizer import HFTokenizer  # noqa: E402

CORPUS = ["the board after e2e4 is a position", "write the FEN of the final position",
          "rnbqkbnr/pppppppp/8/8/4P3/8/PPPP1PPP/RNBQKBNR b KQkq - 0 1", "héllo wörld ünïcode"]

# ChatML, as Qwen2.5 writes it: a default system message, <|im_start|>role ... <|im_end|>
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Llama 3 style: bos_token first, header ids, trimmed content, loop controls
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}{% if message['content'] is not string %}"
    "{{ raise_exception('content must be text') }}{% endif %}"
    "{% if message['role'] == 'ignored' %}{% continue %}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
    "+ message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}{{ {'x': 'ü'} | tojson }}")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|eot_id|>",
            "<|start_header_id|>", "<|end_header_id|>"]


def save_tiny(tmp_path, name, template, bos, eos, pad, bos_processor=False, gen_eos=None):
    """A byte-level BPE trained on CORPUS, wrapped and saved by transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos_processor:  # Llama-style: the post-processor puts BOS first
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tk.token_to_id(bos))])
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=bos,
                                              eos_token=eos, pad_token=pad)
    hf.chat_template = template
    out = tmp_path / name
    hf.save_pretrained(out)
    if gen_eos is not None:
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": gen_eos}))
    return out, hf


MESSAGES = [[{"role": "user", "content": "e2e4 e7e5: the FEN?"}],
            [{"role": "system", "content": "Answer in FEN."},
             {"role": "user", "content": "  g1f3 ünï  "},
             {"role": "assistant", "content": "rnbqkbnr/8 w"},
             {"role": "user", "content": "and now?"}]]


@pytest.mark.parametrize("kind", ["chatml", "llama3"])
def test_encode_decode_and_chat_template_match_transformers(tmp_path, kind):
    if kind == "chatml":  # Qwen: no BOS, pad = eos
        path, hf = save_tiny(tmp_path, kind, CHATML, None, "<|im_end|>", "<|endoftext|>")
    else:  # Llama 3: BOS by the post-processor, no pad, a second EOS in generation_config
        path, hf = save_tiny(tmp_path, kind, LLAMA3, "<|begin_of_text|>", "<|endoftext|>",
                             None, bos_processor=True, gen_eos=[1, 4])
    ours = HFTokenizer.from_dir(path)
    assert ours.vocab_size == len(hf)
    for text in CORPUS + ["unseen wörds 123"]:
        assert ours.encode(text, bos=True) == hf(text)["input_ids"]
        assert ours.encode(text) == hf(text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ours.encode(text)) == hf.decode(hf(text)["input_ids"],
                                                          skip_special_tokens=True)
    for messages in MESSAGES:
        for gen in (True, False):
            want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == want
    if kind == "chatml":
        assert ours.bos_id is None and ours.pad_id == hf.pad_token_id
        assert ours.eos_ids == [hf.eos_token_id]
    else:
        assert ours.bos_id == hf.bos_token_id and ours.pad_id == ours.eos_id  # pad falls back
        assert ours.eos_ids == [hf.eos_token_id, 1, 4]  # generation_config adds its EOS ids
        with pytest.raises(Exception, match="content must be text"):
            ours.apply_chat_template([{"role": "user", "content": ["not", "text"]}])


def test_decode_stops_at_any_eos_and_round_trips_through_save(tmp_path):
    path, _ = save_tiny(tmp_path, "t", CHATML, None, "<|im_end|>", None, gen_eos=[0])
    tok = HFTokenizer.from_dir(path)
    ids = tok.encode("the board")
    assert tok.decode(ids + [tok.eos_id] + tok.encode("after")) == "the board"
    assert tok.decode(ids + [0] + ids) == "the board"  # <|endoftext|>, the generation EOS
    tok.save_pretrained(tmp_path / "again")
    again = HFTokenizer.from_dir(tmp_path / "again")
    assert again.encode("write the FEN") == tok.encode("write the FEN")
    assert again.apply_chat_template(MESSAGES[0]) == tok.apply_chat_template(MESSAGES[0])


def test_sandboxed_templates_and_bad_directories(tmp_path):
    path, _ = save_tiny(tmp_path, "evil", "{{ ''.__class__.__mro__[1].__subclasses__() }}",
                        None, "<|im_end|>", None)
    from mini_grpo.chat_template import ChatTemplateError

    with pytest.raises(ChatTemplateError, match="evil/chat_template.jinja, template line 1: "
                                                "chat template: SecurityError: access to "
                                                "attribute '__class__'"):
        HFTokenizer.from_dir(path).apply_chat_template(MESSAGES[0])
    with pytest.raises(ValueError, match="no tokenizer.json"):
        HFTokenizer.from_dir(tmp_path)
    no_eos, _ = save_tiny(tmp_path, "no_eos", None, None, None, None)
    with pytest.raises(ValueError, match="^" + re.escape(f"{no_eos}: no EOS token (eos_token "
                                                          f"in tokenizer_config.json")):
        HFTokenizer.from_dir(no_eos)
    (path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        HFTokenizer.from_dir(path)
