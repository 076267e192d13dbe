"""A GGUF file's tokenizer (`tokenizer.ggml.*` metadata) <-> a `tokenizers` byte-level BPE:
the tokens, merges and token types, the special ids, the chat template, and the pre-tokenizer
`tokenizer.ggml.pre` names (`PRE_TOKENIZERS`: how llama.cpp splits text before the merges).
models/gguf.py reads and writes the rest of the file."""

from __future__ import annotations

import json

from ..checkpoint import CheckpointError

_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
          r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3 = _QWEN2.replace(r"\p{L}+|\p{N}|", r"\p{L}+|\p{N}{1,3}|")
# tokenizer.ggml.pre -> how text is split before the merges, as llama.cpp splits it: the
# first name of each row is the one exports write
PRE_TOKENIZERS = {
    ("gpt-2",): (("ByteLevel", True),),
    ("smollm", "starcoder", "refact", "codeshell"): (("Digits", True), ("ByteLevel", True)),
    ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3"):
        (("Split", _LLAMA3), ("ByteLevel", False)),
    ("qwen2", "deepseek-r1-qwen"): (("Split", _QWEN2), ("ByteLevel", False)),
}
NORMAL, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 3, 4, 5, 6


def _pre_tokenizer(signature):
    from tokenizers import Regex, pre_tokenizers

    parts = []
    for kind, arg in signature:
        if kind == "ByteLevel":
            parts.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=arg))
        elif kind == "Digits":
            parts.append(pre_tokenizers.Digits(individual_digits=arg))
        else:
            parts.append(pre_tokenizers.Split(Regex(arg), behavior="isolated"))
    return parts[0] if len(parts) == 1 else pre_tokenizers.Sequence(parts)


def _signature(pre: dict | None):
    """A tokenizer.json pre_tokenizer reduced to what PRE_TOKENIZERS compares."""
    parts = (pre or {}).get("pretokenizers", [pre]) if (pre or {}).get("type") == "Sequence" \
        else [pre or {}]
    out = []
    for p in parts:
        kind = p.get("type")
        if kind == "ByteLevel" and not p.get("add_prefix_space"):
            out.append((kind, bool(p.get("use_regex", True))))
        elif kind == "Digits":
            out.append((kind, bool(p.get("individual_digits"))))
        elif kind == "Split" and p.get("behavior") == "Isolated" and not p.get("invert"):
            out.append((kind, (p.get("pattern") or {}).get("Regex")))
        else:
            return None
    return tuple(out)


def gguf_tokenizer(f):
    """The HFTokenizer that the metadata of `f` (a read_gguf GGUFFile) describes."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    from ..tokenizer import HFTokenizer

    kind = f.meta.get("tokenizer.ggml.model")
    spm = kind == "llama" and f.meta.get("general.architecture") == "gemma3"
    if kind != "gpt2" and not spm:
        raise CheckpointError(f"{f.path}: tokenizer.ggml.model {str(kind)[:40]!r} is not "
                              f"supported (gpt2: byte-level BPE; llama: Gemma 3's "
                              f"SentencePiece)")
    pre = f.meta.get("tokenizer.ggml.pre", "gpt-2")
    signature = next((s for names, s in PRE_TOKENIZERS.items() if pre in names), None)
    if signature is None and not spm:
        raise CheckpointError(f"{f.path}: tokenizer.ggml.pre {str(pre)[:40]!r} is not "
                              f"supported ({', '.join(n for ns in PRE_TOKENIZERS for n in ns)})")
    tokens, types, merges = _vocab_lists(f, spm)
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise CheckpointError(f"{f.path}: tokenizer.ggml.tokens lists a token twice")
    pairs = spm_merges(tokens) if spm else [tuple(m.split(" ")) for m in merges]
    try:
        tk = Tokenizer(models.BPE(vocab=vocab, merges=pairs, **_spm_model(f, tokens, spm)))
    except Exception as e:  # the library's own errors: a merge of unknown tokens
        raise CheckpointError(f"{f.path}: tokenizer.ggml.merges: {str(e)[:200]}") from None
    if spm:  # Gemma's: spaces as "\u2581", split after each, bytes for unknown characters
        tk.normalizer = normalizers.Replace(" ", "\u2581")
        tk.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "),
                                        decoders.ByteFallback(), decoders.Fuse()])
    else:
        tk.pre_tokenizer = _pre_tokenizer(signature)
        tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, k in zip(tokens, types) if k == CONTROL])
    tk.add_tokens([AddedToken(t, special=False, normalized=False)
                   for t, k in zip(tokens, types) if k == USER_DEFINED])
    specials = _specials(f, tokens)
    bos = specials.get("bos_token")
    if f.meta.get("tokenizer.ggml.add_bos_token") is True and bos is not None:
        # the template names BOS by a key of ours, its text given apart: a template string
        # parses its words ("<s> x" is two, "$A" the text itself)
        tk.post_processor = processors.TemplateProcessing(
            single="BOS $A", pair="BOS $A BOS $B",
            special_tokens=[{"id": "BOS", "ids": [vocab[bos]], "tokens": [bos]}])
    template = f.meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"{f.path}: tokenizer.chat_template must be a string")
    extra = [f.meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
             if k in f.meta]
    try:
        return HFTokenizer(tk, specials, template, extra,
                           {"chat_template": f"{f.path}: tokenizer.chat_template",
                            "eos": f"{f.path}: tokenizer.ggml.eot_token_id",
                            "no_eos": f"{f.path}: no EOS token (no tokenizer.ggml.eos_token_id)",
                            "tokenizer": f"{f.path}: tokenizer.ggml"})
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def _vocab_lists(f, spm: bool) -> tuple[list[str], list[int], list[str]]:
    """The file's tokens, their types and its merges ("a b"), each checked; a SentencePiece
    token of spaces alone comes back as the "\u2581"s it is looked up by."""
    tokens, merges = f.meta.get("tokenizer.ggml.tokens"), f.meta.get("tokenizer.ggml.merges", [])
    types = f.meta.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens or []))
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise CheckpointError(f"{f.path}: tokenizer.ggml.tokens must be a list of strings")
    if not isinstance(types, list) or len(types) != len(tokens) or \
            not all(isinstance(t, int) for t in types):
        raise CheckpointError(f"{f.path}: tokenizer.ggml.token_type must give one integer per "
                              f"token ({len(tokens)})")
    if not isinstance(merges, list) or not all(isinstance(m, str) and m.count(" ") == 1
                                               for m in merges):
        raise CheckpointError(f"{f.path}: tokenizer.ggml.merges must be strings 'a b'")
    if spm:  # a token of spaces alone is stored with spaces, looked up with "\u2581"
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    return tokens, types, merges


def _specials(f, tokens: list[str]) -> dict[str, str]:
    """{"bos_token": text, ...} from the file's special token ids, each checked."""
    specials = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("pad_token", "padding_token_id"), ("unk_token", "unknown_token_id")):
        i = f.meta.get(f"tokenizer.ggml.{key}")
        if i is None:
            continue
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(tokens):
            raise CheckpointError(f"{f.path}: tokenizer.ggml.{key} {i!r:.40} is not a token "
                                  f"id (0 to {len(tokens) - 1})")
        specials[name] = tokens[i]
    return specials


