"""Model families, our own code: `gpt` (ours, and Hugging Face GPT-2), `llama` (Llama 3.x,
Qwen2/2.5, Qwen3, SmolLM2, Mistral) and `gemma` (Gemma 3, text). Each is a CausalLM (core.py)
with the same forward passes, KV cache and shared-prompt pass; the trainer never asks which
family it holds.

A model travels in our checkpoints as its spec, {"family": ..., "config": {...}} (`spec`),
and is rebuilt from it (`build`); hf.py reads and writes Hugging Face directories. A spec's
size is checked against the machine's memory before anything is built (`check_size`).
"""

from __future__ import annotations

import math
import os
import types
import typing
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, fields

import torch
from torch import nn

from ..fields import show
from .core import CausalLM, KVCache, attention_mask, positions
from .gemma import Gemma, GemmaConfig
from .gpt import ACTIVATIONS, GPT, GPTConfig
from .llama import Llama, LlamaConfig, rope_scaling

FAMILIES: dict[str, tuple[type[CausalLM], type]] = {
    "gpt": (GPT, GPTConfig),
    "llama": (Llama, LlamaConfig),
    "gemma": (Gemma, GemmaConfig),
}

__all__ = ["FAMILIES", "GPT", "GPTConfig", "CausalLM", "Gemma", "GemmaConfig", "KVCache",
           "Llama", "LlamaConfig",
           "attention_mask", "build", "check_batch_memory", "check_size", "positions", "spec"]


def spec(model: CausalLM) -> dict:
    """What rebuilds `model`'s architecture: its family and config (plain JSON values), and
    the config.json it was loaded from, if any (a later export writes it back)."""
    out = {"family": model.family, "config": asdict(model.cfg)}
    if getattr(model, "hf_config", None):
        out["hf_config"] = model.hf_config
    return out


def model_config(spec: dict):
    """The family's config dataclass from a spec (untrusted: a checkpoint carries it);
    ValueError naming what is wrong."""
    family = spec.get("family") if isinstance(spec, dict) else None
    if family not in FAMILIES:
        raise ValueError(f"model family {family!r} is not one of {', '.join(FAMILIES)}")
    cls = FAMILIES[family][1]
    config = spec.get("config")
    names = {f.name for f in fields(cls)}
    if not isinstance(config, dict) or set(config) - names:
        raise ValueError(f"model config of family {family} has unknown keys "
                         f"{sorted(set(config or {}) - names)}")
    hints = typing.get_type_hints(cls)
    for key, value in config.items():
        if not _fits(value, hints[key]):
            raise ValueError(f"model config {key}: {value!r:.60} is not "
                             f"{_WANTED.get(hints[key], hints[key])}")
    cfg = cls(**config)
    # the rules config.json's are checked by (hf.py): heads split the width, RoPE pairs dims
    parts, whole = ("n_head", "n_embd") if family == "gpt" else ("n_kv_head", "n_head")
    if getattr(cfg, parts) < 1 or getattr(cfg, whole) % getattr(cfg, parts):
        raise ValueError(f"model config {parts}: {getattr(cfg, parts)} does not divide "
                         f"{whole} {getattr(cfg, whole)}")
    if family != "gpt" and cfg.head_dim % 2:
        raise ValueError(f"model config head_dim: {cfg.head_dim} must be even (RoPE)")
    if family == "gemma":
        try:
            cfg.check()
        except ValueError as e:
            raise ValueError(f"model config {e}") from None
    if family != "gpt":  # as config.json's is read, and already in the form it gives
        try:
            scaling = rope_scaling(cfg.rope_scaling)
        except ValueError as e:
            raise ValueError(f"model config rope_scaling: {e}") from None
        if scaling != cfg.rope_scaling:
            raise ValueError(f"model config rope_scaling: {show(cfg.rope_scaling)} should "
                             f"read {show(scaling)}")
    if family == "gpt" and cfg.activation not in ACTIVATIONS:
        raise ValueError(f"model config activation: {show(cfg.activation)} is not one of "
                         f"{', '.join(ACTIVATIONS)}")
    if not 0 <= getattr(cfg, "dropout", 0.0) < 1:  # a probability (torch refuses others)
        raise ValueError(f"model config dropout: {cfg.dropout} is not in [0, 1)")
    return cfg


