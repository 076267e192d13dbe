"""Untrusted input that used to escape as a traceback (issue 25, and issue 22's list item 8):
model directories' JSON, chat templates, a checkpoint's tokenizer state. Each case ends in our
one-line error naming the file (exit 2 through the CLI), bounded in time and size."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, clean_env, entry, tiny_lm_dir

from mini_grpo.chat_template import ChatTemplate
from mini_grpo.checkpoint import CheckpointError
from mini_grpo.fields import ConfigError
from mini_grpo.models.hf import load_hf_model
from mini_grpo.template_bounds import MAX_CHARS
from mini_grpo.tokenizer import (
    CharTokenizer,
    HFTokenizer,
    check_model_vocab,
    tokenizer_from_state,
)

USER = [{"role": "user", "content": "e2e4 e7e5:"}]


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    pytest.importorskip("transformers")  # builds the directory
    return tiny_lm_dir(tmp_path_factory.mktemp("models") / "qwen")


def copy(lm, tmp_path, **files):
    """A copy of the tiny model directory with `files` (name: text, or None to remove)."""
    path = shutil.copytree(lm, tmp_path / "m")
    for name, text in files.items():
        if text is None:
            (path / name).unlink()
        else:
            (path / name).write_text(text)
    return path


def with_template(lm, tmp_path, template):
    """The model directory with `template` as its chat_template.jinja."""
    return copy(lm, tmp_path, **{"chat_template.jinja": template})


def refused(fn, *needles):
    """fn() raises our one-line error (an exit-2 class) containing each needle."""
    with pytest.raises((ConfigError, CheckpointError)) as e:
        fn()
    message = str(e.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message
    return message


def cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "mini_grpo", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, env=clean_env(),
                          timeout=timeout)


def one_line_exit_2(r, needle):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith("error: ") and needle in lines[0], lines


# --- model directories: one bounded JSON reader ------------------------------------------------

@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json",
                                  "generation_config.json"])
def test_deeply_nested_json_in_a_model_directory_is_named(lm, tmp_path, name):
    path = copy(lm, tmp_path, **{name: DEEP})
    load = (lambda: load_hf_model(path)) if name == "config.json" else \
        (lambda: HFTokenizer.from_dir(path))
    refused(load, f"{path / name}: nested deeper than 64 levels")
    nested = {"a": json.loads("[" * 80 + "]" * 80)}  # parses, but too deep to keep
    (path / name).write_text(json.dumps(nested))
    refused(load, f"{path / name}: nested deeper than 64 levels")


def sharded(lm, tmp_path, weight_map):
    path = copy(lm, tmp_path)
    (path / "model.safetensors").rename(path / "model-00001-of-00001.safetensors")
    (path / "model.safetensors.index.json").write_text(
        weight_map if isinstance(weight_map, str) else json.dumps({"weight_map": weight_map}))
    return path, path / "model.safetensors.index.json"


def test_a_bad_index_json_is_named(lm, tmp_path):
    path, index = sharded(lm, tmp_path, DEEP)
    refused(lambda: load_hf_model(path), f"{index}: nested deeper than 64 levels")
    index.write_text(json.dumps({"weight_map": {"lm_head.weight": 1}}))  # was a TypeError
    refused(lambda: load_hf_model(path), f"{index}: weight_map must map each tensor name")
    index.write_text(json.dumps({"weight_map": ["model-00001-of-00001.safetensors"]}))
    refused(lambda: load_hf_model(path), f"{index}: weight_map must map")
    index.write_text('{"weight_map": {"x": "model-00001-of-00001.safetensors"}')
    refused(lambda: load_hf_model(path), f"{index}:1: malformed JSON")
    index.write_text(json.dumps({"weight_map": {"x": "../m/model-00001-of-00001.safetensors"}}))
    refused(lambda: load_hf_model(path), "which is not in")
    index.write_text(json.dumps({"weight_map": {"x": "a" * 5000}}))  # fuzz: was an OSError
    refused(lambda: load_hf_model(path), "which is not in")
    index.write_text(json.dumps({"weight_map": {"x": "model-00001-of-00001.safetensors"}}))
    assert load_hf_model(path).cfg.n_layer == 2  # the good index loads


def test_other_bad_json_is_named(lm, tmp_path):
    path = copy(lm, tmp_path)
    for text, needle in [("1" * 5000, "an integer longer than"), ("[1, 2]", "got an array"),
                         ('{"a": "\\ud800"}', "not valid Unicode"),
                         (b"\xff\xfe".decode("latin-1"), "not valid UTF-8"),
                         ('{"model_type": ["qwen2"], "architectures": 3}', "is not supported")]:
        (path / "config.json").write_text(text, encoding="latin-1" if "ÿ" in text else "utf-8")
        refused(lambda: load_hf_model(path), str(path / "config.json"), needle)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "pad": "x" * (1 << 20)}))
    refused(lambda: load_hf_model(path), "too large for this file")
    gen = path / "generation_config.json"
    for eos in ("-1", "[2, 99999]", '"x"', "true"):
        gen.write_text(f'{{"eos_token_id": {eos}}}')
        refused(lambda: HFTokenizer.from_dir(path), f"{gen}: eos_token_id",
                "is not a token id of this tokenizer")


# --- tokenizer.json: the parts that run on every text, by allowlist and bounded ----------------

def with_parts(lm, tmp_path, **parts):
    """A copy of the tiny model directory whose tokenizer.json has `parts` (normalizer=...)."""
    from tokenizers import Tokenizer

    path = copy(lm, tmp_path)
    tk = Tokenizer.from_file(str(path / "tokenizer.json"))
    for name, part in parts.items():
        setattr(tk, name, part)
    tk.save(str(path / "tokenizer.json"))
    return path


def real_parts():
    """The parts as the tokenizers of real models have them."""
    from tokenizers import Regex
    from tokenizers import decoders as d
    from tokenizers import normalizers as n
    from tokenizers import pre_tokenizers as p
    from tokenizers import processors as pp

    from mini_grpo.models.gguf_vocab import _LLAMA3, _QWEN2

    bos = pp.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    sentencepiece = [d.Replace("\u2581", " "), d.ByteFallback(), d.Fuse()]
    return {
        "llama3": dict(pre_tokenizer=p.Sequence([p.Split(Regex(_LLAMA3), "isolated"),
                                                 p.ByteLevel(False, use_regex=False)]),
                       post_processor=pp.Sequence([pp.ByteLevel(), bos])),
        "qwen2": dict(normalizer=n.NFC(), pre_tokenizer=p.Sequence([
            p.Split(Regex(_QWEN2), "isolated"), p.ByteLevel(False, use_regex=False)])),
        "smollm2": dict(pre_tokenizer=p.Sequence([p.Digits(True), p.ByteLevel(False)])),
        "mistral": dict(normalizer=n.Sequence([n.Prepend("\u2581"), n.Replace(" ", "\u2581")]),
                        pre_tokenizer=None, post_processor=bos,
                        decoder=d.Sequence([*sentencepiece, d.Strip(" ", 1, 0)])),
        "gemma": dict(normalizer=n.Replace(" ", "\u2581"), pre_tokenizer=None,
                      post_processor=bos, decoder=d.Sequence(sentencepiece)),
        "metaspace": dict(pre_tokenizer=p.Metaspace(), decoder=d.Metaspace()),
    }


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "smollm2", "mistral", "gemma",
                                  "metaspace"])
def test_the_tokenizer_parts_of_real_models_load(lm, tmp_path, kind):
    tok = HFTokenizer.from_dir(with_parts(lm, tmp_path, **real_parts()[kind]))
    assert tok.encode("e2e4 e7e5 123")
    assert tokenizer_from_state(tok.state()) == tok  # and through a checkpoint


def test_a_tokenizer_json_that_multiplies_text_is_refused(lm, tmp_path):
    from tokenizers import decoders as d
    from tokenizers import normalizers as n
    from tokenizers import pre_tokenizers as p
    from tokenizers import processors as pp

    tenfold = n.Replace("a", "a" * 10)  # six in a row: "a" is a million ids; eight: an abort
    for i, (parts, needle) in enumerate([
        (dict(normalizer=n.Sequence([tenfold] * 3)), "normalizer and pre_tokenizer: may make "
                                                     "more than 100 characters of one"),
        (dict(pre_tokenizer=p.Sequence([p.ByteLevel(False)] * 4)), "more than 100"),
        (dict(decoder=d.Sequence([d.Replace("a", "a" * 10)] * 3)), "decoder: may make more"),
        (dict(post_processor=pp.TemplateProcessing(
            single="<|endoftext|> " * 100 + "$A", special_tokens=[("<|endoftext|>", 0)])),
         "post_processor: adds more than 16 ids"),
        (dict(pre_tokenizer=p.Sequence([p.ByteLevel(False), p.UnicodeScripts()])),
         "pre_tokenizer.pretokenizers[1]: type 'UnicodeScripts' is not supported"),
    ]):
        path = with_parts(lm, tmp_path / str(i), **parts)
        refused(lambda at=path: HFTokenizer.from_dir(at), f"{path / 'tokenizer.json'}: ", needle)
        state = {**HFTokenizer.from_dir(lm).state(),
                 "tokenizer.json": (path / "tokenizer.json").read_text()}
        refused(lambda at=state: tokenizer_from_state(at), "the stored tokenizer.json: ", needle)


def test_a_tokenizer_that_panics_on_a_text_is_one_line(lm, tmp_path):
    from tokenizers import Regex
    from tokenizers import pre_tokenizers as p

    # Oniguruma gives up on (a|aa)+c over 34 a's, and the library panics: a BaseException
    path = with_parts(lm, tmp_path, pre_tokenizer=p.Sequence([
        p.Split(Regex("(a|aa)+c"), "isolated"), p.ByteLevel(False)]))
    tok = HFTokenizer.from_dir(path)
    assert len(tok.encode("a" * 20)) > 0
    refused(lambda: tok.encode("a" * 40), f"{path / 'tokenizer.json'}: cannot encode a text of "
                                          f"40 characters (Onig: Regex search error")


# --- chat templates: one bounded renderer --------------------------------------------------------

def doubling(step: str, then: str) -> str:
    """ns.a (ns.b the same) doubled 22 times by `step`: 22 small values, but 2^22 items to
    hash or compare, in C where no deadline is checked (40 times: hours). It renders in a
    blink unless refused as it is built."""
    return ("{% set ns = namespace(a=[1], b=[1]) %}{% for i in range(22) %}"
            f"{{% set ns.a = {step} %}}{{% set ns.b = {step.replace('ns.a', 'ns.b')} %}}"
            "{% endfor %}" + then)


@pytest.mark.parametrize("template, needle", [
    ("{% for %}", "template line 1: chat template: TemplateSyntaxError: Expected an expression"),
    ("{% if true %}\n{{ raise_exception('Conversation roles must alternate') }}{% endif %}",
     "template line 2: the chat template refuses this conversation: Conversation roles must "
     "alternate"),
    ("{{ messages[5]['content'] }}", "UndefinedError: list object has no element 5"),
    ("{{ nothing.here }}", "UndefinedError: 'nothing' is undefined"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursion too deep"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}",
     "SecurityError: access to attribute '__class__' of 'str' object is unsafe"),
    ("{% for i in range(100001) %}{% endfor %}", "OverflowError: Range too big"),
    ("{% for i in range(10**9) %}{% endfor %}", f"a number over {MAX_CHARS}"),
    ("{{ 'x' * 10**9 }}", "a repetition ('x' * n) would be over"),
    ("{{ 2 ** 100000 }}", "a power: a number over"),
    ("{{ '%0999999999d' % 1 }}", "a formatted string would be over"),
    ("{{ '{:>99999999}'.format(1) }}", "a formatted string would be over"),
    ("{{ 'x'|center(10**9) }}", f"a number over {MAX_CHARS}"),
    ("{{ ('x' * 100000)|replace('x', 'y' * 1000) }}", "a replaced string would be over"),
    ("{{ ['x' * 100000] * 100|join }}", "TypeError"),
    ("{{ (['x'] * 100000)|join('y' * 100) }}", "a joined string would be over"),
    ("{{ ('x\n' * 100000)|indent(1000) }}", "an indented string would be over"),
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
     "{% endfor %}", "a concatenation (~) would be over"),
    ("{% for i in range(99999) %}{{ 'x' * 99 }}{% endfor %}", "writes more than"),
    ("{% macro m() %}{% for i in range(99999) %}0123456789 0123456789{% endfor %}"
     "{% endmacro %}", "ok"),  # a macro never called writes nothing
    ("{% macro m() %}{% for i in range(99999) %}0123456789 0123456789{% endfor %}"
     "{% endmacro %}{% set x = m() %}ok", "writes more than"),  # counted where it is written
    ("{% for i in range(20) %}{{ [('x' * 100000)] * 5 }}{% endfor %}", "writes more than"),
    # fuzz-style: many values, each under the bound, do not add up to gigabytes
    ("{{ ([1] * 1000)|map('center', 10**6)|list|length }}", "builds more than"),
    ("{% set big = 'x' * 10**6 %}{% for i in range(1000) %}{{ big[:-1]|length }}"
     "{% endfor %}", "builds more than"),
    ("{% set big = ['x' * 10**6] %}{{ [big, big] }}", "a tuple, list or dict would be over"),
    # a value that shares its parts is refused as it is built, by every way to build one
    *((doubling(step, then), "would be over") for step, then in (
        ("(ns.a, ns.a)", "{{ {ns.a: 1}|length }}"),  # hashed
        ("[ns.a, ns.a]", "{{ [ns.a]|select('equalto', ns.b)|list|length }}"),
        ("[ns.a] + [ns.a]", "{% for x in [ns.a, ns.b] %}{{ loop.changed(x) }}{% endfor %}"),
        ("dict(x=ns.a, y=ns.a).values()|list", "{{ [ns.a].count(ns.b) }}"),
        ("[ns.a] * 2", "{{ [ns.a].index(ns.b) }}"),
        ("cycler(ns.a, ns.a).items", "{{ [ns.a]|reject('ne', ns.b)|list|length }}"))),
    ("{% macro f(n) %}{% if n %}{{ f(n - 1, varargs, varargs) }}{% else %}"
     "{{ {varargs: 1}|length }}{% endif %}{% endmacro %}{{ f(22) }}", "a macro's arguments would "
                                                                      "be over"),
    ("{% include 'other.jinja' %}", "no loader"),
    ("{{ lipsum(100000) }}", "'lipsum' is undefined"),
    ("{{ 'ab'.translate({97: 'x' * 1000}) }}", "str.translate is not available"),
    ("", "renders an empty prompt"),
    ("{% if false %}x{% endif %}", "renders an empty prompt"),
])
def test_chat_templates_that_fail_are_one_line_naming_the_file(template, needle):
    # refused by the bound its needle names, not by the 2 s clock (that would be another
    # message): no wall-clock assertion needed, which a busy machine could fail
    if needle == "ok":
        assert ChatTemplate(template + "ok", "x.jinja").render(USER) == "ok"
        return
    refused(lambda: ChatTemplate(template, "d/chat_template.jinja").render(USER, seconds=2),
            "d/chat_template.jinja", needle)


@pytest.mark.parametrize("template", [
    "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    "{% for x in [range(99999)] * 9999 recursive %}{{ loop(x) if x is iterable }}{% endfor %}",
])
def test_a_template_that_runs_for_ever_is_stopped(template):
    refused(lambda: ChatTemplate(template, "t.jinja").render(USER, seconds=0.3),
            "t.jinja, template line 1: chat template: rendering took longer than 0.3 s")


@pytest.mark.parametrize("template", [
    "{{ a == b }}", "{{ a in [b] }}", "{{ a is eq b }}", "{{ a|sort }}", "{{ a|max }}",
    "{{ a|unique|list }}", "{{ d|dictsort }}",
    "{{ a|select('equalto', b)|list }}", "{{ a|reject('ne', b)|list }}",
    "{{ a|selectattr('0', 'eq', b)|list }}", "{% set x = a %}"])
def test_a_given_value_that_shares_its_parts_is_walked_at_most_the_bound(template):
    # a value given to the template (a JSON row never shares its parts, but the bound does
    # not rely on it): compared, sorted, by the tests select / reject run on each item, set
    a, b = [1], [1]
    for _ in range(21):
        a, b = [a, a], [b, b]
    needle = "a value set" if "set" in template else "a value compared"
    refused(lambda: ChatTemplate(template, "t.jinja").render(USER, seconds=2, a=a, b=b,
                                                             d={"x": a, "y": b}),
            f"t.jinja, template line 1: chat template: {needle}")


@pytest.mark.parametrize("value, needle", [
    (42, "must be a string or a list"),
    ([{"name": "default"}], "chat_template[0] must be an object with string \"name\" and "
                            "\"template\""),
    (["{{ x }}"], "chat_template[0] must be an object"),
    ([{"name": "default", "template": 3}], "chat_template[0]"),
])
def test_bad_chat_template_entries_in_tokenizer_config_are_named(lm, tmp_path, value, needle):
    config = json.loads((lm / "tokenizer_config.json").read_text())
    path = copy(lm, tmp_path, **{"chat_template.jinja": None, "tokenizer_config.json":
                                 json.dumps({**config, "chat_template": value})})
    refused(lambda: HFTokenizer.from_dir(path), str(path / "tokenizer_config.json"), needle)


def test_named_templates_use_the_default_one(lm, tmp_path):
    config = json.loads((lm / "tokenizer_config.json").read_text())
    named = [{"name": "tool_use", "template": "{{ raise_exception('no') }}"},
             {"name": "default", "template": "<{{ messages[0]['content'] }}>"}]
    path = copy(lm, tmp_path, **{"chat_template.jinja": None, "tokenizer_config.json":
                                 json.dumps({**config, "chat_template": named})})
    assert HFTokenizer.from_dir(path).apply_chat_template(USER) == "<e2e4 e7e5:>"


def test_an_empty_prompt_never_reaches_the_model(lm, tmp_path):
    tok = HFTokenizer.from_dir(with_template(lm, tmp_path, "{% if false %}x{% endif %}"))
    refused(lambda: tok.encode_prompt("e2e4:"), "renders an empty prompt")
    tok.configure_chat("off", "")  # Qwen adds no BOS: an empty text is no tokens at all
    refused(lambda: tok.encode_prompt(""), "prompt '': encodes to no tokens")


# --- a checkpoint's tokenizer state: checked like a tokenizer file ------------------------------

def test_a_malformed_tokenizer_state_is_refused(lm):
    good = HFTokenizer.from_dir(lm).state()
    assert tokenizer_from_state(good) == HFTokenizer.from_dir(lm)
    assert tokenizer_from_state(list("abc")) == CharTokenizer("abc")
    for state, needle in [
        (list("cba"), "sorted single characters, each once"),
        (["a", "a", "b"], "sorted single characters"),
        (["ab"], "sorted single characters"),
        ({"type": "char"}, "not a mini-grpo tokenizer state"),
        ({**good, "eos_ids": [10**6]}, "the stored eos_ids: 1000000 is not a token id"),
        ({**good, "eos_ids": ["2"]}, "is not a token id"),
        ({**good, "eos_ids": None}, "the stored eos_ids is missing"),
        ({**good, "config": []}, "the stored config is missing or of the wrong type"),
        ({**good, "config": {"a": json.loads("[" * 70 + "]" * 70)}}, "nested deeper"),
        ({**good, "chat_template": 7}, "the stored chat_template"),
        ({**good, "chat_template": "{% for %}"}, "the checkpoint's chat template, template "
                                                 "line 1: chat template: TemplateSyntaxError"),
        ({**good, "tokenizer.json": "{}"}, "cannot rebuild the stored tokenizer"),
    ]:
        refused(lambda s=state: tokenizer_from_state(s), needle)


def test_a_tokenizer_must_fit_its_model():
    tok = CharTokenizer("abc")  # 7 ids
    check_model_vocab(tok, 7)
    refused(lambda: check_model_vocab(tok, 43), "tokenizer: 7 tokens, the model's embedding 43")
    refused(lambda: check_model_vocab(tok, 5), "7 tokens")
    assert tok.decode([4, 40, 5]) == "a?b"  # an id past the alphabet: never an IndexError


def tiny_checkpoint() -> dict:
    """What a checkpoint of configs/tiny.yaml's model holds (Run.identity and the weights)."""
    from conftest import tiny

    from mini_grpo.checkpoint import FORMAT, VERSION
    from mini_grpo.models import build, spec
    from mini_grpo.policy import gpt_spec
    from mini_grpo.tasks.chess_fen import ALPHABET

    cfg, tok = tiny(None, mode="sft"), CharTokenizer(ALPHABET)
    torch.manual_seed(0)
    model = build(gpt_spec(cfg, tok.vocab_size))
    return {"kind": "sft", "step": 1, "config": cfg.to_dict(), "tokenizer": tok.state(),
            "model_spec": spec(model), "model": model.state_dict(), "format": FORMAT,
            "version": VERSION}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("run") / "step_0000001.pt"
    torch.save(tiny_checkpoint(), path)
    return path


