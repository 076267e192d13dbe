"""GGUF in and out (models/gguf.py), against transformers' own GGUF loader (`gguf_file=`) as
the oracle: tiny Llama/Qwen2/Qwen3 models built locally with transformers, written to GGUF
files by the test (nothing downloaded). Export: transformers reads our file with the logits of
the directory it came from. Import: our model gives transformers' logits on the same file,
for every type the `gguf` package can write; the tokenizer encodes as the original one; the
CLI's import-gguf, sample and export on GGUF files; bad files named in one line."""

import json
import shutil
import struct
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, clean_env, tiny_lm_dir

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from mini_grpo.checkpoint import CheckpointError  # noqa: E402
from mini_grpo.models.gguf import load_gguf, read_gguf, write_gguf  # noqa: E402
from mini_grpo.models.hf import load_hf_model  # noqa: E402
from mini_grpo.tokenizer import HFTokenizer  # noqa: E402

TEXTS = ["e2e4 e7e5 g1f3: write the FEN", "12345 + 678 = ?", "  two  spaces\nand a line",
         "<|im_start|>user\nhi<|im_end|>"]
IDS = torch.randint(0, 250, (2, 24), generator=torch.Generator().manual_seed(0))


def cli(*args):
    return subprocess.run([sys.executable, "-m", "mini_grpo", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, env=clean_env(),
                          timeout=300)


def exported(tmp_path, family: str, qtype: str = "f32"):
    """(directory, GGUF file) of a tiny `family` model: the file written by write_gguf."""
    lm = tiny_lm_dir(tmp_path / family, family)
    model, tok = load_hf_model(lm), HFTokenizer.from_dir(lm)
    return lm, write_gguf(model, tok, tmp_path / f"{family}-{qtype}.gguf", qtype)


def hf_logits(path, gguf_file=None):
    kw = {"gguf_file": gguf_file.name} if gguf_file else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_file.parent if gguf_file else path, dtype=torch.float32, **kw).eval()
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_export_and_import_against_transformers(tmp_path, family):
    lm, file = exported(tmp_path, family)
    want = hf_logits(lm)
    theirs = hf_logits(lm, file)  # transformers reads our file: names, q/k order, metadata
    torch.testing.assert_close(theirs, want, rtol=0, atol=1e-5)
    model, tok = load_gguf(file)  # and we read it as they do
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(IDS), theirs, rtol=0, atol=1e-5)
    original = HFTokenizer.from_dir(lm)
    for text in TEXTS:
        assert tok.encode(text) == original.encode(text), text
        assert tok.decode(tok.encode(text)) == original.decode(original.encode(text))
    assert tok.chat_template == original.chat_template
    assert (tok.eos_ids, tok.pad_id) == (original.eos_ids, original.pad_id)
    assert tok.encode_prompt("hi") == original.encode_prompt("hi")
    assert model.hf_config["model_type"] == family


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "f16", "bf16"])
def test_every_written_type_dequantizes_as_transformers_does(tmp_path, qtype):
    lm, file = exported(tmp_path, "llama", qtype)
    assert {gguf.GGMLQuantizationType(t.qtype).name.lower() for name, t in
            read_gguf(file).tensors.items() if len(t.shape) == 2} == {qtype}
    model, _ = load_gguf(file)
    with torch.no_grad():
        ours = model.eval()(IDS)
    torch.testing.assert_close(ours, hf_logits(lm, file), rtol=0, atol=1e-5)
    # how far each type moves the logits (~N(0, 0.3) here) from the fp32 weights
    bound = {"f16": 1e-2, "bf16": 0.03, "q8_0": 0.03, "q5_0": 0.1, "q5_1": 0.1,
             "q4_0": 0.2, "q4_1": 0.2}[qtype]
    assert (ours - hf_logits(lm)).abs().max() < bound


