"""The parts of a tokenizer.json that run on every text (normalizer, pre_tokenizer,
post_processor, decoder), checked before use (tokenizer.HFTokenizer's constructor): those of
real tokenizers, by allowlist, bounded in how much text they may make of a character
(MAX_GROWTH) and in the ids a post-processor adds (MAX_ADDED_IDS). Six Replace("a" -> "a" * 10)
in a row had made a million ids of "a", eight aborted the process."""

from __future__ import annotations

import json

from .fields import ConfigError, show

# By allowlist: those of the tokenizers in use (GPT-2 and SmolLM2's byte-level BPE, Llama 3,
# Qwen2/3, Mistral and Llama 2, Gemma), each with how many characters it may make of one at
# worst: Unicode's bounds for the normal forms, a character's four UTF-8 bytes for ByteLevel,
# None where its settings say (_growth). A Sequence of parts multiplies them.
_PARTS = {
    "normalizer": {"NFC": 3, "NFD": 4, "NFKC": 18, "NFKD": 18, "Lowercase": 3, "Strip": 1,
                   "StripAccents": 1, "Prepend": None, "Replace": None},
    "pre_tokenizer": {"ByteLevel": 4, "Metaspace": None, "Split": 1, "Digits": 1,
                      "Punctuation": 1, "Whitespace": 1, "WhitespaceSplit": 1},
    "decoder": {"ByteLevel": 1, "Metaspace": 1, "ByteFallback": 1, "Fuse": 1, "Strip": 1,
                "Replace": None},
}
_SEQUENCE = {"normalizer": "normalizers", "pre_tokenizer": "pretokenizers",
             "decoder": "decoders", "post_processor": "processors"}
# the most characters a text may become per character, encoded (normalizer, then
# pre-tokenizer) or decoded: a real tokenizer's worst is NFKC's 18 times ByteLevel's 4; six
# Replace("a" -> "a" * 10) in a row make a million ids of "a", eight abort the process
MAX_GROWTH = 100
MAX_ADDED_IDS = 16  # the ids a post-processor adds to a text (BOS, EOS: a real one adds 1 to 4)


def check_parts(tk, where: str) -> None:
    """The normalizer, pre_tokenizer, post_processor and decoder of a `tokenizers` Tokenizer
    (as the library parsed them from `where`): types of _PARTS, growth at most MAX_GROWTH,
    post-processing at most MAX_ADDED_IDS ids. ConfigError naming the part otherwise."""
    spec = {slot: json.loads(part.__getstate__()) for slot in (*_PARTS, "post_processor")
            if (part := getattr(tk, slot)) is not None}  # the part's JSON, as the file has it
    growth = {slot: _growth(spec[slot], slot, slot, where) if slot in spec else 1
              for slot in _PARTS}
    if growth["normalizer"] * growth["pre_tokenizer"] > MAX_GROWTH:
        raise ConfigError(f"{where}: normalizer and pre_tokenizer: may make more than "
                          f"{MAX_GROWTH} characters of one (Replace by longer contents?)")
    if growth["decoder"] > MAX_GROWTH:
        raise ConfigError(f"{where}: decoder: may make more than {MAX_GROWTH} characters of "
                          f"one (Replace by longer contents?)")
    if "post_processor" in spec and \
            _added_ids(spec["post_processor"], "post_processor", where) > MAX_ADDED_IDS:
        raise ConfigError(f"{where}: post_processor: adds more than {MAX_ADDED_IDS} ids to a "
                          f"text")


def _growth(part: dict, field: str, slot: str, where: str) -> int:
    """How many characters `part` (the `field` of a tokenizer.json, a `slot` part) may make
    of one, at most MAX_GROWTH + 1 (a Sequence of a million parts stays a small number)."""
    kind, key = part.get("type"), _SEQUENCE[slot]
    if kind == "Sequence":
        growth = 1
        for i, p in enumerate(part[key]):
            growth = min(growth * _growth(p, f"{field}.{key}[{i}]", slot, where),
                         MAX_GROWTH + 1)
        return growth
    if kind not in _PARTS[slot]:
        raise ConfigError(f"{where}: {field}: type {show(kind)} is not supported ("
                          f"{', '.join(['Sequence', *_PARTS[slot]])})")
    if kind == "Replace":  # each match of its pattern becomes its content
        pattern, content = part["pattern"].get("String"), part["content"]
        # a regex (or an empty string) may match nothing: the content before every character
        return max(1, -(-len(content) // len(pattern))) if pattern else len(content) + 1
    if kind == "Prepend":  # before every text between special tokens: one character at worst
        return 1 + len(part["prepend"])
    if kind == "Metaspace" and slot == "pre_tokenizer":  # a space becomes it, and before words
        return 1 + len(part["replacement"])
    return _PARTS[slot][kind]


def _added_ids(part: dict, field: str, where: str) -> int:
    """How many ids the post-processor `field` adds to a text (or a pair of texts)."""
    kind = part.get("type")
    if kind == "Sequence":
        return sum(_added_ids(p, f"{field}.processors[{i}]", where)
                   for i, p in enumerate(part["processors"]))
    if kind == "ByteLevel":
        return 0
    if kind in ("BertProcessing", "RobertaProcessing"):  # <s> A </s></s> B </s>
        return 4
    if kind == "TemplateProcessing":
        tokens = part["special_tokens"]  # a token's text -> the ids it adds
        return max(sum(len(tokens.get(p["SpecialToken"]["id"], {}).get("ids", ()))
                       for p in part[key] if "SpecialToken" in p) for key in ("single", "pair"))
    raise ConfigError(f"{where}: {field}: type {show(kind)} is not supported (Sequence, "
                      f"ByteLevel, TemplateProcessing, BertProcessing, RobertaProcessing)")
