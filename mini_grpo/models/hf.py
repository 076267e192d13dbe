"""Hugging Face model directories in and out: config.json + safetensors <-> our model code.

    model = load_hf_model("path/to/Qwen2.5-0.5B-Instruct")   # a save_pretrained directory
    save_hf(model, "out/hf", tokenizer=tok)                   # transformers loads it back

Supported architectures (`model_type` in config.json): see hf_config.HF_TYPES (config.json's
reading and writing live there); anything else is a CheckpointError naming it and the supported
ones. Weights are read with `safetensors` (no pickle), from `model.safetensors` or the shards a
`model.safetensors.index.json` lists; the model is built on the meta device and the checkpoint's
tensors are assigned into it, so no random model is materialised first, and the sizes the config
implies are compared with the file's before any tensor is read (a config.json is untrusted
input: its sizes are bounded by the weights it comes with), and with this machine's memory
(`models.check_size`, the rule our own GPT's config fields go through too). Missing, unexpected
or mismatched weights are named (the first few). Nothing is downloaded: fetch a model with the
hub's own CLI first, then point here.

GPT-2 in our GPT: Conv1D weights are stored (in, out) and are transposed to Linear's
(out, in); `gelu_new` is the tanh GELU; the LM head is tied to the token embedding unless
`tie_word_embeddings` is false.
The Llama family: our names are theirs without the "model." prefix.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..checkpoint import CheckpointError, check_shapes
from ..fields import ConfigError
from ..jsonio import read_json_object
from ..outputs import replace_dir
from . import CausalLM, build, check_size
from .hf_config import MAX_CONFIG_BYTES, export_config, hf_spec, read_config

SHARD_BYTES = 5 * 10**9  # save_hf: shards above this size, as save_pretrained does
# every name save_hf writes: a marked directory (outputs.MARKER) holding anything else is not
# replaced
WRITTEN = re.compile(r"\.mini-grpo-export|(generation_)?config\.json|model\.safetensors"
                     r"(\.index\.json)?|model-\d{5}-of-\d{5}\.safetensors|tokenizer\.json"
                     r"|tokenizer_config\.json")


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
