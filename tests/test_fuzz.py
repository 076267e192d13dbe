"""The fuzz suite (issue 25): every loader of untrusted input fed generated input, structured
and malformed (deep nesting, huge numbers, wrong types, unicode, truncation), in-process.
The property is mini-grpo's promise: success, or our one-line error (an exit-2 class: what
cli._guarded turns into exit 2), within a time and memory bound.

    .venv/bin/python -m pytest tests/test_fuzz.py                     # 250 examples a test
    .venv/bin/python -m pytest -p tests.hypothesis_profiles --hypothesis-profile=long \
        tests/test_fuzz.py                                            # 5,000 (profiles there)

Loaders: YAML configs, `--key=value` overrides and task_args (config.load_config); JSONL rows,
prompt and messages (tasks/jsonl.py); a model directory's config.json, tokenizer_config.json,
generation_config.json, model.safetensors.index.json and safetensors headers (models/hf.py,
HFTokenizer.from_dir); chat templates (chat_template.py); checkpoints (run.checkpoint_config,
build_policy, tokenizer_from_state); GGUF files (models/gguf.py); the command lines of sample,
export and rft-generate, with the property that no file but the command's own output changes;
a resume's training and optimizer state (state.check_train_state, optim.check_state, then
torch's load and step); what an environment's reset and step return (engines/turns.py).
What they found is in tests/test_untrusted.py, test_resume_state.py and test_turns.py.
"""

import copy
import dataclasses
import functools
import json
import resource
import shutil
import struct
import time

import hypothesis_profiles  # noqa: F401  (registers and loads the profiles)
import pytest
import torch
from conftest import CHATML, ROOT, tiny_lm_dir
from hypothesis import event, given, settings
from hypothesis import strategies as st
from test_untrusted import tiny_checkpoint

from mini_grpo.chat_template import ChatTemplate
from mini_grpo.checkpoint import CheckpointError
from mini_grpo.config import GRPOConfig, load_config, parse_cli
from mini_grpo.envs import MAX_CHARS as ENV_MAX_CHARS
from mini_grpo.envs import Step
from mini_grpo.fields import ConfigError
from mini_grpo.scoring import RewardError
from mini_grpo.tasks.jsonl import load_jsonl
from mini_grpo.template_bounds import MAX_CHARS

EXIT_2 = (ConfigError, CheckpointError, RewardError)