def with_tokenizer(checkpoint, tmp_path, tokenizer):
    state = torch.load(checkpoint, weights_only=True)
    path = tmp_path / "bad.pt"
    torch.save({**state, "tokenizer": tokenizer}, path)
    return path


def test_sample_and_export_refuse_a_malformed_tokenizer_state(checkpoint, tmp_path):
    alphabet = torch.load(checkpoint, weights_only=True)["tokenizer"]
    bad = with_tokenizer(checkpoint, tmp_path, alphabet + alphabet[:2])  # was an IndexError
    for args in (["sample", "--prompt", "e2e4:", "--max_new_tokens", "4"],
                 ["export", "--output", tmp_path / "hf"]):
        r = cli(args[0], "--checkpoint", bad, *args[1:])
        one_line_exit_2(r, f"{bad}: tokenizer: the stored alphabet must be sorted")
    assert not (tmp_path / "hf").exists()


def test_sample_and_export_refuse_an_alphabet_that_does_not_fit_the_model(checkpoint,
                                                                          tmp_path):
    alphabet = torch.load(checkpoint, weights_only=True)["tokenizer"]
    bad = with_tokenizer(checkpoint, tmp_path, alphabet[:3])  # was an IndexError
    for args in (["sample", "--prompt", alphabet[0], "--max_new_tokens", "4"],
                 ["export", "--output", tmp_path / "hf"]):
        r = cli(args[0], "--checkpoint", bad, *args[1:])
        one_line_exit_2(r, f"{bad}: tokenizer: 7 tokens, the model's embedding")


