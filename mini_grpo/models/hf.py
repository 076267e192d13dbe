"""Hugging Face model directories in and out: config.json + safetensors <-> our model code.

    model = load_hf_model("path/to/Qwen2.5-0.5B-Instruct")   # a save_pretrained directory
    save_hf(model, "out/hf", tokenizer=tok)                   # transformers loads it back

Supported architectures (`model_type` in config.json): see HF_TYPES; anything else is a
CheckpointError naming it and the supported ones. Weights are read with `safetensors` (no
pickle), from `model.safetensors` or the shards a `model.safetensors.index.json` lists; the
model is built on the meta device and the checkpoint's tensors are assigned into it, so no
random model is materialised first, and the sizes the config implies are compared with the
file's before any tensor is read (a config.json is untrusted input: its sizes are bounded by
the weights it comes with), and with this machine's memory (`models.check_size`, the rule our
own GPT's config fields go through too). Missing, unexpected or mismatched weights are named
(the first few). Nothing is downloaded: fetch a model with the hub's own CLI first, then point
here.

GPT-2 in our GPT: Conv1D weights are stored (in, out) and are transposed to Linear's
(out, in); `gelu_new` is the tanh GELU; the LM head is tied to the token embedding unless
`tie_word_embeddings` is false.
The Llama family: our names are theirs without the "model." prefix.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path

import torch

from ..checkpoint import CheckpointError, check_shapes
from ..fields import ConfigError
from ..jsonio import read_json_object
from ..outputs import replace_dir
from . import CausalLM, GPTConfig, LlamaConfig, build, check_size
from .gemma import LAYER_TYPES, GemmaConfig
from .llama import rope_scaling

# model_type -> our family
HF_TYPES = {"gpt2": "gpt", "llama": "llama", "qwen2": "llama", "qwen3": "llama",
            "mistral": "llama", "gemma3_text": "gemma"}
MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few kB; refuse to parse anything huge
SHARD_BYTES = 5 * 10**9  # save_hf: shards above this size, as save_pretrained does
# every name save_hf writes: a marked directory (outputs.MARKER) holding anything else is not
# replaced
WRITTEN = re.compile(r"\.mini-grpo-export|(generation_)?config\.json|model\.safetensors"
                     r"(\.index\.json)?|model-\d{5}-of-\d{5}\.safetensors|tokenizer\.json"
                     r"|tokenizer_config\.json")


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


# names: theirs <-> ours

def _conv1d(family: str, name: str) -> bool:
    return family == "gpt" and name.endswith(("attn.c_attn.weight", "attn.c_proj.weight",
                                              "mlp.c_fc.weight", "mlp.c_proj.weight"))


def _ours(family: str, name: str) -> str | None:
    """Our parameter name for one of theirs; None for buffers we do not keep."""
    if family == "gpt":
        name = name.removeprefix("transformer.")
        if name.endswith((".attn.bias", ".attn.masked_bias")):  # causal-mask buffers
            return None
        return name.replace("h.", "blocks.", 1) if name.startswith("h.") else name
    if name.endswith("rotary_emb.inv_freq"):  # computed, not learned
        return None
    return name.removeprefix("model.")


def _theirs(family: str, name: str) -> str:
    if name == "lm_head.weight":
        return name
    if family == "gpt":
        return "transformer." + (name.replace("blocks.", "h.", 1)
                                 if name.startswith("blocks.") else name)
    return "model." + name


def _check_sizes(spec: dict, shapes: dict, path: Path) -> None:
    """The config's layer count and embedding size against the weights', before a model of
    the config's size is even built on the meta device (named as config.json names them)."""
    cfg, gpt = spec["config"], spec["family"] == "gpt"
    layers = {k.split(".")[1] for k in shapes if k.startswith(("blocks.", "layers."))}
    emb = shapes.get("wte.weight" if gpt else "embed_tokens.weight") or (None, None)
    checks = [("n_layer" if gpt else "num_hidden_layers", cfg["n_layer"], len(layers)),
              ("vocab_size", cfg["vocab_size"], emb[0]),
              ("n_embd" if gpt else "hidden_size", cfg["n_embd"], emb[1])]
    if gpt:
        checks.append(("n_positions", cfg["block_size"], (shapes.get("wpe.weight") or [None])[0]))
    for key, said, found in checks:
        if said != found:
            raise CheckpointError(f"{path}: config.json says {key} {said}, its weights hold "
                                  f"{found}")


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory: one, or the shards its index lists."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if not index.is_file():
        raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json "
                              f"(only safetensors weights are read, never pickles)")
    try:
        weight_map = read_json_object(index, MAX_CONFIG_BYTES * 16).get("weight_map")
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    if not isinstance(weight_map, dict) or \
            not all(isinstance(v, str) and v for v in weight_map.values()):
        raise CheckpointError(f"{index}: weight_map must map each tensor name to a file name")
    files = [path / s for s in sorted(set(weight_map.values()))]
    present = {p.name for p in path.iterdir() if p.is_file()}  # no stat of a name it gives
    for f in files:
        if f.parent != path or f.name not in present:
            raise CheckpointError(f"{index}: lists {f.name[:100]}, which is not in {path}")
    return files