def test_digits_pre_tokenizer_round_trips(tmp_path):
    """SmolLM2's pre-tokenizer (each digit its own piece) is `smollm` in the file, and comes
    back splitting digits, as llama.cpp splits them."""
    from tokenizers import pre_tokenizers

    lm = tiny_lm_dir(tmp_path / "llama", "llama")
    raw = json.loads((lm / "tokenizer.json").read_text())
    tk = HFTokenizer.from_dir(lm).tk
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tk.save(str(lm / "tokenizer.json"))
    assert raw["pre_tokenizer"] != json.loads((lm / "tokenizer.json").read_text())[
        "pre_tokenizer"]
    file = write_gguf(load_hf_model(lm), HFTokenizer.from_dir(lm), tmp_path / "d.gguf")
    assert read_gguf(file).meta["tokenizer.ggml.pre"] == "smollm"
    _, tok = load_gguf(file)
    pieces = [tok.tk.id_to_token(i) for i in tok.encode("x 2024")]
    assert pieces[-4:] == ["2", "0", "2", "4"]
    assert tok.encode("x 2024") == HFTokenizer.from_dir(lm).encode("x 2024")


def test_cli_import_sample_and_export(tmp_path):
    lm, file = exported(tmp_path, "llama")
    out = tmp_path / "imported"
    r = cli("import-gguf", file, out)
    assert r.returncode == 0, r.stderr[-2000:]
    torch.testing.assert_close(hf_logits(out), hf_logits(lm), rtol=0, atol=1e-5)
    r = cli("import-gguf", file, out)  # again over its own import: allowed
    assert r.returncode == 0, r.stderr[-2000:]

    # sample a GGUF file: greedy, as transformers generates from the same file
    prompt = "e2e4 e7e5:"
    r = cli("sample", "--checkpoint", file, "--prompt", prompt, "--greedy", "--json",
            "--max_new_tokens", 6)
    assert r.returncode == 0, r.stderr[-2000:]
    tok = transformers.AutoTokenizer.from_pretrained(lm)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        file.parent, gguf_file=file.name, dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                  add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    gen = model.generate(ids, max_new_tokens=6, do_sample=False)
    want = tok.decode(gen[0, ids.size(1):], skip_special_tokens=True)
    assert json.loads(r.stdout.strip().splitlines()[-1])["completion"] == want

    # export a GGUF checkpoint to GGUF (q8_0), and over its own earlier export
    for _ in range(2):
        r = cli("export", "--checkpoint", file, "--output", tmp_path / "x.gguf",
                "--gguf_type", "q8_0")
        assert r.returncode == 0, r.stderr[-2000:]
    assert read_gguf(tmp_path / "x.gguf").meta["general.file_type"] == 7  # MOSTLY_Q8_0


def test_commands_never_overwrite_what_they_did_not_write(tmp_path):
    _, file = exported(tmp_path, "llama")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    r = cli("import-gguf", file, mine)
    assert r.returncode == 2 and "notes.txt" in r.stderr and "Traceback" not in r.stderr
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    notes = tmp_path / "notes.gguf"
    notes.write_text("my notes")
    r = cli("export", "--checkpoint", file, "--output", notes)
    assert r.returncode == 2 and "not overwritten" in r.stderr, r.stderr
    assert notes.read_text() == "my notes"
    out = tmp_path / "imported"
    assert cli("import-gguf", file, out).returncode == 0
    (out / "notes.txt").write_text("added to an earlier import")  # then not ours alone
    r = cli("import-gguf", file, out)
    assert r.returncode == 2 and "notes.txt" in r.stderr, r.stderr
    assert (out / "notes.txt").read_text() == "added to an earlier import"
    r = cli("import-gguf", file, tmp_path / "missing" / "out")  # parents made, as mkdir -p
    assert r.returncode == 0 and (tmp_path / "missing" / "out" / "config.json").is_file()
    r = cli("export", "--checkpoint", file, "--output", tmp_path / "new" / "dir" / "x.gguf")
    assert r.returncode == 0 and read_gguf(tmp_path / "new" / "dir" / "x.gguf").tensors, r.stderr
    r = cli("export", "--checkpoint", file, "--output", notes / "x.gguf")  # a file in the way
    assert r.returncode == 2 and f"{notes} is not a directory" in r.stderr, r.stderr