def spm_merges(tokens: list[str]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies, the file lists none: each token cut
    into every pair of tokens, ordered by the token's place in the file (Gemma's scores do not
    follow its merge order; its file order does), then by the left part's length and the
    right's (as transformers rebuilds them: integrations/gguf's gemma_tokenizer)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for rank, token in enumerate(tokens):
        local = [(token[:k], token[k:]) for k in range(1, len(token))
                 if token[:k] in vocab and token[k:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges += [(rank, len(a), len(b), a, b) for a, b in local]
    # transformers sorts by (score, len, len) in reverse with score = -rank, stably
    merges.sort(key=lambda m: (-m[0], m[1], m[2]), reverse=True)
    return [(a, b) for _, _, _, a, b in merges]


def _spm_model(f, tokens: list[str], spm: bool) -> dict:
    """BPE's options for Gemma's SentencePiece: byte fallback, unknown pieces fused into the
    unknown token."""
    if not spm:
        return {}
    unk = f.meta.get("tokenizer.ggml.unknown_token_id")
    if not isinstance(unk, int) or isinstance(unk, bool) or not 0 <= unk < len(tokens):
        raise CheckpointError(f"{f.path}: tokenizer.ggml.unknown_token_id {unk!r:.40} is not a "
                              f"token id (0 to {len(tokens) - 1})")
    return {"byte_fallback": True, "fuse_unk": True, "unk_token": tokens[unk]}


def gguf_vocab(tok, vocab_size: int) -> tuple[list[str], list[int], list[str], str, bool]:
    """(tokens, token types, merges, pre name, add_bos) of an HFTokenizer, for the writer;
    ValueError when it is not a byte-level BPE that llama.cpp can name."""
    spec = json.loads(tok.tk.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError("GGUF export: only byte-level BPE tokenizers are supported")
    signature = _signature(spec.get("pre_tokenizer"))
    pre = next((names[0] for names, s in PRE_TOKENIZERS.items() if s == signature), None)
    if pre is None:
        raise ValueError(f"GGUF export: the tokenizer's pre-tokenizer ({signature}) is none of "
                         f"those llama.cpp names here ({', '.join(n[0] for n in PRE_TOKENIZERS)})")
    tokens, types = [f"[PAD{i}]" for i in range(vocab_size)], [UNUSED] * vocab_size
    for t, i in model["vocab"].items():
        if i < vocab_size:
            tokens[i], types[i] = t, NORMAL
    for added in spec.get("added_tokens") or []:
        if added["id"] < vocab_size:
            tokens[added["id"]] = added["content"]
            types[added["id"]] = CONTROL if added.get("special") else USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    add_bos = len(tok.tk.encode("a", add_special_tokens=True).ids) > \
        len(tok.tk.encode("a", add_special_tokens=False).ids)
    return tokens, types, merges, pre, add_bos


def spm_vocab(tok, vocab_size: int) -> tuple[list[str], list[int], bool]:
    """(pieces, token types, add_bos) of a Gemma-style HFTokenizer (a BPE with byte fallback),
    for the writer; ValueError when it is not one."""
    spec = json.loads(tok.tk.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or not model.get("byte_fallback"):
        raise ValueError("GGUF export of Gemma 3: its tokenizer must be a BPE with byte "
                         "fallback (Gemma's own)")
    tokens, types = [f"<unused{i}>" for i in range(vocab_size)], [UNUSED] * vocab_size
    for t, i in model["vocab"].items():
        if i < vocab_size:
            byte = len(t) == 6 and t.startswith("<0x") and t.endswith(">")
            tokens[i], types[i] = t, BYTE if byte else NORMAL
    for added in spec.get("added_tokens") or []:
        if added["id"] < vocab_size:
            tokens[added["id"]] = added["content"]
            types[added["id"]] = CONTROL if added.get("special") else USER_DEFINED
    add_bos = len(tok.tk.encode("a", add_special_tokens=True).ids) > \
        len(tok.tk.encode("a", add_special_tokens=False).ids)
    return tokens, types, add_bos
