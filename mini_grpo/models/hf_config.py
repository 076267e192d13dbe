"""A Hugging Face model directory's config.json <-> our model configs, both ways.

    spec = hf_spec(read_config("path/to/model"))   # {"family": ..., "config": {...}}
    config = export_config(model, torch.bfloat16)  # what save_hf writes as config.json

A config.json is untrusted input: read with a size bound, its `model_type` checked against
HF_TYPES, and every field our model reads checked by type and range (`_int`, `_float`,
`_bool`), named as config.json names it. The weights that go with it: models/hf.py.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from ..checkpoint import CheckpointError
from ..jsonio import read_json_object
from . import CausalLM, GPTConfig, LlamaConfig
from .gemma import LAYER_TYPES, GemmaConfig
from .llama import rope_scaling

# model_type -> our family
HF_TYPES = {"gpt2": "gpt", "llama": "llama", "qwen2": "llama", "qwen3": "llama",
            "mistral": "llama", "gemma3_text": "gemma"}
MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few kB; refuse to parse anything huge


def read_config(path: str | Path) -> dict:
    """config.json of a model directory, with its architecture checked."""
    path = Path(path)
    file = path / "config.json"
    try:
        config = read_json_object(file, MAX_CONFIG_BYTES)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    if config is None:
        raise CheckpointError(f"{path}: not a Hugging Face model directory (no config.json)")
    kind = config.get("model_type")
    if not isinstance(kind, str) or kind not in HF_TYPES:
        arch = config.get("architectures")
        arch = ", ".join(a for a in arch if isinstance(a, str)) \
            if isinstance(arch, list) else ""
        arch = arch or "?"
        raise CheckpointError(f"{file}: model_type {kind!r} ({arch}) is not supported "
                              f"(supported: {', '.join(HF_TYPES)})")
    return config


def _int(config: dict, key: str, default=None, lo: int = 1) -> int:
    v = config.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise CheckpointError(f"config.json: {key} must be an integer >= {lo}, got {v!r}")
    return v


def _bool(config: dict, key: str, default: bool) -> bool:
    """true or false (null: the default); never Python's truth of a value ("false" is
    true there)."""
    v = config.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise CheckpointError(f"config.json: {key} must be true or false, got {repr(v)[:60]}")
    return v


MAX_FLOAT = 1e15  # above any rope_theta or factor a model has (Llama 3: 5e5); ints of any
# size go through float() otherwise: 10**400 is an OverflowError there


def _float(config: dict, key: str, default, lo: float = 0.0, hi: float = MAX_FLOAT):
    v = config.get(key, default)
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and (
        isinstance(v, float) or -10**18 < v < 10**18) and lo < v < hi
    if not ok:
        shown = "an integer of more than 40 digits" if isinstance(v, int) and \
            abs(v) >= 10**40 else repr(v)[:60]
        raise CheckpointError(f"config.json: {key} must be a number in ({lo}, {hi:g}), got "
                              f"{shown}")
    return float(v)


def gpt2_config(config: dict) -> GPTConfig:
    act = config.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu", "gelu_pytorch_tanh"):
        raise CheckpointError(f"config.json: activation_function {act!r} is not supported "
                              f"(gelu_new, gelu)")
    n_embd, n_head = _int(config, "n_embd"), _int(config, "n_head")
    if n_embd % n_head:
        raise CheckpointError(f"config.json: n_embd {n_embd} is not divisible by n_head {n_head}")
    n_inner = config.get("n_inner")
    return GPTConfig(vocab_size=_int(config, "vocab_size"),
                     block_size=_int(config, "n_positions", config.get("n_ctx")),
                     n_layer=_int(config, "n_layer"), n_head=n_head, n_embd=n_embd,
                     activation="gelu" if act == "gelu" else "gelu_new",
                     layer_norm_epsilon=_float(config, "layer_norm_epsilon", 1e-5, hi=1),
                     n_inner=None if n_inner is None else _int(config, "n_inner"),
                     tie_word_embeddings=_bool(config, "tie_word_embeddings", True))


def _rope(config: dict) -> tuple[float, dict]:
    """(rope_theta, scaling) from either spelling: rope_theta + rope_scaling (the hub's
    checkpoints) or rope_parameters (transformers 5)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"config.json: rope_parameters must be an object, got {params!r}")
    theta = _float(config, "rope_theta", params.get("rope_theta", 10000.0))
    try:
        return theta, rope_scaling(params)
    except ValueError as e:
        raise CheckpointError(f"config.json: {e}") from None


