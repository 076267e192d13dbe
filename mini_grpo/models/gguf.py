"""GGUF files (llama.cpp's format) in and out: a model of the Llama family or Gemma 3 (arch
gemma3: its SentencePiece vocabulary, norms stored as 1 + w) and its tokenizer.

    model, tok = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")     # dequantized, fp32
    write_gguf(model, tok, "out.gguf", "q8_0")                      # llama.cpp / ollama run it

In: our own bounded parser (gguf_file.py's `read_gguf`) reads the header, checked before
anything is allocated: a hostile file is one line (CheckpointError, exit 2). The `gguf`
package (llama.cpp's own Python) dequantizes the tensors; the metadata becomes a config.json
(checked as one, hf.py), the tensor names ours (`_NAMES`), llama.cpp's q/k row permutation
is undone for `llama` (its converter applies it there alone), and the byte-level BPE
tokenizer is rebuilt (gguf_vocab.py).

Out: `gguf.GGUFWriter`, the same tables the other way, q/k permuted again, the weights in
f32, f16, bf16, q8_0 or q5/q4 (`gguf.quants`, llama.cpp's reference quantizers; 1-D tensors
stay f32, as llama.cpp's converter keeps them).
"""

from __future__ import annotations

import contextlib
import mmap
import re
from pathlib import Path

import numpy as np
import torch

from ..checkpoint import CheckpointError, check_shapes
from ..outputs import write_atomic
from . import CausalLM, build, check_size
from .gguf_file import GGUFFile, TensorInfo, read_gguf
from .gguf_vocab import gguf_tokenizer, gguf_vocab, spm_vocab

ARCHS = ("llama", "qwen2", "qwen3")  # general.architecture -> config.json's model_type
GEMMA3_SWA_EVERY = 6  # llama.cpp's Gemma 3: each 6th layer attends fully, the others slide
GEMMA3_LOCAL_BASE = 10000.0  # ... with this RoPE base, which its files do not store
OURS = "mini_grpo.export"  # a metadata key of the files write_gguf writes


# metadata -> config.json

def _meta(f: GGUFFile, key: str, kind: type, default=None, lo=1, hi=1 << 24):
    """A metadata value of `kind` within [lo, hi]; CheckpointError naming the key."""
    v = f.meta.get(key, default)
    if kind is float and type(v) is int:
        v = float(v)
    ok = isinstance(v, kind) and not isinstance(v, bool)
    if not ok or (kind in (int, float) and not lo <= v <= hi):
        want = f"a number in [{lo}, {hi}]" if kind in (int, float) else kind.__name__
        raise CheckpointError(f"{f.path}: metadata {key} must be {want}, got {v!r:.80}")
    return v


def _rope_scaling(f: GGUFFile, a: str) -> dict | None:
    """config.json's rope_scaling from the keys llama.cpp reads, as it reads them: the type
    linear unless named, the factor rope.scaling.factor or else the older rope.scale_linear,
    none (or a factor of 0) no scaling; any other type is refused, scaled or not."""
    kind = f.meta.get(a + "rope.scaling.type", "linear")
    if kind not in ("none", "linear"):
        raise CheckpointError(f"{f.path}: {a}rope.scaling.type {kind!r:.40} is not supported "
                              f"(none, linear)")
    key = a + ("rope.scaling.factor" if a + "rope.scaling.factor" in f.meta else
               "rope.scale_linear")
    factor = _meta(f, key, float, 0.0, lo=0)
    if kind == "none" or factor == 0:
        return None
    return {"rope_type": "linear", "factor": factor}