def edit(raw: bytes, old: bytes, new: bytes) -> bytes:
    assert old in raw
    return raw.replace(old, new, 1)


@pytest.mark.parametrize("damage, needle", [
    (lambda raw: b"", "cannot read"),
    (lambda raw: b"GGML" + raw[4:], "no GGUF magic"),
    (lambda raw: raw[:4] + (9).to_bytes(4, "little") + raw[8:], "version 9"),
    (lambda raw: raw[:8] + (2**40).to_bytes(8, "little") + raw[16:], "tensors"),
    (lambda raw: raw[:len(raw) // 2], "not in the file"),
    (lambda raw: raw[:200], "past the end"),
    (lambda raw: edit(raw, b"llama", b"mamba"), "architecture 'mamba'"),
    (lambda raw: edit(raw, b"gpt-2", b"gpt-9"), "tokenizer.ggml.pre 'gpt-9'"),
    (lambda raw: edit(raw, b"blk.0.ffn_up", b"blk.0.ffn_xx"), "blk.0.ffn_xx"),
])
def test_bad_files_are_one_line_errors(tmp_path, damage, needle):
    _, file = exported(tmp_path, "llama")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(damage(file.read_bytes()))
    with pytest.raises(CheckpointError) as e:
        load_gguf(bad)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    r = cli("sample", "--checkpoint", bad, "--prompt", "x")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_huge_arrays_are_refused_before_allocating(tmp_path):
    """An array claiming 2^40 strings, or a string of 2^50 bytes, fails at once: the counts
    are bounded by limits and by the bytes the file has left."""
    _, file = exported(tmp_path, "llama")
    raw = file.read_bytes()
    key = b"tokenizer.ggml.tokens"
    at = raw.index(key) + len(key) + 4 + 4  # past the key, its type (array), the item type
    n = int.from_bytes(raw[at:at + 8], "little")
    for count, needle in ((2**40, "items"), (n + 10**6, "cannot fit")):
        (tmp_path / "bad.gguf").write_bytes(raw[:at] + count.to_bytes(8, "little") +
                                            raw[at + 8:])
        with pytest.raises(CheckpointError, match=needle):
            read_gguf(tmp_path / "bad.gguf")
    first = at + 8  # the first token's length
    (tmp_path / "bad.gguf").write_bytes(raw[:first] + (2**50).to_bytes(8, "little") +
                                        raw[first + 8:])
    with pytest.raises(CheckpointError, match="a string of"):
        read_gguf(tmp_path / "bad.gguf")


def test_init_from_a_gguf_file_trains_and_exports(tmp_path):
    from conftest import tiny

    from mini_grpo.job import train

    lm, file = exported(tmp_path, "qwen2")
    out = tmp_path / "run"
    train(tiny(out, init_from=str(file), max_steps=2, block_size=256))
    assert json.loads((out / "hf" / "config.json").read_text())["model_type"] == "qwen2"
    moved = (hf_logits(out / "hf") - hf_logits(lm)).abs().max()
    assert 0 < moved < 0.5  # trained a little, from the file's weights
    shutil.rmtree(tmp_path / "qwen2")  # the run's hf/ stands alone
    tok = HFTokenizer.from_dir(out / "hf")
    assert tok.encode_prompt("e2e4:") == load_gguf(file, weights=False)[1].encode_prompt("e2e4:")


def test_vllm_serve_takes_a_gguf_files_shapes(tmp_path):
    """`mini-grpo vllm-serve --model X.gguf`: the engine's config comes from the file's
    metadata, and matches what the trainer checks a server against (its policy's
    architecture; a GGUF file's floats are float32's)."""
    from mini_grpo.engines.client import _same, architecture
    from mini_grpo.engines.server import served_model, served_weights
    from mini_grpo.engines.vllm import engine_config

    lm, file = exported(tmp_path, "qwen2")
    served, policy, hf = (architecture(engine_config(m, torch.float32)) for m in (
        served_model(str(file)), load_gguf(file)[0], served_model(str(lm))))
    # the directory leaves head_dim out, the GGUF file states it: the same model either way
    assert _same(served, policy) and _same(served, hf) and served["head_dim"] == 16, \
        (served, policy, hf)
    # the weights it takes (names, shapes) are those the trainer of the directory sends
    sent = served_weights(load_hf_model(lm), torch.bfloat16)
    assert served_weights(served_model(str(file)), torch.bfloat16) == sent
    assert served_weights(served_model(str(lm)), torch.bfloat16) == sent
    (tmp_path / "notes.gguf").write_text("my notes")
    with pytest.raises(CheckpointError, match="notes.gguf"):
        served_model(str(tmp_path / "notes.gguf"))
    with pytest.raises(CheckpointError, match="missing.gguf: not found"):
        served_model(str(tmp_path / "missing.gguf"))


def _string(text: str) -> bytes:
    b = text.encode()
    return struct.pack("<Q", len(b)) + b


def _value(v) -> bytes:
    """A metadata value as GGUF stores it: its type, then its bytes."""
    if isinstance(v, list):
        item = 8 if v and isinstance(v[0], str) else 4
        return struct.pack("<IIQ", 9, item, len(v)) + b"".join(_value(x)[4:] for x in v)
    if isinstance(v, str):
        return struct.pack("<I", 8) + _string(v)
    kind, fmt = (7, "<?") if isinstance(v, bool) else (4, "<I") if isinstance(v, int) else \
        (6, "<f")
    return struct.pack("<I", kind) + struct.pack(fmt, v)


def rewritten(file, out, meta=None, tensors=lambda ts: ts):
    """GGUF file `file` written again as `out`, by hand (GGUFWriter refuses what these tests
    write): its metadata updated by `meta` (None removes a key), its tensors, a list of
    (name, torch-order shape, type, bytes), replaced by tensors(list)."""
    f, raw = read_gguf(file), file.read_bytes()
    keys = {k: v for k, v in {**f.meta, **(meta or {})}.items() if v is not None}
    ts = tensors([(n, t.shape, t.qtype, raw[t.offset:t.offset + t.nbytes])
                  for n, t in f.tensors.items()])
    head = b"GGUF" + struct.pack("<IQQ", 3, len(ts), len(keys))
    head += b"".join(_string(k) + _value(v) for k, v in keys.items())
    data = b""
    for name, shape, qtype, blob in ts:
        head += _string(name) + struct.pack("<I", len(shape)) + \
            b"".join(struct.pack("<Q", d) for d in reversed(shape)) + \
            struct.pack("<IQ", qtype, len(data))
        data += blob + bytes(-len(blob) % 32)  # general.alignment: 32
    out.write_bytes(head + bytes(-len(head) % 32) + data)
    return out


def refused(path, message):
    with pytest.raises(CheckpointError) as e:
        load_gguf(path)
    assert str(e.value) == message


def test_a_tensor_of_a_type_no_weight_comes_in_is_refused_in_one_line(tmp_path, monkeypatch):
    """An integer (or F64) tensor is refused by its type before any byte is read; a type
    the gguf package cannot dequantize is one line too, not the BufferError of a map closed
    while the error holds a view of it."""
    _, file = exported(tmp_path, "llama")
    I32 = gguf.GGMLQuantizationType.I32
    bad = rewritten(file, tmp_path / "i32.gguf", tensors=lambda ts: [
        (n, s, I32 if n == "output_norm.weight" else q, b) for n, s, q, b in ts])
    refused(bad, f"{bad}: tensor output_norm.weight is of type I32, not a weight type "
                 f"(floating point or quantized)")

    def unknown(data, qtype):
        raise NotImplementedError(f"Dequantization for {qtype.name} is not yet implemented")

    monkeypatch.setattr(gguf.quants, "dequantize", unknown)
    refused(file, f"{file}: tensor token_embd.weight: type F32 cannot be dequantized (the "
                  f"gguf package has no code for it)")


def test_a_layer_index_is_read_as_llama_cpp_writes_it(tmp_path):
    """ASCII digits without a leading zero: a superscript digit, or blk.01 beside blk.1
    (the same layer twice), is a tensor of no Llama model."""
    _, file = exported(tmp_path, "llama")
    bad = rewritten(file, tmp_path / "sup.gguf", tensors=lambda ts: [
        (n.replace("blk.1.", "blk.\u00b9.", 1), s, q, b) for n, s, q, b in ts])
    refused(bad, f"{bad}: tensor blk.\u00b9.attn_norm.weight is not one of the Llama family's")
    bad = rewritten(file, tmp_path / "dup.gguf", tensors=lambda ts: ts + [
        (n.replace("blk.1.", "blk.01.", 1), s, q, b) for n, s, q, b in ts
        if n.startswith("blk.1.")])
    refused(bad, f"{bad}: tensor blk.01.attn_norm.weight is not one of the Llama family's")


def test_linear_rope_scaling_is_read_as_llama_cpp_reads_it(tmp_path):
    """write_gguf's linear scaling (rope.scaling.type + factor) comes back; a factor alone
    is linear (llama.cpp's default type), so is the older rope.scale_linear; none is none;
    another type is refused."""
    lm = tiny_lm_dir(tmp_path / "llama", "llama")
    config = json.loads((lm / "config.json").read_text())
    config["rope_parameters"].update(rope_type="linear", factor=4.0)
    (lm / "config.json").write_text(json.dumps(config))
    model = load_hf_model(lm).eval()
    linear = {"rope_type": "linear", "factor": 4.0}
    assert model.cfg.rope_scaling == linear
    file = write_gguf(model, HFTokenizer.from_dir(lm), tmp_path / "linear.gguf", "f32")
    again, _ = load_gguf(file)
    assert again.cfg.rope_scaling == linear
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(IDS), model(IDS), rtol=0, atol=1e-5)
    a = "llama.rope."
    for meta, want in [({a + "scaling.type": None}, linear),
                       ({a + "scaling.type": None, a + "scaling.factor": None,
                         a + "scale_linear": 4.0}, linear),
                       ({a + "scaling.type": "none"}, {}),
                       ({a + "scaling.factor": 0.0}, {})]:
        other = rewritten(file, tmp_path / "other.gguf", meta)
        assert load_gguf(other, weights=False)[0].cfg.rope_scaling == want, meta
    bad = rewritten(file, tmp_path / "yarn.gguf", {a + "scaling.type": "yarn"})
    refused(bad, f"{bad}: llama.rope.scaling.type 'yarn' is not supported (none, linear)")


@pytest.mark.parametrize("text", ["<s> x", "$A", "$B:1"])
def test_a_bos_token_is_added_whatever_its_text(tmp_path, text):
    """The BOS added at a sequence's start is its id, its text never parsed as a template
    ("<s> x" would be two tokens, "$A" the text again)."""
    _, file = exported(tmp_path, "llama")
    tokens = read_gguf(file).meta["tokenizer.ggml.tokens"]
    tokens[1] = text  # <|im_start|>, a control token
    other = rewritten(file, tmp_path / "bos.gguf", {
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.add_bos_token": True})
    _, tok = load_gguf(other, weights=False)
    assert tok.encode("hi") == HFTokenizer.from_dir(tmp_path / "llama").encode("hi")
    assert tok.encode("hi", bos=True) == [1, *tok.encode("hi")]


def test_a_file_without_eos_names_the_key(tmp_path):
    _, file = exported(tmp_path, "llama")
    bad = rewritten(file, tmp_path / "no_eos.gguf", {"tokenizer.ggml.eos_token_id": None})
    refused(bad, f"{bad}: no EOS token (no tokenizer.ggml.eos_token_id)")