def within_bounds(fn, seconds: float = 10.0, mib: int = 512):
    """fn()'s result, or the exit-2 error it raised (its first line is what the CLI prints);
    anything else fails the test, and so does taking more than `seconds` of CPU (not of the
    clock: a machine busy with other work must not fail it) or growing the process by more
    than `mib`."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, the high-water mark
    t0 = time.process_time()
    try:
        result = fn()
    except EXIT_2 as e:  # cli._fail prints the first line
        assert str(e).strip() and str(e).splitlines()[0].strip(), repr(str(e))
        result = e
    elapsed = time.process_time() - t0
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024
    assert elapsed < seconds, f"took {elapsed:.1f} s"
    assert grown < mib, f"grew by {grown:.0f} MiB"
    return result


# --- generated values ---------------------------------------------------------------------------

UNICODE = st.text(st.characters(exclude_categories=()), max_size=12)  # lone surrogates too
NUMBERS = st.one_of(st.integers(-2**70, 2**70), st.floats(),
                    st.sampled_from([0, -1, 2**31, 2**63, 10**18, 10**300]))
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, UNICODE,
                    st.sampled_from(["", "auto", "null", "true", "1e999", "nan", "-1", "1_0"]))
VALUES = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=4) |
                      st.dictionaries(UNICODE, kids, max_size=4), max_leaves=10)
DEPTHS = st.sampled_from([1, 50, 99, 101, 500, 1000, 5000, 20_000])


@st.composite
def raw_json(draw) -> str:
    """JSON text json.dumps cannot write: deep nesting, huge numbers, odd literals."""
    n = draw(DEPTHS)
    return draw(st.sampled_from([
        "[" * n + "]" * n, '{"a":' * n + "0" + "}" * n, "9" * min(n, 6000),
        "-" + "9" * min(n, 6000), "1e999", "NaN", "-Infinity", '"\\ud800"', "[" * n]))


class Raw:
    """A value `dumps` writes as this text, verbatim."""

    def __init__(self, text):
        self.text = text


def dumps(value) -> str:
    """json.dumps, with Raw values written as their text."""
    raws = []

    def swap(v):
        if isinstance(v, Raw):
            raws.append(v.text)
            return f"@@raw{len(raws) - 1}@@"
        if isinstance(v, dict):
            return {k: swap(x) for k, x in v.items()}
        if isinstance(v, list):
            return [swap(x) for x in v]
        return v

    text = json.dumps(swap(value))
    for i, r in enumerate(raws):
        text = text.replace(f'"@@raw{i}@@"', r)
    return text


def text_variants(valid: str):
    """A valid text, cut short, with text spliced in, or replaced by garbage."""
    return st.one_of(
        st.just(valid),
        st.integers(0, len(valid)).map(lambda i: valid[:i]),
        st.tuples(st.integers(0, len(valid)), UNICODE | raw_json()).map(
            lambda t: valid[:t[0]] + t[1] + valid[t[0]:]),
        UNICODE, raw_json())


def documents(valid: dict, keys: list[str], values=None):
    """JSON text: `valid` with some of `keys` (or others) set to generated values, or a
    variant of its text."""
    values = st.one_of(VALUES, raw_json().map(Raw)) if values is None else values
    edits = st.dictionaries(st.sampled_from(keys) | UNICODE, values, max_size=3)
    return st.one_of(edits.map(lambda e: dumps({**valid, **e})),
                     text_variants(json.dumps(valid)))


# --- configs: YAML files, --key=value, task_args --------------------------------------------------

FIELDS = sorted(GRPOConfig.__dataclass_fields__)
TASK_KEYS = ["num_train", "min_plies", "max_plies", "move_format", "pgn_path", "min_numbers",
             "max_numbers", "prompt_style", "answer_tag"]
YAML_SNIPPETS = ["&a [1, 2]", "*a", "!!python/object/apply:os.system ['true']", "!!binary aGk=",
                 "{a: 1, <<: *a}", "2001-12-14", "0x1F", "1_000", ".inf", "~", "|\n  text",
                 "? [a]\n: b", "'unterminated", "[" * 3000, "- a\n- b", "\t1", "countdown",
                 "jsonl", "chess_fen", "{num_train: 10000000000000}", "9" * 5000]
YAML_VALUES = st.one_of(VALUES.map(json.dumps), st.sampled_from(YAML_SNIPPETS), UNICODE)
KEYS = st.one_of(st.sampled_from(FIELDS), st.sampled_from(TASK_KEYS).map("task_args.".__add__),
                 UNICODE)


@st.composite
def yaml_files(draw) -> str:
    lines = draw(st.lists(st.tuples(KEYS, YAML_VALUES), max_size=6))
    doc = "".join(f"{k}: {v}\n" for k, v in lines)
    tiny_yaml = (ROOT / "configs" / "tiny.yaml").read_text()
    return draw(st.one_of(st.just(doc), text_variants(tiny_yaml + doc)))


@given(text=yaml_files(), argv=st.lists(st.tuples(KEYS, YAML_VALUES | UNICODE).map(
    lambda kv: f"--{kv[0]}={kv[1]}"), max_size=3))
def test_yaml_configs_and_overrides(tmp_path_factory, text, argv):
    path = tmp_path_factory.getbasetemp() / "fuzz.yaml"
    path.write_text(text, errors="surrogatepass")
    within_bounds(lambda: load_config(str(path), parse_cli(argv)[1], env={}))


@given(argv=st.lists(st.one_of(UNICODE, st.tuples(KEYS, YAML_VALUES).map(
    lambda kv: f"--{kv[0]}={kv[1]}"), st.sampled_from(["--task", "--config", "--", "-x"])),
    max_size=6))
def test_command_line_overrides(argv):
    within_bounds(lambda: load_config(*parse_cli(argv), env={}))


# --- JSONL rows -----------------------------------------------------------------------------------

PROMPT_ROW = {"prompt": "e2e4:", "target": "x", "id": 1}
MESSAGES_ROW = {"messages": [{"role": "user", "content": "e2e4:"}], "target": "x"}
RFT_ROW = {"prompt": "e2e4:", "target": "x", "completion": "x",  # a multi-turn RFT row
           "conversation": [{"role": "assistant", "content": "x"}]}


@st.composite
def jsonl_files(draw) -> bytes:
    rows = draw(st.lists(st.one_of(
        documents(PROMPT_ROW, ["prompt", "target", "messages"]),
        documents(MESSAGES_ROW, ["messages", "target", "prompt"],
                  st.lists(st.dictionaries(st.sampled_from(["role", "content"]) | UNICODE,
                                           VALUES, max_size=3), max_size=3) | VALUES),
        documents(RFT_ROW, ["conversation"], st.lists(st.dictionaries(
            st.sampled_from(["role", "content", "name"]) | UNICODE,
            st.sampled_from(["assistant", "tool"]) | VALUES, max_size=3), max_size=4) | VALUES)),
        min_size=1, max_size=5))
    data = "\n".join(rows).encode("utf-8", "surrogatepass")
    tail = draw(st.sampled_from([b"", b"\n", b"\xff\n", b"\n\n"]))
    return data + tail


@given(data=jsonl_files(), alphabet=st.booleans())
def test_jsonl_rows(tmp_path_factory, data, alphabet):
    from mini_grpo.tokenizer import CharTokenizer

    path = tmp_path_factory.getbasetemp() / "fuzz.jsonl"
    path.write_bytes(data)
    tok = CharTokenizer("e24:x") if alphabet else None
    within_bounds(lambda: load_jsonl(path, tok))


# --- a model directory's files --------------------------------------------------------------------

@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    pytest.importorskip("transformers")
    return tiny_lm_dir(tmp_path_factory.mktemp("models") / "qwen")


@pytest.fixture(scope="module")
def work(lm, tmp_path_factory):
    """A copy of the model directory each example edits (and the loaders read)."""
    return shutil.copytree(lm, tmp_path_factory.mktemp("work") / "m")


def restore(lm, work, *names):
    for name in names:
        if (lm / name).is_file():
            shutil.copy(lm / name, work / name)
        else:
            (work / name).unlink(missing_ok=True)


def load_model(path):
    from mini_grpo.models.hf import load_hf_model

    return load_hf_model(path, weights=False)


def load_tokenizer(path):
    from mini_grpo.tokenizer import HFTokenizer

    tok = HFTokenizer.from_dir(path)
    if tok.chat_template is not None:
        tok.encode_prompt("e2e4:")
    return tok


CONFIG_KEYS = ["model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size",
               "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters",
               "rms_norm_eps", "hidden_act", "tie_word_embeddings", "attention_bias",
               "sliding_window", "use_sliding_window", "torch_dtype", "dtype"]
TOKENIZER_KEYS = ["eos_token", "bos_token", "pad_token", "unk_token", "chat_template",
                  "added_tokens_decoder"]


@pytest.mark.parametrize("name, keys, load", [
    ("config.json", CONFIG_KEYS, load_model),
    ("tokenizer_config.json", TOKENIZER_KEYS, load_tokenizer),
    ("generation_config.json", ["eos_token_id", "bos_token_id", "pad_token_id"],
     load_tokenizer),
])
@given(data=st.data())
def test_model_directory_json(lm, work, name, keys, load, data):
    valid = json.loads((lm / name).read_text())
    if name == "tokenizer_config.json":  # its own template, not chat_template.jinja's
        valid["chat_template"] = (lm / "chat_template.jinja").read_text()
    text = data.draw(documents(valid, keys))
    if name == "tokenizer_config.json":
        (work / "chat_template.jinja").unlink(missing_ok=True)
    (work / name).write_text(text, errors="surrogatepass")
    try:
        within_bounds(lambda: load(work))
    finally:
        restore(lm, work, name, "chat_template.jinja")


@given(data=st.data())
def test_index_json(lm, work, data):
    shard = "model-00001-of-00001.safetensors"
    names = list(json.loads(safetensors_header((lm / "model.safetensors").read_bytes())[1]))
    valid = {"metadata": {"total_size": 1}, "weight_map": dict.fromkeys(names, shard)}
    weight_maps = st.one_of(VALUES, st.dictionaries(
        st.sampled_from(names) | UNICODE,
        st.sampled_from([shard, "", "/etc/passwd", "../m/" + shard, "x\x00y", shard + "x"]) |
        VALUES, max_size=4))
    text = data.draw(documents(valid, ["weight_map", "metadata"],
                               st.one_of(weight_maps, raw_json().map(Raw))))
    (work / "model.safetensors").rename(work / shard)
    (work / "model.safetensors.index.json").write_text(text, errors="surrogatepass")
    try:
        within_bounds(lambda: load_model(work))
    finally:
        (work / shard).rename(work / "model.safetensors")
        restore(lm, work, "model.safetensors.index.json")


def safetensors_header(raw: bytes) -> tuple[int, str]:
    n = struct.unpack("<Q", raw[:8])[0]
    return n, raw[8:8 + n].decode()


@given(data=st.data())
def test_safetensors_headers(lm, work, data):
    from mini_grpo.models.hf import load_hf_model

    raw = (lm / "model.safetensors").read_bytes()
    n, header = safetensors_header(raw)
    valid = json.loads(header)
    entries = st.fixed_dictionaries({}, optional={
        "dtype": st.sampled_from(["F32", "F16", "BF16", "I64", "BOOL", "F8_E4M3", "X"]) | VALUES,
        "shape": st.lists(st.integers(-2, 2**40), max_size=4) | VALUES,
        "data_offsets": st.lists(st.integers(-1, 2**40), max_size=3) | VALUES})
    text = data.draw(documents(valid, list(valid), entries | VALUES))
    body = text.encode("utf-8", "surrogatepass")
    length = data.draw(st.one_of(st.just(len(body)), st.integers(0, 2**64 - 1),
                                 st.integers(max(0, len(body) - 3), len(body) + 3)))
    tail = raw[8 + n:]
    tail = data.draw(st.sampled_from([tail, tail[:len(tail) // 2], tail + b"\0" * 64, b""]))
    (work / "model.safetensors").write_bytes(struct.pack("<Q", length) + body + tail)
    try:
        within_bounds(lambda: load_hf_model(work))
    finally:
        restore(lm, work, "model.safetensors")


# --- chat templates -------------------------------------------------------------------------------

PIECES = [
    "{% for m in messages %}", "{% endfor %}", "{% if add_generation_prompt %}", "{% endif %}",
    "{% else %}", "{{ m['role'] }}", "{{ m.content|upper }}", "{{ messages[0]['content'] }}",
    "{{ messages[N] }}", "{{ raise_exception('refused') }}", "{{ nothing.here }}", "{{ x }}",
    "{{ ''.__class__ }}", "{{ m.__init__ }}", "{% macro f() %}{{ f() }}{% endmacro %}",
    "{{ f() }}", "{% macro g(n) %}{{ g(n - 1) }}{{ g(n - 1) }}{% endmacro %}{{ g(N) }}",
    "{% set ns = namespace(s='ab', l=[]) %}", "{% set ns.s = ns.s ~ ns.s %}", "{{ ns.s }}",
    "{% set ns.l = ns.l + [ns.s[1:]] %}", "{{ ([1] * N)|map('center', N)|list|length }}",
    "{{ bos_token }}", "{{ messages|tojson(indent=N) }}", "{{ 'x' * N }}", "{{ [1] * N }}",
    "{% for i in range(N) %}", "{{ ('ab' * N)|replace('a', 'aaaa') }}", "{{ N ** N }}",
    "{{ '%0Nd' % 1 }}", "{{ '{:>N}'.format(1) }}", "{{ 'a'.join(['b'] * N) }}",
    "{{ range(N)|list|length }}", "{% set y %}", "{% endset %}", "{{ y|indent(N) }}",
    "{{ 1 / 0 }}", "{{ m.content[:N] }}", "{% filter upper %}", "{% endfilter %}",
    "{% include 'x' %}", "{% raw %}", "{% endraw %}", "{% break %}", "{% continue %}",
    "{{ loop.index }}", "{{ (messages|length) * N }}", "{{ 'ab'|center(N) }}", "{#", "#}",
    "{{", "}}", "{%", "%}", "text ", "\n", "{{ strftime_now('%Y') }}", "{{ N|string * N }}"]
NS = st.sampled_from([0, 1, 2, 50, 1000, 99_999, 10**6, 10**9, -1])
MESSAGES = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]) | UNICODE, "content": UNICODE},
    optional={"tool_calls": VALUES}), min_size=1, max_size=3)


# Llama 3's shape: BOS, headers, a refusal, loop controls, tojson
LLAMA3 = ("{{ bos_token }}{% for m in messages %}{% if m['content'] is not string %}"
          "{{ raise_exception('content must be text') }}{% endif %}"
          "{% if m['role'] == 'ignored' %}{% continue %}{% endif %}"
          "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim"
          " + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
          "{{ messages | tojson }}")


@st.composite
def templates(draw) -> str:
    pieces = draw(st.lists(st.tuples(st.sampled_from(PIECES), NS), max_size=12))
    composed = "".join(p.replace("N", str(n)) for p, n in pieces)
    return draw(st.one_of(st.just(composed), text_variants(CHATML), text_variants(LLAMA3)))


@pytest.mark.filterwarnings("ignore:invalid escape sequence:DeprecationWarning")  # jinja's
@given(template=templates(), messages=MESSAGES, generation=st.booleans())
def test_chat_templates(template, messages, generation):
    def render():
        return ChatTemplate(template, "t.jinja").render(
            messages, seconds=0.1, add_generation_prompt=generation, bos_token="<s>")

    text = within_bounds(render, seconds=5)
    assert not isinstance(text, str) or 0 < len(text) <= MAX_CHARS


# --- checkpoints ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint():
    return tiny_checkpoint()


@st.composite
def checkpoint_states(draw, valid: dict) -> dict:
    state = dict(valid)
    for key in draw(st.lists(st.sampled_from(["config", "tokenizer", "model_spec", "model",
                                              "step", "kind"]) | UNICODE, max_size=3,
                                 unique=True)):
        old = valid.get(key)
        if key == "config" and isinstance(old, dict):
            new = {**old, **draw(st.dictionaries(st.sampled_from(FIELDS) | UNICODE, VALUES,
                                                 max_size=2))}
        elif key == "tokenizer":
            new = draw(st.one_of(VALUES, st.lists(UNICODE, max_size=5),
                                 st.just(old[:3] + old[:2]), st.just(old[::-1]),
                                 st.fixed_dictionaries({"type": st.just("hf")},
                                                       optional=dict.fromkeys(
                                                           ["tokenizer.json", "config",
                                                            "chat_template", "eos_ids"],
                                                           VALUES))))
        elif key == "model_spec" and isinstance(old, dict):
            config = {**old["config"], **draw(st.dictionaries(
                st.sampled_from(list(old["config"])) | UNICODE, VALUES | NUMBERS, max_size=2))}
            new = draw(st.sampled_from([{**old, "config": config}, {**old, "family": "x"},
                                        config]))
        elif key == "model" and isinstance(old, dict):
            name = draw(st.sampled_from(sorted(old)))
            shape = draw(st.lists(st.integers(0, 6), max_size=3))
            new = {**old, name: draw(st.sampled_from([torch.zeros(shape), None, "x"]))}
            if draw(st.booleans()):
                new.pop(name)
        else:
            new = draw(VALUES)
        state[key] = new
    return state


@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")  # torch's
@given(data=st.data())
def test_checkpoints(checkpoint, tmp_path_factory, data):
    from mini_grpo.policy import build_policy, checkpoint_config

    path = tmp_path_factory.getbasetemp() / "fuzz.pt"
    if data.draw(st.booleans()):
        torch.save(data.draw(checkpoint_states(checkpoint)), path)
    else:  # the file itself cut short or garbled
        torch.save(checkpoint, path)
        raw = path.read_bytes()
        cut = data.draw(st.integers(0, len(raw)))
        path.write_bytes(raw[:cut] + data.draw(st.binary(max_size=16)))

    def load():
        state, cfg = checkpoint_config(str(path), {"rewards": "null"})
        model, tok = build_policy(cfg, None, state)  # what export and sample build
        tok.decode(range(model.cfg.vocab_size))
        return tok

    within_bounds(load)


# --- GGUF files -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    pytest.importorskip("gguf")
    from mini_grpo.models.gguf import write_gguf
    from mini_grpo.models.hf import load_hf_model
    from mini_grpo.tokenizer import HFTokenizer

    lm = tiny_lm_dir(tmp_path_factory.mktemp("models") / "llama", "llama")
    return write_gguf(load_hf_model(lm), HFTokenizer.from_dir(lm),
                      tmp_path_factory.mktemp("gguf") / "tiny.gguf", "q8_0")


SIZES = st.sampled_from([0, 1, 7, 2**31, 2**32 - 1, 2**40, 2**63, 2**64 - 1])


@given(data=st.data())
def test_gguf_files(gguf_file, tmp_path_factory, data):
    """Bytes of the header (metadata, tensor directory) overwritten, sizes spliced in, the
    file cut or extended: load_gguf (what init_from, sample and export read) succeeds or says
    what is wrong in one line, bounded."""
    from mini_grpo.models.gguf import load_gguf, read_gguf

    raw = bytearray(gguf_file.read_bytes())
    header = min(t.offset for t in read_gguf(gguf_file).tensors.values())
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, header - 1))
        piece = data.draw(st.one_of(st.binary(min_size=1, max_size=8),
                                    SIZES.map(lambda n: n.to_bytes(8, "little"))))
        raw[at:at + len(piece)] = piece
    raw = data.draw(st.sampled_from([raw, raw[:data.draw(st.integers(0, len(raw)))],
                                     raw + b"\0" * 64]))
    path = tmp_path_factory.getbasetemp() / "fuzz.gguf"
    path.write_bytes(bytes(raw))
    within_bounds(lambda: load_gguf(path))


# --- the commands' arguments, and the files around them -----------------------------------------

NUMBERS = st.one_of(st.integers(-3, 3), st.sampled_from(
    ["0", "-1", "nan", "inf", "-inf", "1e309", "0x10", "", "1" * 30, "100000000", "2.5"]))
OUTPUTS = st.sampled_from(["run", "run/checkpoints/..", ".", "..", "notes.txt", "data.jsonl",
                           "new/out", "exp", "x.gguf", "notes.gguf", "missing/deeper/out",
                           "run/metrics.jsonl", "run/checkpoints", "out.jsonl", "exp/.."])


@st.composite
def command_lines(draw):
    cmd = draw(st.sampled_from(["sample", "export", "rft-generate"]))
    argv = [cmd, "--checkpoint", draw(st.sampled_from(["ckpt.pt", "run", "notes.txt",
                                                       "missing.pt", "ckpt.pt"]))]
    flags = {"sample": ["--n", "--temperature", "--max_new_tokens", "--seed"],
             "export": ["--gguf_type", "--dtype"],
             "rft-generate": ["--split", "--rft_oversample", "--rft_num_prompts"]}[cmd]
    for flag in draw(st.lists(st.sampled_from(flags), max_size=3)):
        argv += [flag, str(draw(NUMBERS if flag not in ("--gguf_type", "--dtype", "--split")
                                else st.sampled_from(["f16", "q8_0", "bfloat16", "train",
                                                      "eval", "nope", ""])))]
    if cmd == "sample":
        argv += ["--prompt", draw(st.sampled_from(["e2e4:", "", "é"])),
                 *draw(st.lists(st.sampled_from(["--greedy", "--json"]), max_size=2))]
    else:
        argv += ["--output", draw(OUTPUTS), *(["--adapter"] if cmd == "export" and
                                              draw(st.booleans()) else [])]
    if cmd == "rft-generate":  # small enough to run: the files are what is under test
        argv += ["--rft_num_prompts=3", "--rft_prompts_per_batch=3", "--max_new_tokens=4"]
    return argv


def snapshot(root) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A user's directory: a checkpoint, a run directory, notes and data, an earlier export."""
    from mini_grpo.cli import main

    work = tmp_path_factory.mktemp("work") / "here"
    (work / "run" / "checkpoints").mkdir(parents=True)
    torch.save(tiny_checkpoint(), work / "ckpt.pt")
    (work / "run" / "checkpoints" / "step_0000004.pt").write_bytes(b"weights")
    (work / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    (work / "notes.txt").write_text("my notes\n")
    (work / "notes.gguf").write_text("not a model\n")
    (work / "data.jsonl").write_text('{"prompt": "a:", "target": "b"}')
    assert main(["export", "--checkpoint", str(work / "ckpt.pt"), "--output",
                 str(work / "exp")]) == 0
    return work


@settings(max_examples=max(40, settings.default.max_examples // 6))  # each a whole command
@given(argv=command_lines())
def test_command_lines_never_touch_other_files(workdir, argv):
    """sample, export and rft-generate on any arguments: exit 0 or one line of exit 2 (never
    a traceback), and no file changes but the command's own output (the export directory or
    GGUF file, the RFT data and its side files), which is never a user's file."""
    import os

    from mini_grpo.cli import main

    before = snapshot(workdir)
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        try:
            code = within_bounds(lambda: main(argv), seconds=60, mib=1024)
        except SystemExit as e:  # argparse: a bad flag value, exit 2
            code = e.code
    finally:
        os.chdir(cwd)
    assert code in (0, 2), (argv, code)
    out = argv[argv.index("--output") + 1] if "--output" in argv else None
    mine = os.path.normpath(workdir / out) if out else None
    after = snapshot(workdir)
    for name in sorted(set(before) | set(after)):
        path = os.path.normpath(workdir / name)
        if code == 0 and mine and (path == mine or path.startswith(mine + os.sep) or (
                argv[0] == "rft-generate" and path.startswith(mine + "."))):
            continue  # the command's own output, written where it was allowed to
        assert before.get(name) == after.get(name), (argv, name)
    for name in set(after) - set(before):  # no temporaries left beside what it wrote
        assert ".tmp" not in name, (argv, name)


# a training run's out_dir among a user's folders: a run directory of an older version, the
# current one and those above it, a file, an export, a fresh folder (which a first run claims)
OUT_DIRS = st.sampled_from(["run", ".", "..", "notes.txt", "exp", "exp/..", "run/checkpoints",
                            "data.jsonl", "fresh/run", "fresh/run/..", "exp/model.safetensors"])


@settings(max_examples=max(20, settings.default.max_examples // 12))  # some train a step
@given(out=OUT_DIRS, resume=st.sampled_from(["auto", "never"]))
def test_training_never_writes_into_a_users_folder(workdir, out, resume):
    """`train` with out_dir drawn among a user's folders: one line of exit 2 where the folder
    is not a new, empty or run directory, else a run whose every file is inside out_dir; no
    other file changes."""
    import os

    from mini_grpo.cli import main

    before = snapshot(workdir)
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        code = within_bounds(lambda: main([
            "train", "--config", "tiny", "--mode=grpo", "--max_steps=1", "--num_eval=2",
            "--use_amp=false", "--reward_executor=serial", "--report_to=[]",
            f"--resume={resume}", f"--out_dir={out}"]), seconds=60, mib=1024)
    finally:
        os.chdir(cwd)
    mine = os.path.normpath(workdir / out)
    assert code == (0 if mine == os.path.normpath(workdir / "fresh/run") else 2), (out, code)
    after = snapshot(workdir)
    for name in sorted(set(before) | set(after)):
        path = os.path.normpath(workdir / name)
        if code == 0 and path.startswith(mine + os.sep):
            continue  # the run's own files
        assert before.get(name) == after.get(name), (out, name)


# --- tools (issue 40): the calculator and the call parser, on what a model may write --------

EXPRESSION_PARTS = st.sampled_from(["1", "9", "0", "2.5", "1e308", "10", "999", "(", ")", "+",
                                    "-", "*", "/", "//", "%", "**", " ", "x", "__import__",
                                    "'a'", "[", "]", ".", "e", "j", "_", ",", "lambda"])
EXPRESSIONS = st.one_of(st.text(max_size=200), st.lists(EXPRESSION_PARTS, max_size=150).map(
    "".join))


@given(EXPRESSIONS)
def test_fuzz_calculator(expression):
    from mini_grpo.tools import ToolError, calculator

    def go():
        try:
            out = calculator(expression)
            assert isinstance(out, str) and len(out) <= 1100
        except ToolError as e:
            assert str(e).strip()
    within_bounds(go, seconds=5, mib=64)


CALL_BODIES = st.one_of(
    st.text(max_size=300), raw_json(), VALUES.map(dumps),
    st.fixed_dictionaries({"name": st.sampled_from(["calculator", "", "x", "__import__"]) | UNICODE,
                           "arguments": VALUES | st.fixed_dictionaries(
                               {"expression": EXPRESSIONS}) | UNICODE}).map(dumps))


@given(st.lists(CALL_BODIES, max_size=20), st.sampled_from(["", "<tool_call>", "</tool_call>"]))
def test_fuzz_tool_calls_come_back_as_messages(bodies, tail):
    """Whatever the completion holds, parsing and running its calls ends in one message a
    call (or the note of calls left out), within a bound: never an exception, never a hang."""
    from mini_grpo.tools import MAX_CALLS, calculator, parse_tool_calls, run_call

    text = "".join(f"<tool_call>{b}</tool_call>" for b in bodies) + tail

    def go():
        calls = parse_tool_calls(text)
        assert len(calls) <= MAX_CALLS + 1
        for c in calls:
            out = run_call({"calculator": calculator}, c, max_chars=500)
            assert isinstance(out, str) and len(out) <= 540
    within_bounds(go, seconds=10, mib=128)


# the same property for Llama 3.x's and Mistral's call formats (tool_calls.py): the bodies as
# each family writes its calls, with the markers they are found by, cut anywhere
FORMATTED = {
    "llama3": lambda bodies: "<|python_tag|>" + "; ".join(bodies),
    "mistral": lambda bodies: "[TOOL_CALLS][" + ", ".join(bodies) + "]",
    "mistral-args": lambda bodies: "".join(f"[TOOL_CALLS]calculator[ARGS]{b}" for b in bodies),
}


@given(st.lists(CALL_BODIES, max_size=20), st.sampled_from(sorted(FORMATTED)),
       st.sampled_from(["", "[TOOL_CALLS]", "[ARGS]", "{", "[", ";", "<|python_tag|>"]),
       st.integers(0, 10_000))
def test_fuzz_llama3_and_mistral_calls_come_back_as_messages(bodies, shape, tail, cut):
    from mini_grpo.tools import MAX_CALLS, calculator, parse_tool_calls, run_call

    text = FORMATTED[shape](bodies) + tail
    text = text[:cut] if cut < len(text) else text

    def go():
        calls = parse_tool_calls(text, shape.split("-")[0])
        assert len(calls) <= MAX_CALLS + 1
        for c in calls:
            out = run_call({"calculator": calculator}, c, max_chars=500)
            assert isinstance(out, str) and len(out) <= 540
    within_bounds(go, seconds=10, mib=128)


# --- resume state: a checkpoint's step, guard, loss scaler and optimizer state ---------------

GROUP_KEYS = ["lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach",
              "capturable", "differentiable", "fused", "decoupled_weight_decay", "params"]
STATE_KEYS = ["step", "guard", "scaler", "logged", "optimizer", "state", "param_groups",
              "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "skipped", "next_rung", "lr_scale",
              "amp", "scale", "growth_factor", "backoff_factor", "growth_interval",
              "_growth_tracker", *GROUP_KEYS]
SHAPES = [(24, 32), (64, 32), (32,), (96, 32), (96,), (32, 32), (128, 32), (128,), (32, 128),
          (), (0,), (1,), (3,), (32, 24), (24, 32, 1)]  # the tiny GPT's, and others
DTYPES = [torch.float32, torch.float32, torch.float64, torch.bfloat16, torch.float16,
          torch.int64, torch.bool]
FILLS = [0.0, 1e-3, -1.0, 1e-45, 3e38, -3e38, float("nan"), float("inf"), "randn"]


class Made:
    """A drawn tensor, made where it is set and shown by how (its repr would be a page)."""

    def __init__(self, how: str, make):
        self.how, self.make = how, make

    def __repr__(self):
        return self.how


@st.composite
def tensors(draw) -> Made:
    shape = draw(st.sampled_from(SHAPES) | st.lists(st.integers(0, 4), max_size=3).map(tuple))
    fill, dtype = draw(st.sampled_from(FILLS)), draw(st.sampled_from(DTYPES))
    return Made(f"{fill}, {list(shape)}, {dtype}", lambda: (
        torch.randn(shape) if fill == "randn" else torch.full(shape, fill)).to(dtype))


STATE_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), UNICODE,
    st.sampled_from([0, 1, -1, 2**31, 2**63, 2**64, 10**300, 2**1100, 1e300, 1e-320]),
    st.tuples(st.floats(), st.floats()), st.lists(st.floats() | st.integers(-1, 40), max_size=3),
    VALUES, tensors())


def like(old):
    """Values of the kind `old` is (a tensor of its shape or dtype, another number, flag or
    pair): what passes a type check and tests the ranges behind it."""
    if isinstance(old, torch.Tensor):
        return st.one_of(
            st.tuples(st.sampled_from(FILLS[:-1]), st.sampled_from(DTYPES)).map(
                lambda d: Made(f"{d[0]}, its shape, {d[1]}",
                               lambda: torch.full(old.shape, d[0]).to(d[1]))),
            st.sampled_from([1e-30, 1e-3, -1.0, 1e3, 1e30, 3e38]).map(
                lambda k: Made(f"it * {k}", lambda: (old.double() * k).to(old.dtype))),
            st.sampled_from(DTYPES).map(lambda d: Made(f"it as {d}", lambda: old.to(d))),
            tensors())
    if isinstance(old, bool) or old is None:
        return st.sampled_from([True, False, None])
    if isinstance(old, int | float):
        return st.one_of(st.floats(), st.integers(-2**70, 2**70), st.sampled_from(
            [0, 1, 2**31 - 1, 2**31, 2**63, 2**128, 2**-126, 2**-127, 3e38, 1e300, 1e-320]))
    if isinstance(old, tuple):
        return st.lists(st.floats() | st.sampled_from([0, 1, 0.5, 1 - 1e-17]), max_size=3).map(
            tuple)
    return STATE_VALUES


def places(tree, path=()):
    """Every dict and list in `tree` (a tensor is a leaf), with its path of keys."""
    yield path, tree
    for k, v in (tree.items() if isinstance(tree, dict) else enumerate(tree)):
        if isinstance(v, dict | list):
            yield from places(v, path + (k,))


def made(value):
    return value.make() if isinstance(value, Made) else value


def place_kind(path) -> tuple:
    return tuple(k if isinstance(k, str) else 0 for k in path)


def edited(data, valid: dict) -> dict:
    """`valid` with 1-3 edits anywhere in it, each drawn (and shown) alone: a key replaced,
    deleted or added, a list item appended, or one number of a tensor set."""
    ckpt = copy.deepcopy(valid)
    for _ in range(data.draw(st.integers(1, 3))):
        found = list(places(ckpt))
        # first which kind of place (the top, the guard, any state entry, any group...), so
        # that the 28 state entries do not crowd the rest out
        kind = data.draw(st.sampled_from(sorted({place_kind(p) for p, _ in found}, key=repr)),
                         label="kind")
        node = dict(found)[data.draw(st.sampled_from(
            [p for p, _ in found if place_kind(p) == kind]), label="at")]
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        edit = data.draw(st.sampled_from(["set", "delete", "add", "poke"]), label="edit")
        numbers = [k for k in keys if isinstance(node[k], torch.Tensor)
                   and node[k].is_floating_point() and node[k].numel()]
        if edit == "poke" and numbers:
            t = node[data.draw(st.sampled_from(numbers), label="key")]
            t.view(-1)[data.draw(st.integers(0, t.numel() - 1), label="index")] = \
                data.draw(st.sampled_from(FILLS[:-1]), label="number")
        elif edit == "delete" and keys:
            node.pop(data.draw(st.sampled_from(keys), label="key"))
        elif edit in ("set", "poke") and keys:
            key = data.draw(st.sampled_from(keys), label="key")
            node[key] = made(data.draw(st.one_of(like(node[key]), like(node[key]),
                                                 STATE_VALUES), label="value"))
        elif isinstance(node, dict):
            node[data.draw(st.sampled_from(STATE_KEYS) | UNICODE | st.integers(-1, 40),
                           label="new key")] = made(data.draw(STATE_VALUES, label="value"))
        else:
            node.append(made(data.draw(STATE_VALUES, label="value")))
    return ckpt


@functools.cache  # not a fixture: hypothesis would show all of it with each failure
def resume_state(fused: bool) -> dict:
    """A training checkpoint's state besides its weights, after one AdamW step."""
    from test_resume_state import stepped

    return {"step": 3, "guard": {"skipped": 0, "next_rung": 0, "lr_scale": 1.0, "amp": True},
            "scaler": torch.amp.GradScaler("cpu").state_dict(),  # fp16's: every field
            "logged": 10, "optimizer": stepped(fused)[1]}


def written(state: dict, valid: dict) -> bool:
    """The moments of `state` are those AdamW wrote (`valid`'s): given them, every step,
    group number and flag the checks pass must step to finite parameters. Moments of other
    values than it writes (finite: 3e38 where exp_avg_sq is 0) may overflow a step, which
    the guard then skips (TrainState.step), as it would any step that overflows."""
    return all(k in valid["state"] and all(torch.equal(t, valid["state"][k][m])
                                           for m, t in e.items() if m != "step")
               for k, e in state["state"].items())


@given(data=st.data(), saved=st.booleans(), fused=st.booleans())
def test_resume_states(data, saved, fused):
    """A checkpoint's training state (saved with the fused AdamW or the per-parameter loop,
    resumed with either) edited anywhere: state.check_train_state and optim.check_state
    refuse it in one line, or what they pass loads into the guard, the fp16 loss scaler and
    AdamW, and a step of each goes through with finite parameters (torch checks none of it:
    a moment of another shape was a segfault)."""
    from conftest import tiny_gpt

    from mini_grpo.guards import Guard
    from mini_grpo.optim import check_state, make_optimizer
    from mini_grpo.state import check_train_state

    ckpt = edited(data, resume_state(saved))
    model = tiny_gpt()
    opt = make_optimizer(model, 1e-3, weight_decay=0.1, fused=fused)

    def resume():
        try:
            check_train_state(ckpt, "c.pt")
            check_state(opt, ckpt.get("optimizer"))
        except (CheckpointError, ValueError) as e:  # load_weights: "c.pt: " + the ValueError
            assert len(str(e).splitlines()) == 1 and str(e).startswith(
                ("c.pt: its ", "optimizer")), repr(str(e))
            event("refused")
            return e
        Guard(3).load_state_dict(ckpt.get("guard", {}))
        scaler = torch.amp.GradScaler("cpu")  # as TrainState.restore loads it under fp16
        if ckpt.get("scaler"):
            scaler.load_state_dict(ckpt["scaler"])
        p = torch.ones(2, requires_grad=True)
        sgd = torch.optim.SGD([p], lr=1e-3)
        scaler.scale(p.sum()).backward()
        scaler.step(sgd)
        scaler.update()
        assert 0 < scaler.get_scale() < float("inf"), scaler.get_scale()
        as_written = written(ckpt["optimizer"], resume_state(saved)["optimizer"])
        opt.load_state_dict(ckpt["optimizer"])  # its tensors, stepped in place
        model(torch.zeros(1, 4, dtype=torch.long))[0].float().sum().backward()
        opt.step()
        bad = [n for n, q in model.named_parameters() if not torch.isfinite(q).all()]
        event(f"stepped, moments {'as written' if as_written else 'edited'}"
              + (", not finite" if bad else ""))
        assert not bad or not as_written, f"not finite after the step: {bad}"

    within_bounds(resume, seconds=10, mib=256)


# --- environments: what reset and step return, through a conversation's turns -----------------

class Unshowable(BaseException):
    """An environment's exception that cannot even be shown."""

    def __str__(self):
        raise ValueError("no")


def text_of(n: int, char: str) -> Made:
    return Made(f"{char!r} * {n}", lambda: char * n)


def many(message, n: int) -> Made:
    """n messages alike (their texts shared, as an environment's repeated answer would)."""
    return Made(f"[{message!r}] * {n}", lambda: [dict(m) for m in [made_all(message)] * n])


def made_all(value):
    """`value` with every drawn Made in it made: what the environment returns or raises."""
    if isinstance(value, Made):
        return made_all(value.make())
    if isinstance(value, Step):
        return dataclasses.replace(value, messages=made_all(value.messages))
    if isinstance(value, dict):
        return {k: made_all(v) for k, v in value.items()}
    if isinstance(value, list):
        return [made_all(v) for v in value]
    return value


ENV_TEXTS = st.one_of(
    UNICODE,  # lone surrogates too
    st.sampled_from(["\ud800", "\udfff\ud800", "<|im_end|>", "<|im_start|>assistant\n",
                     "{{ raise_exception('x') }}", "\x00", "\u2028"]),
    st.sampled_from([text_of(n, c) for n, c in [  # (a surrogate or an emoji: 3-4 tokens)
        (0, "y"), (100, "\ud800"), (1000, "\ud800"), (1000, "\U0001f600"), (5000, "y"),
        (ENV_MAX_CHARS // 4, "\ud800"), (ENV_MAX_CHARS - 4096, "y"),  # these two: 1M tokens
        (ENV_MAX_CHARS + 1, "\ud800"), (1_100_000, "y")]]))
GOOD_MESSAGES = st.fixed_dictionaries({"role": st.sampled_from(["user", "tool", "system"]),
                                       "content": ENV_TEXTS}, optional={"name": ENV_TEXTS})
ENV_MESSAGES = GOOD_MESSAGES | st.tuples(st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["user", "tool", "system", "assistant", ""]) | UNICODE | VALUES,
    "content": ENV_TEXTS | VALUES}), st.dictionaries(
        st.sampled_from(["name", "tool_calls", "tool_call_id"]) | UNICODE | st.integers(-1, 2),
        ENV_TEXTS | VALUES, max_size=2)).map(lambda t: {**t[1], **t[0]})
GOOD_LISTS = st.lists(GOOD_MESSAGES, min_size=1, max_size=3) | st.tuples(
    GOOD_MESSAGES, st.sampled_from([2, 2045, 2047, 2048, 2049, 3000])).map(lambda t: many(*t))
ENV_MESSAGE_LISTS = GOOD_LISTS | st.lists(ENV_MESSAGES, max_size=3) | st.tuples(
    ENV_MESSAGES, st.sampled_from([2, 2047, 3000])).map(lambda t: many(*t))
ENV_COUNTS = st.integers(-1, 5) | st.sampled_from(
    [2**31, 2**53 + 1, 2**63, 2**64, 2**70, True, 1.0, float("nan"), "1", None])
ENV_RAISES = st.sampled_from([
    Made("ValueError('two\\nlines')", lambda: ValueError("two\nlines")),
    Made("RuntimeError()", RuntimeError), Made("KeyError('k')", lambda: KeyError("k")),
    Made("Unshowable()", Unshowable), Made("SystemExit(3)", lambda: SystemExit(3)),
    Made("GeneratorExit()", GeneratorExit), Made("RecursionError()", RecursionError),
    Made("Exception('\\ud800')", lambda: Exception("\ud800")),
    Made("RuntimeError('x' * 1_100_000)", lambda: RuntimeError("x" * 1_100_000))])
# calm: what a well-meaning environment returns (of the right types, its texts anything) or
# raises; wild: anything at all
CALM_STEPS = st.builds(Step, messages=GOOD_LISTS, done=st.sampled_from([False, False, True]),
                       rewards=st.dictionaries(st.sampled_from(["r", "bonus"]), st.floats(
                           -10, 10) | st.integers(-3, 3), max_size=2),
                       calls=st.integers(0, 3), failed=st.just(0)) | ENV_RAISES
WILD_STEPS = st.one_of(CALM_STEPS, VALUES, st.builds(
    Step, messages=ENV_MESSAGE_LISTS | VALUES,
    done=st.booleans() | st.sampled_from([None, 0, 1, "yes", float("nan")]),
    rewards=st.dictionaries(UNICODE | st.integers(), st.floats() | VALUES |
                            st.integers(-2**70, 2**70), max_size=2) | VALUES,
    calls=st.integers(0, 3) | ENV_COUNTS, failed=st.integers(0, 3) | ENV_COUNTS))
CALM_RESETS = st.one_of(st.none(), ENV_TEXTS, GOOD_LISTS, ENV_RAISES)
WILD_RESETS = st.one_of(CALM_RESETS, ENV_MESSAGE_LISTS, VALUES)


# ChatML, refusing a system message after the first (as many templates refuse their roles)
STRICT_CHATML = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
                 "{{ raise_exception('a system message must come first') }}{% endif %}"
                 "{% endfor %}" + CHATML)