def hf_config(f: GGUFFile) -> dict:
    """The Hugging Face config.json the metadata describes (checked again as one by hf.py)."""
    arch = f.meta.get("general.architecture")
    if arch == "gemma3":
        return _gemma3_config(f)
    if arch not in ARCHS:
        raise CheckpointError(f"{f.path}: general.architecture {str(arch)[:60]!r} is not "
                              f"supported ({', '.join(ARCHS)}: the Llama family)")
    a = arch + "."
    if f.meta.get(a + "attention.sliding_window", 0) not in ("none", 0):
        raise CheckpointError(f"{f.path}: {a}attention.sliding_window "
                              f"{f.meta[a + 'attention.sliding_window']!r:.40} is not supported")
    if "rope_freqs.weight" in f.tensors:
        raise CheckpointError(f"{f.path}: rope_freqs (Llama 3.1's rope scaling) is not "
                              f"supported")
    config = _sizes(f, a, rope_base=10000.0)
    head_dim = config["head_dim"]
    rot = f.meta.get(a + "rope.dimension_count", head_dim)
    if rot != head_dim:
        raise CheckpointError(f"{f.path}: {a}rope.dimension_count {rot!r:.20} differs from "
                              f"the head size {head_dim} (partial rotary is not supported)")
    blk = "blk.0."
    return {"model_type": arch, "architectures": [f"{arch.capitalize()}ForCausalLM"],
            **config, "hidden_act": "silu",
            "attention_bias": arch == "llama" and blk + "attn_q.bias" in f.tensors,
            "mlp_bias": blk + "ffn_gate.bias" in f.tensors}


def _gemma3_config(f: GGUFFile) -> dict:
    """Gemma 3's config.json (gemma3_text) from llama.cpp's keys and the rules its loader
    adds: the sliding pattern and local RoPE base above, the scores scaled by the head size
    (27B, of 62 layers: by hidden / heads)."""
    a = "gemma3."
    config = _sizes(f, a, rope_base=1e6)
    n_layer, heads = config["num_hidden_layers"], config["num_attention_heads"]
    return {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
            **config, "hidden_activation": "gelu_pytorch_tanh",
            "rope_local_base_freq": GEMMA3_LOCAL_BASE,
            "sliding_window": _meta(f, a + "attention.sliding_window", int, 4096),
            "layer_types": ["full_attention" if (i + 1) % GEMMA3_SWA_EVERY == 0
                            else "sliding_attention" for i in range(n_layer)],
            "query_pre_attn_scalar": config["hidden_size"] // heads if n_layer == 62
            else config["head_dim"]}


def _sizes(f: GGUFFile, a: str, rope_base: float) -> dict:
    """What llama.cpp's keys `a`* say alike for each family: sizes, norm epsilon, RoPE (base
    `rope_base` where the file gives none), tied head (no output.weight), as config.json
    names them."""
    n_embd = _meta(f, a + "embedding_length", int)
    n_head = _meta(f, a + "attention.head_count", int, hi=1 << 12)
    tokens = f.meta.get("tokenizer.ggml.tokens")
    return {"vocab_size": _meta(f, a + "vocab_size", int,
                                len(tokens) if isinstance(tokens, list) else None),
            "hidden_size": n_embd,
            "max_position_embeddings": _meta(f, a + "context_length", int, 2048),
            "num_hidden_layers": _meta(f, a + "block_count", int, hi=1 << 12),
            "intermediate_size": _meta(f, a + "feed_forward_length", int),
            "num_attention_heads": n_head,
            "num_key_value_heads": _meta(f, a + "attention.head_count_kv", int, n_head,
                                         hi=1 << 12),
            "head_dim": _meta(f, a + "attention.key_length", int, n_embd // n_head,
                              hi=1 << 12),
            "rms_norm_eps": _meta(f, a + "attention.layer_norm_rms_epsilon", float, 1e-6,
                                  lo=1e-12, hi=0.5),
            "rope_theta": _meta(f, a + "rope.freq_base", float, rope_base, hi=1e12),
            "rope_scaling": _rope_scaling(f, a),
            "tie_word_embeddings": "output.weight" not in f.tensors, "dtype": "float32"}


# tensor names: theirs <-> ours (the Llama family's parameter names, hf.py)