def llama_config(config: dict) -> LlamaConfig:
    kind = config["model_type"]
    if config.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json: hidden_act {config['hidden_act']!r} is not "
                              f"supported (silu)")
    window = config.get("sliding_window") if kind == "mistral" else None
    if config.get("use_sliding_window") or window:
        raise CheckpointError("config.json: sliding-window attention is not supported")
    n_embd, n_head = _int(config, "hidden_size"), _int(config, "num_attention_heads")
    n_kv = _int(config, "num_key_value_heads", n_head)
    if n_head % n_kv:
        raise CheckpointError(f"config.json: num_attention_heads {n_head} is not a multiple "
                              f"of num_key_value_heads {n_kv}")
    head_dim = config.get("head_dim") or n_embd // n_head
    head_dim = _int({"head_dim": head_dim}, "head_dim")
    if head_dim % 2:
        raise CheckpointError(f"config.json: head_dim {head_dim} must be even (RoPE)")
    theta, scaling = _rope(config)
    bias = _bool(config, "attention_bias", False)
    return LlamaConfig(
        vocab_size=_int(config, "vocab_size"), block_size=_int(config, "max_position_embeddings"),
        n_layer=_int(config, "num_hidden_layers"), n_head=n_head, n_kv_head=n_kv,
        n_embd=n_embd, head_dim=head_dim, n_inner=_int(config, "intermediate_size"),
        rms_norm_eps=_float(config, "rms_norm_eps", 1e-6, hi=1), rope_theta=theta,
        rope_scaling=scaling, qkv_bias=kind == "qwen2" or bias,
        o_bias=bias and kind != "qwen2", mlp_bias=_bool(config, "mlp_bias", False),
        qk_norm=kind == "qwen3",
        tie_word_embeddings=_bool(config, "tie_word_embeddings", False))