# --- through the entry points: exit 2, one line naming the file ---------------------------------

@pytest.mark.parametrize("case", ["deep_config", "escape", "huge", "loop", "empty", "raise"])
def test_the_cli_exits_2_with_one_line_naming_the_file(lm, tmp_path, case):
    files = {"deep_config": {"tokenizer_config.json": DEEP},
             "escape": {"chat_template.jinja": "{{ ''.__class__.__mro__[1].__subclasses__() }}"},
             "loop": {"chat_template.jinja": "{% for i in range(99999) %}{% for j in "
                                             "range(99999) %}{% endfor %}{% endfor %}"},
             "huge": {"chat_template.jinja": "{{ 'x' * 10**9 }}"},
             "empty": {"chat_template.jinja": ""},
             "raise": {"chat_template.jinja": "{{ raise_exception('Only user roles') }}"}}[case]
    path = copy(lm, tmp_path, **files)
    r = cli("sample", "--checkpoint", path, "--prompt", "e2e4:", "--max_new_tokens", 2)
    one_line_exit_2(r, f"{path / next(iter(files))}")


def test_training_from_a_directory_whose_template_refuses_exits_2(lm, tmp_path):
    path = with_template(lm, tmp_path, "{{ raise_exception('System role not supported') }}")
    r = entry("--config", "tiny", f"--init_from={path}", f"--out_dir={tmp_path / 'run'}",
              "--block_size=256", "--task_args.num_train=16", "--num_eval=4")
    one_line_exit_2(r, f"{path / 'chat_template.jinja'}, template line 1: the chat template "
                       f"refuses this conversation: System role not supported")