_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_TOP = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
_THEIRS = {v: k for k, v in _NAMES.items()} | {v: k for k, v in _TOP.items()}
# Gemma 3's four norms a layer (ffn_norm is the one before the MLP there)
_GEMMA3 = {**_NAMES, "post_attention_norm": "post_attention_layernorm",
           "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_GEMMA3_THEIRS = {v: k for k, v in _GEMMA3.items()} | {v: k for k, v in _TOP.items()}
_INDEX = re.compile(r"0|[1-9][0-9]*")


def _ours(name: str, names: dict = _NAMES) -> str | None:
    stem, dot, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if stem in _TOP:
        return f"{_TOP[stem]}.{suffix}"
    parts = stem.split(".")
    # a layer's index as llama.cpp writes it: ASCII digits without a leading zero, so that no
    # two names (blk.1, blk.01) are one layer's
    if len(parts) == 3 and parts[0] == "blk" and _INDEX.fullmatch(parts[1]) and \
            parts[2] in names:
        return f"layers.{parts[1]}.{names[parts[2]]}.{suffix}"
    return None


def _theirs(name: str, theirs: dict = _THEIRS) -> str:
    stem, _, suffix = name.rpartition(".")
    if stem.startswith("layers."):
        _, i, rest = stem.split(".", 2)
        return f"blk.{i}.{theirs[rest]}.{suffix}"
    return f"{theirs[stem]}.{suffix}"


def _permute(w: torch.Tensor, heads: int, undo: bool) -> torch.Tensor:
    """llama.cpp's q/k row order: within each head, the rotary halves interleaved (its
    converter's `permute`); `undo` restores the Hugging Face order."""
    half = (w.shape[0] // heads // 2, 2)
    return w.reshape(heads, *(half if undo else half[::-1]), *w.shape[1:]).transpose(1, 2) \
        .reshape(w.shape)


def _dequantize(buf, info: TensorInfo, where: str) -> torch.Tensor:
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    # the tensor's bytes copied, not a view of the map: an error raised while a view lives
    # would keep the map from closing (BufferError, not the one line)
    raw = np.frombuffer(buf[info.offset:info.offset + info.nbytes], dtype=np.uint8)
    kind = GGMLQuantizationType(info.qtype)
    rows = raw.reshape(-1, info.nbytes // max(1, int(np.prod(info.shape[:-1]))))
    try:
        values = dequantize(rows, kind)
    except NotImplementedError:
        raise CheckpointError(f"{where}: type {kind.name} cannot be dequantized (the gguf "
                              f"package has no code for it)") from None
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(info.shape))


def load_gguf(path: str | Path, dtype: torch.dtype | None = torch.float32,
              weights: bool = True):
    """(model, tokenizer) of a GGUF file: its weights dequantized to `dtype`. The config.json
    it implies is kept as `model.hf_config`, so exports write it. `weights=False`: the model
    on the meta device, checked against the file's tensor directory alone."""
    from .hf_config import hf_spec

    f = read_gguf(path)
    config = hf_config(f)
    try:  # checked as a config.json is
        spec = hf_spec(config)
    except CheckpointError as e:
        raise CheckpointError(f"{f.path}: {str(e).removeprefix('config.json: ')}") from None
    try:
        check_size(spec, str(f.path), (dtype or torch.float32).itemsize)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    tok = gguf_tokenizer(f)
    gemma = spec["family"] == "gemma"
    names, theirs = (_GEMMA3, _GEMMA3_THEIRS) if gemma else (_NAMES, _THEIRS)
    ours = {}
    for name, info in f.tensors.items():
        mine = _ours(name, names)
        if mine is None:
            raise CheckpointError(f"{f.path}: tensor {name[:80]} is not one of the "
                                  f"{'Gemma 3' if gemma else 'Llama family'}'s")
        ours[mine] = info
    with torch.device("meta"):
        model = build(spec)
    shapes = {k: torch.empty(v.shape, device="meta") for k, v in ours.items()}
    if model.tied_head():
        shapes.setdefault("lm_head.weight", shapes.get("embed_tokens.weight"))
    check_shapes({k: v.shape for k, v in model.state_dict().items()}, shapes, str(f.path))
    if tok.vocab_size > model.cfg.vocab_size:
        raise CheckpointError(f"{f.path}: the tokenizer has {tok.vocab_size} tokens, the "
                              f"model's embedding {model.cfg.vocab_size}")
    model.hf_config = config
    if not weights:
        return model, tok
    heads = {"q_proj": model.cfg.n_head, "k_proj": model.cfg.n_kv_head}
    state = {}
    with open(f.path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        for name, info in ours.items():
            t = _dequantize(buf, info, f"{f.path}: tensor {_theirs(name, theirs)}")
            kind = name.split(".")[-2]
            if config["model_type"] == "llama" and kind in heads:
                t = _permute(t, heads[kind], undo=True)
            if gemma and name.endswith("norm.weight"):  # llama.cpp stores (1 + w)
                t = t - 1.0
            state[name] = t.to(dtype) if dtype is not None else t
    model.assign(state)
    return model, tok


GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")


def write_gguf(model: CausalLM, tok, path: str | Path, qtype: str = "f16",
               state: dict | None = None) -> Path:
    """`model` (the Llama family) and its tokenizer as one GGUF file that llama.cpp runs: 2-D
    weights in `qtype` (a quantized type falls back to f16 for rows that are not whole
    blocks of 32), 1-D ones in f32. `state`: the weights to write instead of
    model.state_dict() (merged LoRA, a sharded model's full ones). Written to a temporary
    sibling and renamed (outputs.write_atomic)."""
    import gguf

    from .hf_config import export_config

    if qtype not in GGUF_TYPES:
        raise ValueError(f"GGUF type must be one of {', '.join(GGUF_TYPES)}, got {qtype!r}")
    if model.family not in ("llama", "gemma") or not hasattr(tok, "tk"):
        raise ValueError("GGUF export: the Llama family or Gemma 3 with a Hugging Face "
                         "tokenizer only")
    c, gemma = model.cfg, model.family == "gemma"
    arch = "gemma3" if gemma else export_config(model, torch.float32)["model_type"]
    if (arch not in ARCHS and not gemma) or \
            c.rope_scaling.get("rope_type", "default") not in ("default", "linear"):
        raise ValueError(f"GGUF export: {arch} with rope scaling {c.rope_scaling} is not "
                         f"supported")
    if gemma:
        _check_gemma3(c)
    path = Path(path)
    Q = gguf.GGMLQuantizationType
    want = Q[qtype.upper()]
    ftype = gguf.LlamaFileType.ALL_F32 if want == Q.F32 else \
        gguf.LlamaFileType[f"MOSTLY_{want.name}"]
    w = gguf.GGUFWriter(None, arch)  # its file: write_atomic's temporary one
    w.add_type("model")
    w.add_string(OURS, "1")  # is_our_gguf: a later export may replace this file
    _add_hparams(w, c, ftype)
    if gemma:
        w.add_sliding_window(c.sliding_window)
        _add_spm_tokenizer(w, tok, c.vocab_size)
    else:
        _add_tokenizer(w, tok, c.vocab_size)
    theirs = _GEMMA3_THEIRS if gemma else _THEIRS
    heads = {"q_proj": c.n_head, "k_proj": c.n_kv_head}
    weights = model.state_dict() if state is None else state
    for name, t in weights.items():
        if name == "lm_head.weight" and model.tied_head():
            continue
        t = t.detach().to("cpu", torch.float32)
        if arch == "llama" and name.split(".")[-2] in heads:
            t = _permute(t, heads[name.split(".")[-2]], undo=False)
        if gemma and name.endswith("norm.weight"):  # llama.cpp computes x * w: stores 1 + w
            t = t + 1.0
        a = t.contiguous().numpy()
        kind = Q.F32 if a.ndim == 1 else want
        if a.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0]:  # rows of whole blocks only
            kind = Q.F16
        if kind in (Q.F16, Q.F32):
            w.add_tensor(_theirs(name, theirs), a.astype(np.float16) if kind == Q.F16 else a)
        else:
            w.add_tensor(_theirs(name, theirs), gguf.quants.quantize(a, kind), raw_dtype=kind)

    def fill(tmp: Path) -> None:
        try:
            w.write_header_to_file(tmp)
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
        except BaseException:  # disk full: its buffer unflushed, closed now, not at exit
            with contextlib.suppress(OSError):
                w.close()
            raise
        w.close()

    return write_atomic(path, fill)


def _check_gemma3(c) -> None:
    """ValueError unless llama.cpp's Gemma 3 rules (what its files leave out: _gemma3_config)
    give this config back."""
    pattern = ["full_attention" if (i + 1) % GEMMA3_SWA_EVERY == 0 else "sliding_attention"
               for i in range(c.n_layer)]
    scalar = c.n_embd // c.n_head if c.n_layer == 62 else c.head_dim
    if list(c.layer_types) != pattern or c.rope_local_theta != GEMMA3_LOCAL_BASE or \
            c.query_pre_attn_scalar != scalar:
        raise ValueError(f"GGUF export: llama.cpp's Gemma 3 has each {GEMMA3_SWA_EVERY}th "
                         f"layer full, a local RoPE base of {GEMMA3_LOCAL_BASE:g} and "
                         f"query_pre_attn_scalar {scalar}: this model differs, and its file "
                         f"would not say so")


def _add_hparams(w, c, ftype) -> None:
    """The model's shape and RoPE as llama.cpp's keys (config `c`), and the file type."""
    import gguf

    w.add_context_length(c.block_size)
    w.add_embedding_length(c.n_embd)
    w.add_block_count(c.n_layer)
    w.add_feed_forward_length(c.n_inner)
    w.add_head_count(c.n_head)
    w.add_head_count_kv(c.n_kv_head)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_theta)
    if c.rope_scaling:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(c.rope_scaling["factor"])
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(ftype)


def _add_tokenizer(w, tok, vocab_size: int) -> None:
    """The tokenizer's vocabulary, merges, special ids and chat template as GGUF keys."""
    tokens, types, merges, pre, add_bos = gguf_vocab(tok, vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if tok.bos_id is not None:
        w.add_bos_token_id(tok.bos_id)
    w.add_eos_token_id(tok.eos_id)
    w.add_pad_token_id(tok.pad_id)
    if len(tok.eos_ids) > 1:
        w.add_eot_token_id(tok.eos_ids[1])
    w.add_add_bos_token(add_bos)
    if tok.chat_template is not None:
        w.add_chat_template(tok.chat_template)


def _add_spm_tokenizer(w, tok, vocab_size: int) -> None:
    """Gemma's tokenizer (a BPE with byte fallback over SentencePiece pieces) as llama.cpp's
    SentencePiece keys: the pieces by id, each scored by its place (the merge order
    gguf_vocab.spm_merges rebuilds), byte pieces typed as bytes, special ones as control."""
    tokens, types, add_bos = spm_vocab(tok, vocab_size)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(len(tokens))])
    w.add_token_types(types)
    for add, i in ((w.add_bos_token_id, tok.bos_id), (w.add_eos_token_id, tok.eos_id),
                   (w.add_pad_token_id, tok.pad_id),
                   (w.add_unk_token_id, tok._id(tok.specials.get("unk_token")))):
        if i is not None:
            add(i)
    w.add_add_bos_token(add_bos)
    if tok.chat_template is not None:
        w.add_chat_template(tok.chat_template)


def is_our_gguf(path: Path) -> bool:
    """Whether `path` is a GGUF file that write_gguf wrote (its metadata says so)."""
    try:
        return read_gguf(path).meta.get(OURS) is not None
    except CheckpointError:
        return False
