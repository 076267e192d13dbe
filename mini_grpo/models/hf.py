"""Hugging Face model directories in and out: config.json + safetensors <-> our own model code.

    model = load_hf_model("path/to/gpt2")      # a directory saved by save_pretrained
    save_hf_gpt2(model, "out/hf")              # transformers' GPT2LMHeadModel loads it

Supported architectures (`model_type` in config.json): gpt2. Anything else is a
CheckpointError naming it and the supported ones. Weights are read with `safetensors` (no
pickle), from `model.safetensors` or the shards a `model.safetensors.index.json` lists; the
model is built on the meta device and the checkpoint's tensors are assigned into it, so no
random model is materialised first, and the shapes the config implies are compared with the
file's before any tensor is read (a config.json is untrusted input: its sizes are bounded by
the weights it comes with). Missing, unexpected or mismatched weights are named (the first
few). Nothing is downloaded: fetch a model with the hub's own CLI first, then point here.

GPT-2 in our GPT (model.py): Conv1D weights are stored (in, out) and are transposed to
Linear's (out, in); `gelu_new` is the tanh GELU; `n_inner`, `layer_norm_epsilon` and
`n_positions` carry over; the LM head is tied to the token embedding.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .checkpoint import CheckpointError, check_shapes
from .model import GPT, GPTConfig
from .tokenizer import read_json_object

SUPPORTED = ("gpt2",)
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
    if kind not in SUPPORTED:
        arch = ", ".join(config.get("architectures") or []) or "?"
        raise CheckpointError(f"{file}: model_type {kind!r} ({arch}) is not supported "
                              f"(supported: {', '.join(SUPPORTED)})")
    return config


def _int(config: dict, key: str, default=None, lo: int = 1) -> int:
    v = config.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise CheckpointError(f"config.json: {key} must be an integer >= {lo}, got {v!r}")
    return v


def gpt2_config(config: dict) -> GPTConfig:
    act = config.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu", "gelu_pytorch_tanh"):
        raise CheckpointError(f"config.json: activation_function {act!r} is not supported "
                              f"(gelu_new, gelu)")
    eps = config.get("layer_norm_epsilon", 1e-5)
    if not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise CheckpointError(f"config.json: layer_norm_epsilon must be in (0, 1), got {eps!r}")
    n_embd, n_head = _int(config, "n_embd"), _int(config, "n_head")
    if n_embd % n_head:
        raise CheckpointError(f"config.json: n_embd {n_embd} is not divisible by n_head {n_head}")
    n_inner = config.get("n_inner")
    return GPTConfig(vocab_size=_int(config, "vocab_size"),
                     block_size=_int(config, "n_positions", config.get("n_ctx")),
                     n_layer=_int(config, "n_layer"), n_head=n_head, n_embd=n_embd,
                     activation="gelu" if act == "gelu" else "gelu_new",
                     layer_norm_epsilon=float(eps),
                     n_inner=None if n_inner is None else _int(config, "n_inner"))


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory: one, or the shards its index lists."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if not index.is_file():
        raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json "
                              f"(only safetensors weights are read, never pickles)")
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{index}: cannot read the weight map ({e})") from None
    files = [path / s for s in shards]
    for f in files:
        if f.parent != path or not f.is_file():
            raise CheckpointError(f"{index}: lists {f.name}, which is not in {path}")
    return files


def _gpt2_name(name: str) -> str | None:
    """Our parameter name for a GPT-2 one; None for buffers we do not keep."""
    name = name.removeprefix("transformer.")
    if name.endswith((".attn.bias", ".attn.masked_bias")):  # causal-mask buffers, not weights
        return None
    return name.replace("h.", "blocks.", 1) if name.startswith("h.") else name


def _conv1d(name: str) -> bool:
    return name.endswith(("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                          "mlp.c_proj.weight"))


def _check_sizes(cfg: GPTConfig, shapes: dict, path: Path) -> None:
    """The config's sizes against the weights' (layers, width, vocabulary, positions), before
    a model of the config's size is even built on the meta device."""
    layers = {k.split(".")[1] for k in shapes if k.startswith("blocks.")}
    wte, wpe = shapes.get("wte.weight"), shapes.get("wpe.weight")
    found = {"n_layer": len(layers), "n_embd": wte[1] if wte else None,
             "vocab_size": wte[0] if wte else None, "n_positions": wpe[0] if wpe else None}
    said = {"n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "vocab_size": cfg.vocab_size,
            "n_positions": cfg.block_size}
    for key, n in found.items():
        if n != said[key]:
            raise CheckpointError(f"{path}: config.json says {key} {said[key]}, its weights "
                                  f"hold {n}")