# --- found by the fuzz suite in files this change does not own ----------------------------------


def test_a_config_file_that_is_not_utf8_is_named(tmp_path):
    from mini_grpo.config import load_config

    path = tmp_path / "bad.yaml"
    path.write_bytes(b"amp_dtype: \xed\xa0\x80\n")  # a lone surrogate, as UTF-8 never writes it
    refused(lambda: load_config(str(path), {}, env={}), f"{path}: not valid UTF-8")


def saved(tmp_path, **changes):
    path = tmp_path / "ckpt.pt"
    torch.save({**tiny_checkpoint(), **changes}, path)
    return path


def open_checkpoint(path):
    from mini_grpo.policy import build_policy, checkpoint_config

    state, cfg = checkpoint_config(str(path), {"rewards": "null"})
    return build_policy(cfg, None, state)


@pytest.mark.parametrize("key, value", [("n_embd", True), ("vocab_size", None),
                                        ("n_head", "4"), ("dropout", float("nan")),
                                        ("n_head", 3),  # 3: a RuntimeError in `sample`
                                        ("dropout", 2),  # torch's ValueError (long fuzz)
                                        ("activation", "relu")])  # was GELU, silently
def test_a_model_spec_of_the_wrong_types_is_named(tmp_path, key, value):
    spec = tiny_checkpoint()["model_spec"]
    path = saved(tmp_path, model_spec={**spec, "config": {**spec["config"], key: value}})
    refused(lambda: open_checkpoint(path), f"{path}: model config {key}")


