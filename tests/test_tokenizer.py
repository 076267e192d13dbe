import pytest

from mini_grpo.tokenizer import CharTokenizer


def test_round_trip_and_specials(tmp_path):
    tok = CharTokenizer("abc :/")
    text = "a b/c:"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids) == text
    assert tok.vocab_size == 4 + 6
    tok.save(tmp_path / "tok.json")
    assert CharTokenizer.load(tmp_path / "tok.json") == tok


def test_decode_stops_at_eos_and_drops_pad():
    tok = CharTokenizer("ab")
    a, b = tok.encode("ab")
    assert tok.decode([tok.pad_id, a, b, tok.eos_id, a]) == "ab"


def test_unknown_characters_map_to_unk_or_raise_when_strict():
    tok = CharTokenizer("ab")
    assert tok.encode("axb") == [tok.stoi["a"], tok.unk_id, tok.stoi["b"]]
    assert tok.decode(tok.encode("axb")) == "a?b"
    assert tok.unknown_chars("axyb") == ["x", "y"]
    with pytest.raises(ValueError, match="'x'"):
        tok.encode("axb", strict=True)


def test_load_rejects_other_files(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="not a mini-grpo tokenizer"):
        CharTokenizer.load(p)