def load_hf_model(path: str | Path, dtype: torch.dtype | None = None,
                  device: str | torch.device = "cpu") -> GPT:
    """Our model with the directory's weights, in `dtype` (default: the checkpoint's)."""
    from safetensors import safe_open

    path = Path(path)
    cfg = gpt2_config(read_config(path))
    files = weight_files(path)
    shapes, where = {}, {}
    for f in files:  # headers first: names and shapes, no tensor read yet
        try:
            with safe_open(str(f), framework="pt") as sf:
                for key in sf.keys():
                    ours = _gpt2_name(key)
                    if ours is None:
                        continue
                    shape = sf.get_slice(key).get_shape()
                    shapes[ours] = torch.Size(shape[::-1] if _conv1d(ours) else shape)
                    where[ours] = (f, key)
        except Exception as e:  # a truncated or foreign file: the library's own error
            raise CheckpointError(f"{f}: cannot read safetensors ({e})") from None
    if "lm_head.weight" not in shapes and "wte.weight" in shapes:
        shapes["lm_head.weight"] = shapes["wte.weight"]  # tied: stored once
    _check_sizes(cfg, shapes, path)
    with torch.device("meta"):  # sizes now bounded by the file's own tensors
        model = GPT(cfg)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    check_shapes(expected, {k: torch.empty(s, device="meta") for k, s in shapes.items()},
                 str(path))
    state = {}
    for f in files:
        with safe_open(str(f), framework="pt", device=str(device)) as sf:
            for ours, (src, key) in where.items():
                if src == f:
                    t = sf.get_tensor(key)
                    t = t.t().contiguous() if _conv1d(ours) else t
                    state[ours] = t.to(dtype) if dtype is not None else t
    state["lm_head.weight"] = state["wte.weight"]
    model.load_state_dict(state, assign=True)
    model.lm_head.weight = model.wte.weight  # keep the tie after assign
    return model


def save_hf_gpt2(model: GPT, path: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Our GPT as a Hugging Face GPT-2 directory (config.json + model.safetensors) that
    transformers' GPT2LMHeadModel.from_pretrained loads: the inverse of load_hf_model.
    Written to a temporary directory and renamed, so a kill never leaves half of one."""
    import os
    import shutil

    from safetensors.torch import save_file

    c, path = model.cfg, Path(path)
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
              "vocab_size": c.vocab_size, "n_positions": c.block_size, "n_ctx": c.block_size,
              "n_embd": c.n_embd, "n_layer": c.n_layer, "n_head": c.n_head,
              "n_inner": c.n_inner, "activation_function": c.activation,
              "layer_norm_epsilon": c.layer_norm_epsilon, "tie_word_embeddings": True,
              "resid_pdrop": c.dropout, "embd_pdrop": c.dropout, "attn_pdrop": c.dropout}
    state = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":  # tied to wte: stored once
            continue
        t = t.detach().to("cpu", dtype or t.dtype)
        t = t.t() if _conv1d(name) else t
        hf = name.replace("blocks.", "h.", 1) if name.startswith("blocks.") else name
        state[f"transformer.{hf}"] = t.contiguous()
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path