@pytest.mark.parametrize("scaling, needle", [
    ({"rope_type": "linear"}, "factor must be a number in (0.0, 1e+15), got None"),
    ({"rope_type": "linear", "factor": "4"}, "factor must be a number in (0.0, 1e+15), got '4'"),
    ({"rope_type": "yarn", "factor": 4.0}, "rope type 'yarn' is not supported (default, "
                                           "linear, llama3)"),
    ({"rope_type": ["linear"]}, "rope type ['linear'] is not supported"),
    ({"factor": 4.0}, "{'factor': 4.0} should read {}"),  # a default rope with a factor
    ({"type": "linear", "factor": 4.0},  # the old spelling: rope_frequencies reads rope_type
     "{'factor': 4.0, 'type': 'linear'} should read {'factor': 4.0, 'rope_type': 'linear'}"),
])
def test_a_rope_scaling_that_config_json_could_not_give_is_named(tmp_path, scaling, needle):
    """A Llama spec's rope_scaling is checked by config.json's rule, and must already be in
    the form that rule gives: rope_frequencies reads it as it is."""
    from mini_grpo.models import build, spec

    state = tiny_checkpoint()
    llama = spec(build({"family": "llama", "config": dict(
        vocab_size=state["model_spec"]["config"]["vocab_size"], block_size=256, n_layer=1,
        n_head=2, n_kv_head=1, n_embd=16, head_dim=8, n_inner=32)}))
    path = saved(tmp_path, model_spec=llama, model=build(llama).state_dict())
    model, _ = open_checkpoint(path)  # the spec as written: read
    assert model.cfg.rope_scaling == {}
    llama["config"]["rope_scaling"] = scaling
    path = saved(tmp_path, model_spec=llama, model=build(llama | {"config": {
        **llama["config"], "rope_scaling": {}}}).state_dict())
    refused(lambda: open_checkpoint(path), f"{path}: model config rope_scaling: {needle}")