def gemma_config(config: dict) -> GemmaConfig:
    """Gemma 3's text config.json (model_type gemma3_text), in transformers 5's spelling
    (rope_parameters per layer type) or the hub's (rope_theta, rope_local_base_freq,
    rope_scaling; sliding_window_pattern where layer_types is absent)."""
    act = config.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise CheckpointError(f"config.json: hidden_activation {act!r} is not supported "
                              f"(gelu_pytorch_tanh)")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if config.get(key) is not None:  # Gemma 2's; Gemma 3 has QK-norm instead
            raise CheckpointError(f"config.json: {key} is not supported (Gemma 3 has none)")
    for key in ("attention_bias", "use_bidirectional_attention"):
        if _bool(config, key, False):
            raise CheckpointError(f"config.json: {key} true is not supported")
    n_layer, n_head = _int(config, "num_hidden_layers"), _int(config, "num_attention_heads")
    n_kv = _int(config, "num_key_value_heads", n_head)
    if n_head % n_kv:
        raise CheckpointError(f"config.json: num_attention_heads {n_head} is not a multiple "
                              f"of num_key_value_heads {n_kv}")
    types = config.get("layer_types")
    if types is None:
        every = _int(config, "sliding_window_pattern", 6)
        types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                 for i in range(n_layer)]
    if not isinstance(types, list) or len(types) != n_layer or \
            not all(t in LAYER_TYPES for t in types):
        raise CheckpointError(f"config.json: layer_types must name each of the {n_layer} "
                              f"layers {' or '.join(LAYER_TYPES)}")
    params = config.get("rope_parameters")
    if isinstance(params, dict) and set(params) & set(LAYER_TYPES):
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        if not isinstance(full, dict) or not isinstance(local, dict):
            raise CheckpointError("config.json: rope_parameters' entries must be objects")
        theta, scaling = _rope({"rope_parameters": full})
        local_theta, local_scaling = _rope({"rope_parameters": local})
    else:
        theta, scaling = _rope(config)
        local_theta = _float(config, "rope_local_base_freq", 10000.0)
        local_scaling = {}
    if local_scaling:
        raise CheckpointError("config.json: a scaled RoPE on the sliding layers is not "
                              "supported")
    head_dim = _int(config, "head_dim", _int(config, "hidden_size") // n_head)
    if head_dim % 2:
        raise CheckpointError(f"config.json: head_dim {head_dim} must be even (RoPE)")
    return GemmaConfig(
        vocab_size=_int(config, "vocab_size"), block_size=_int(config, "max_position_embeddings"),
        n_layer=n_layer, n_head=n_head, n_kv_head=n_kv, n_embd=_int(config, "hidden_size"),
        head_dim=head_dim, n_inner=_int(config, "intermediate_size"), layer_types=list(types),
        sliding_window=_int(config, "sliding_window", 4096),
        query_pre_attn_scalar=_float(config, "query_pre_attn_scalar", float(head_dim)),
        rms_norm_eps=_float(config, "rms_norm_eps", 1e-6, hi=1), rope_theta=theta,
        rope_scaling=scaling, rope_local_theta=local_theta,
        tie_word_embeddings=_bool(config, "tie_word_embeddings", True))


def hf_spec(config: dict) -> dict:
    """Our model spec (models.spec) for a checked config.json."""
    family = HF_TYPES[config["model_type"]]
    cfg = {"gpt": gpt2_config, "llama": llama_config, "gemma": gemma_config}[family](config)
    return {"family": family, "config": asdict(cfg)}


# out: config.json for a model of ours

def export_config(model: CausalLM, dtype: torch.dtype) -> dict:
    """config.json for `model`: the one it was loaded with, else one built from its own."""
    name = str(dtype).removeprefix("torch.")
    config = dict(getattr(model, "hf_config", None) or _new_config(model))
    config.pop("transformers_version", None)
    config.pop("torch_dtype", None)
    config["dtype"] = name
    return config


def _new_config(model: CausalLM) -> dict:
    c = model.cfg
    if model.family == "gpt":
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                "vocab_size": c.vocab_size, "n_positions": c.block_size,
                "n_ctx": c.block_size, "n_embd": c.n_embd, "n_layer": c.n_layer,
                "n_head": c.n_head, "n_inner": c.n_inner, "activation_function": c.activation,
                "layer_norm_epsilon": c.layer_norm_epsilon,
                "tie_word_embeddings": c.tie_word_embeddings,
                "resid_pdrop": c.dropout, "embd_pdrop": c.dropout, "attn_pdrop": c.dropout}
    if model.family == "gemma":
        return _gemma_config(c)
    kind = "qwen3" if c.qk_norm else "qwen2" if c.qkv_bias and not c.o_bias else "llama"
    # what each model_type can say: llama/qwen3 one attention_bias for q, k, v and o, qwen2
    # q/k/v bias without o, neither qwen an MLP bias
    if (kind != "qwen2" and c.qkv_bias != c.o_bias) or (kind != "llama" and c.mlp_bias):
        raise ValueError(f"this combination of biases and q/k norm has no Hugging Face "
                         f"model_type ({kind} cannot say it)")
    rope = {"rope_theta": c.rope_theta, "rope_type": "default", **c.rope_scaling}
    return {"model_type": kind, "architectures": [f"{kind.capitalize()}ForCausalLM"],
            "vocab_size": c.vocab_size, "max_position_embeddings": c.block_size,
            "hidden_size": c.n_embd, "intermediate_size": c.n_inner,
            "num_hidden_layers": c.n_layer, "num_attention_heads": c.n_head,
            "num_key_value_heads": c.n_kv_head, "head_dim": c.head_dim, "hidden_act": "silu",
            "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
            "rope_scaling": c.rope_scaling or None, "rope_parameters": rope,
            "attention_bias": c.qkv_bias and kind != "qwen2", "mlp_bias": c.mlp_bias,
            "tie_word_embeddings": c.tie_word_embeddings, "attention_dropout": c.dropout}


def _gemma_config(c: GemmaConfig) -> dict:
    full = {"rope_type": "default", "rope_theta": c.rope_theta, **c.rope_scaling}
    return {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
            "vocab_size": c.vocab_size, "max_position_embeddings": c.block_size,
            "hidden_size": c.n_embd, "intermediate_size": c.n_inner,
            "num_hidden_layers": c.n_layer, "num_attention_heads": c.n_head,
            "num_key_value_heads": c.n_kv_head, "head_dim": c.head_dim,
            "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": c.rms_norm_eps,
            "layer_types": list(c.layer_types), "sliding_window": c.sliding_window,
            "query_pre_attn_scalar": int(q) if (q := c.query_pre_attn_scalar).is_integer()
            else q,  # transformers' Gemma3TextConfig takes an int
            "rope_parameters": {"full_attention": full, "sliding_attention": {
                "rope_type": "default", "rope_theta": c.rope_local_theta}},
            "final_logit_softcapping": None, "attn_logit_softcapping": None,
            "tie_word_embeddings": c.tie_word_embeddings, "attention_dropout": c.dropout}