_WANTED = {int: "an integer >= 0", float: "a finite number >= 0", bool: "true/false",
           str: "a string", dict: "a mapping"}


def _fits(value, tp) -> bool:
    """A spec's value of its field's type: sizes are integers >= 0, numbers finite >= 0."""
    if typing.get_origin(tp) is types.UnionType:  # int | None
        return value is None or any(_fits(value, t) for t in typing.get_args(tp)
                                    if t is not type(None))
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and \
            math.isfinite(value) and value >= 0
    return isinstance(value, tp)


_INITS = ("normal_", "uniform_", "zeros_", "ones_", "constant_", "kaiming_uniform_",
          "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "trunc_normal_")


@contextmanager
def _no_init():
    """torch.nn.init's functions as no-ops: for a model built on the meta device, whose
    weights come next, where the init's meta kernels only cost (the first one imports torch's
    compiler: 1.4 s of a `mini-grpo sample`'s start)."""
    saved = {name: getattr(nn.init, name) for name in _INITS}
    for name in _INITS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def build(spec: dict) -> CausalLM:
    """The model a spec describes, with random weights (on the current default device: use
    `with torch.device("meta")` to build without allocating, and without initialising)."""
    meta = torch.get_default_device().type == "meta"
    with _no_init() if meta else nullcontext():
        model = FAMILIES[spec["family"]][0](model_config(spec))
    if isinstance(spec.get("hf_config"), dict):
        model.hf_config = spec["hf_config"]
    return model


def memory_bytes() -> int | None:
    """This machine's memory as this process may use it: the physical memory, or a smaller
    cgroup (v2) limit; None where the platform does not say."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()  # a number of bytes, or "max"
        total = min(total, int(limit)) if limit.isdigit() else total
    except OSError:
        pass
    return total


def _gib(n: float) -> str:
    if n >= 2**60:  # an int too large for a float: sizes from a file are unbounded
        return f"over {2**20:,} TiB"
    return f"{n / 2**40:.1f} TiB" if n >= 2**40 else f"{n / 2**30:.1f} GiB"


def check_batch_memory(model_cfg, rows: int, tokens: int, what: str) -> None:
    """ValueError naming `what` when the key/value cache of `rows` sequences of `tokens`
    positions (sampling them together, at 4 bytes a value) would exceed this machine's memory:
    a batch size of absurd size fails at once, not minutes later in a MemoryError."""
    kv_dim = getattr(model_cfg, "n_kv_head", model_cfg.n_head) * getattr(
        model_cfg, "head_dim", model_cfg.n_embd // model_cfg.n_head)
    need, have = rows * tokens * model_cfg.n_layer * 2 * kv_dim * 4, memory_bytes()
    if have is not None and need > have:
        raise ValueError(f"{what}: sampling {rows:,} rows of {tokens} positions together "
                         f"would hold {_gib(need)} of key/value cache, more than this "
                         f"machine's memory ({_gib(have)})")


def check_size(spec: dict, what: str, bytes_per_param: int = 4) -> None:
    """ValueError naming `what` (the fields or file that set the sizes) when the parameters
    alone, at `bytes_per_param`, would exceed this machine's memory: counted from the config,
    so a model of absurd size fails at once, before anything is built or allocated. Our GPT
    from the config's fields and a Hugging Face directory's config.json both pass here."""
    need, have = model_config(spec).param_count() * bytes_per_param, memory_bytes()
    if have is not None and need > have:
        raise ValueError(f"{what}: the model would hold {_gib(need)} of parameters "
                         f"(+ gradients and AdamW state to train), more than this machine's "
                         f"memory ({_gib(have)})")