@pytest.fixture(scope="module")
def chat_toks(tmp_path_factory):
    """{strict: a byte-level BPE with ChatML's template (or STRICT_CHATML) and the
    calculator's tool list}."""
    pytest.importorskip("transformers")
    from test_turns import tokenizers

    return {strict: tokenizers(tmp_path_factory.mktemp("chatml"),
                               STRICT_CHATML if strict else CHATML)[0]
            for strict in (False, True)}


@settings(max_examples=max(200, settings.default.max_examples * 4 // 5))  # some encode 1 MiB
@given(data=st.data(), calm=st.booleans(), strict=st.booleans(),
       max_rounds=st.sampled_from([0, 1, 4, 4]), turns_taken=st.integers(1, 2))
def test_environment_outputs(chat_toks, data, calm, strict, max_rounds, turns_taken):
    """An environment (one a row, two rows) whose reset and step return anything, or raise
    anything: Turns, its prompt_ids and one or two end_turn calls complete, each row ended or
    continued, the counts consistent, or stop with one line of EnvError naming the
    environment; never another exception (a ChatTemplateError, a tokenizer's), bounded."""
    from mini_grpo.engines.turns import COUNTS, ToolSetup, Turns
    from mini_grpo.envs import EnvError

    resets = data.draw(st.lists(CALM_RESETS if calm else WILD_RESETS, min_size=2,
                                max_size=2), label="resets")
    steps = data.draw(st.lists(st.lists(CALM_STEPS if calm else WILD_STEPS, min_size=1,
                                        max_size=2), min_size=2, max_size=2), label="steps")
    made_rows = []

    class Drawn:
        def __init__(self):
            self.row = len(made_rows)  # Turns makes the rows' environments in order
            made_rows.append(self)
            self.steps = list(steps[self.row])

        def reset(self, example):
            return answer(resets[self.row])

        def step(self, reply):
            return answer(self.steps.pop(0) if self.steps else Step([], done=True))

    def answer(drawn):
        value = made_all(drawn)
        if isinstance(value, BaseException):
            raise value
        return value

    name = f"environment {Drawn.__module__}:{Drawn.__qualname__}"
    tok = chat_toks[strict]

    def converse():
        try:
            turns = Turns(ToolSetup(Drawn, max_rounds, 10.0, rewards=True), tok, ["a", "b"])
            ids = turns.prompt_ids()
            assert len(ids) == 2 and all(isinstance(i, list) and i for i in ids)
            rows, answered = [0, 1], 0
            for _ in range(turns_taken):
                nxt = turns.end_turn(rows, [tok.encode("x") + [tok.eos_id] for _ in rows])
                assert len(nxt) == len(rows) and all(
                    n is None or (isinstance(n, list) and n) for n in nxt), nxt
                rows = [g for g, n in zip(rows, nxt) if n is not None]
                answered += len(rows)
        except ConfigError as e:
            assert type(e) is EnvError, f"{type(e).__name__}: {e}"
            assert len(str(e).splitlines()) == 1 and name in str(e), repr(str(e)[:500])
            event(f"EnvError from {'reset' if ': reset()' in str(e) else 'step'}")
            return e
        c = turns.counts
        for column in ("broken", "capped"):
            assert set(c[:, COUNTS.index(column)].tolist()) <= {0.0, 1.0}, (column, c)
        assert (c >= 0).all() and (c[:, COUNTS.index("rounds")] <= max_rounds).all(), c
        assert torch.isfinite(turns.rewards).all(), turns.rewards
        event(f"completed: {answered} answer(s) rendered, "
              f"{int(c[:, COUNTS.index('broken')].sum())} row(s) broken")
        return turns

    # 1 MiB of text (the bound) is 1M-4M tokens of this byte-level BPE: 0.2-0.9 GB to encode
    within_bounds(converse, seconds=20, mib=1024)