def test_a_model_spec_of_absurd_size_is_named(tmp_path):
    spec = tiny_checkpoint()["model_spec"]
    path = saved(tmp_path, model_spec={**spec, "config": {**spec["config"], "n_embd": 2**62}})
    refused(lambda: open_checkpoint(path), f"{path}: its model_spec: the model would hold")


def test_a_weight_that_is_not_a_tensor_is_named(tmp_path):
    weights = tiny_checkpoint()["model"]
    path = saved(tmp_path, model={**weights, "wte.weight": None})
    refused(lambda: open_checkpoint(path), "mismatched weights: wte.weight (NoneType)")


def test_a_checkpoint_holding_more_than_plain_values_is_one_line(tmp_path):
    import pickle

    from mini_grpo.checkpoint import load_checkpoint

    path = tmp_path / "evil.pt"
    path.write_bytes(pickle.dumps(print, protocol=2))  # a global weights_only refuses
    message = refused(lambda: load_checkpoint(path), f"{path}: cannot load checkpoint")
    assert "weights_only` set to `False`" not in message


@pytest.mark.parametrize("args, needle", [
    (["--n", "0"], "--n: must be >= 1, got 0"),
    (["--n", "-3"], "--n: must be >= 1, got -3"),
    (["--n", "100000000"], "--n: 100,000,000 completions of 1 prompt(s) are more than "
                           "10,000,000 rows"),
    (["--temperature", "nan"], "--temperature: must be a finite number > 0"),
    (["--temperature", "0"], "--temperature: must be a finite number > 0"),
    (["--temperature", "inf"], "--temperature: must be a finite number > 0"),
    (["--temperature", "-1"], "--temperature: must be a finite number > 0"),
    (["--max_new_tokens", "0"], "--max_new_tokens: must be >= 1"),
    (["--seed", "1" * 30], "--seed: must be in 0..2**63 - 1"),  # torch's OverflowError (fuzz)
    (["--seed", "-1"], "--seed: must be in 0..2**63 - 1"),
])
def test_sample_refuses_bad_arguments_before_loading_anything(tmp_path, capsys, args, needle):
    from mini_grpo.cli import sample_main

    missing = tmp_path / "never-read.pt"  # the arguments fail first
    assert sample_main(["--checkpoint", str(missing), "--prompt", "e2e4:", *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err