def load_hf_model(path: str | Path, dtype: torch.dtype | None = None,
                  device: str | torch.device = "cpu", weights: bool = True) -> CausalLM:
    """Our model with the directory's weights, in `dtype` (default: the checkpoint's). The
    directory's config.json is kept as `model.hf_config` (save_hf writes it back).
    `weights=False`: the model on the meta device, checked against the files' headers but
    with no tensor read (a rank that gets its weights from another)."""
    from safetensors import safe_open

    path = Path(path)
    config = read_config(path)
    spec = hf_spec(config)
    family = spec["family"]
    files = weight_files(path)
    shapes, where = {}, {}
    for f in files:  # headers first: names and shapes, no tensor read yet
        try:
            with safe_open(str(f), framework="pt") as sf:
                header = {key: sf.get_slice(key).get_shape() for key in sf.keys()}
        except Exception as e:  # a truncated or foreign file: the library's own error
            raise CheckpointError(f"{f}: cannot read safetensors ({e})") from None
        for key, shape in header.items():
            ours = _ours(family, key)
            if ours is None:
                continue
            if ours in where:  # which copy is read would be the files' order's accident
                first, name = where[ours]
                raise CheckpointError(f"{path}: weight {ours} is stored twice ({name} in "
                                      f"{first.name}, {key} in {f.name})")
            shapes[ours] = torch.Size(shape[::-1] if _conv1d(family, ours) else shape)
            where[ours] = (f, key)
    _check_sizes(spec, shapes, path)
    try:  # the files' sizes, in the dtype asked for (else at least 2 bytes), against memory
        check_size(spec, str(path / "config.json"), (dtype or torch.bfloat16).itemsize)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    with torch.device("meta"):  # sizes now bounded by the file's own tensors
        model = build(spec)
    tied = model.tied_head()
    if tied and "lm_head.weight" not in shapes:
        shapes["lm_head.weight"] = shapes.get(tied)  # stored once
    check_shapes({k: v.shape for k, v in model.state_dict().items()},
                 {k: torch.empty(s, device="meta") for k, s in shapes.items() if s is not None},
                 str(path))
    model.hf_config = config
    if not weights:
        return model
    state = {}
    for f in files:
        with safe_open(str(f), framework="pt", device=str(device)) as sf:
            for ours, (src, key) in where.items():
                if src == f:
                    t = sf.get_tensor(key)
                    t = t.t().contiguous() if _conv1d(family, ours) else t
                    state[ours] = t.to(dtype) if dtype is not None else t
    model.assign(state)
    return model


def export_dtype(model: CausalLM, name: str = "auto") -> torch.dtype:
    """The dtype to export in: `name`, or for auto the one the model's config.json names
    (a pretrained checkpoint's own) where it is one we write, else float32 (a config.json's
    "float64" or "auto" had ended a finished run in a traceback at its export)."""
    ours = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name == "auto":
        config = getattr(model, "hf_config", None) or {}
        named = config.get("dtype") or config.get("torch_dtype")
        return ours.get(named, torch.float32) if isinstance(named, str) else torch.float32
    if name not in ours:
        raise ConfigError(f"export_dtype: must be auto, float32, bfloat16 or float16, got "
                          f"{name!r}")
    return ours[name]


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


def hf_tensors(model: CausalLM, weights, dtype: torch.dtype, head: bool = False):
    """(Hugging Face name, tensor) for each of our (name, tensor) in `weights`, one at a time:
    in `dtype`, GPT-2's Conv1D weights transposed, a tied LM head left out (the embedding
    holds it) unless `head`. What save_hf writes and what a rollout engine is sent
    (engines/vllm.py)."""
    family, tied = model.family, model.tied_head() and not head
    for name, t in weights:
        if name == "lm_head.weight" and tied:  # stored once, as the embedding
            continue
        t = t.detach().to(dtype)
        yield _theirs(family, name), (t.t() if _conv1d(family, name) else t).contiguous()


def save_hf(model: CausalLM, path: str | Path, dtype: torch.dtype | None = None,
            tokenizer=None, shard_bytes: int = SHARD_BYTES, state: dict | None = None) -> Path:
    """`model` as a Hugging Face directory that transformers' AutoModelForCausalLM loads:
    config.json, model.safetensors (or shards with an index above `shard_bytes`),
    generation_config.json and, given a tokenizer, its files. `state`: the weights to write
    instead of model.state_dict() (a sharded model's full ones). Only into a new or empty
    directory or one save_hf wrote (ConfigError otherwise); written to a temporary directory
    and renamed, so a kill never leaves half of one (outputs.replace_dir)."""
    from safetensors.torch import save_file

    path = Path(path)
    weights = model.state_dict() if state is None else state
    if dtype is None:
        dtype = weights["lm_head.weight"].dtype
    state = {name: t.to("cpu") for name, t in hf_tensors(model, weights.items(), dtype)}
    config = export_config(model, dtype)
    shards, size = [[]], 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    def fill(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if len(shards) == 1:
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, names in enumerate(shards):
                file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file({k: state[k] for k in names}, str(tmp / file),
                          metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(names, file))
            total = sum(t.numel() * t.element_size() for t in state.values())
            (tmp / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        gen = {}
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
            gen = {"bos_token_id": tokenizer.bos_id, "pad_token_id": tokenizer.pad_id,
                   "eos_token_id": (tokenizer.eos_ids if len(tokenizer.eos_ids) > 1
                                    else tokenizer.eos_id)}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))

    return replace_dir(path, WRITTEN, fill)
