"""LoRA adapters (issue 24), written the way torchtune writes them: a Linear that keeps its
frozen base weight under its own name and adds a low-rank update, scaled by alpha / r.

    names = apply_lora(model, r=16, alpha=32)          # in place; every other weight frozen
    with adapters_disabled(model): ...                 # the base model: the reference, free
    merged_state_dict(model)                           # what a plain model of the family loads
    save_adapter(model, "out/adapter"); load_adapter(base, "out/adapter")   # PEFT's format
    merged(model, model.state_dict().items())         # a stream of plain weights (vLLM sync)
    is_lora(model), adapter_keys(state)                # checkpoints keep the adapters alone

`LoRALinear` subclasses nn.Linear, so the base `weight`/`bias` keep their state-dict names
(checkpoints, exports and the vLLM sync read them as before) and `lora_A`/`lora_B` are
submodules, whose names are PEFT's. At init A is kaiming-uniform and B zero (as PEFT), so the
model equals its base exactly until the first update.

The adapter files are PEFT's: adapter_config.json and adapter_model.safetensors, keys
`base_model.model.` + the Hugging Face name of the module + `.lora_A.weight` (shape (r, in))
/ `.lora_B.weight` ((out, r)). GPT-2's Conv1D layers keep that layout too; PEFT marks them
`fan_in_fan_out`. An adapter_config.json is read by allowlist: every key PEFT's LoraConfig
writes, at the values under which it is plain LoRA on an unchanged base; any other key or
value (DoRA, rsLoRA, PiSSA's init, an option of a newer PEFT) is refused, naming it.
"""

from __future__ import annotations

import json
import math
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .jsonio import read_json_object
from .models.hf import _theirs
from .outputs import replace_dir

_LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DEFAULT_TARGETS = {"llama": _LLAMA_TARGETS, "gemma": _LLAMA_TARGETS,
                   "gpt": ["c_attn", "c_proj", "c_fc"]}
# every name save_adapter writes: a marked directory holding anything else is not replaced
ADAPTER_FILES = re.compile(r"\.mini-grpo-export|adapter_config\.json|adapter_model\.safetensors")
MAX_CONFIG_BYTES = 1 << 16
# adapter_config.json is read by allowlist, so that an option PEFT adds later is refused, not
# ignored. Options that change what the adapter computes or need a base PEFT changed (PiSSA,
# OLoRA, CorDA, LoftQ ...): the values under which it is plain LoRA, PEFT's defaults among them
PLAIN_LORA = {"init_lora_weights": (True, False, "gaussian"), "bias": ("none",),
              "use_rslora": (False,), "use_dora": (False,), "use_qalora": (False,),
              "lora_bias": (False,), "ensure_weight_tying": (False,),
              "alpha_pattern": ({}, None), "rank_pattern": ({}, None),
              "layers_to_transform": (None,), "layers_pattern": (None, "", []),
              "modules_to_save": (None, []), "target_parameters": (None, []),
              "exclude_modules": (None, "", []), "layer_replication": (None,),
              "trainable_token_indices": (None,), "alora_invocation_tokens": (None,),
              "loftq_config": ({}, None), "megatron_config": (None,), "eva_config": (None,),
              "corda_config": (None,), "astra_config": (None,), "lora_ga_config": (None,),
              "velora_config": (None,),
              "monteclora_config": (None,), "use_bdlora": (None,), "arrow_config": (None,),
              "kasa_config": (None,)}
# the other keys, with their types: read_adapter_config and load_adapter check the values of
# the first six; the rest describe the adapter or matter only under an option refused above
ADAPTER_TYPES = {"r": (int,), "lora_alpha": (int, float), "lora_dropout": (int, float),
                 "target_modules": (list,), "fan_in_fan_out": (bool,), "peft_type": (str,),
                 "task_type": (str, type(None)), "base_model_name_or_path": (str, type(None)),
                 "revision": (str, type(None)), "inference_mode": (bool,),
                 "auto_mapping": (dict, type(None)), "peft_version": (str, type(None)),
                 "megatron_core": (str, type(None)), "qalora_group_size": (int,)}


class LoRALinear(nn.Linear):
    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0):
        nn.Module.__init__(self)  # no new base weight: the base layer's tensors are kept
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        w = base.weight
        self.lora_A = nn.Linear(self.in_features, r, bias=False, device=w.device, dtype=w.dtype)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, device=w.device,
                                dtype=w.dtype)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if w.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
            # a base kept in autocast's dtype (store_base_in), run outside autocast
            w, b = w.to(x.dtype), None if b is None else b.to(x.dtype)
        out = F.linear(x, w, b)
        if not self.enabled:
            return out
        return out + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling

    def merged_weight(self) -> torch.Tensor:
        """What the layer computes (dropout aside) as one weight: W + alpha/r * B @ A, or W
        with the adapter off (models/packed.py samples on it)."""
        if not self.enabled:
            return self.weight
        return fold(self.weight, self.lora_A.weight, self.lora_B.weight, self.scaling)


def fold(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """W + scaling * B @ A, summed in fp32 (autocast or not), in the wider of W's and the
    adapter's dtypes."""
    with torch.autocast(w.device.type, enabled=False):
        delta = (b.detach().float() @ a.detach().float()) * scaling
    return (w.detach().float() + delta).to(torch.promote_types(w.dtype, b.dtype))


def _linears(model) -> dict[str, nn.Linear]:
    return {name: m for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and not isinstance(m, LoRALinear) and
            name != "lm_head" and ".lora_" not in name}


def apply_lora(model, r: int, alpha: float, dropout: float = 0.0,
               targets: list[str] | None = None) -> list[str]:
    """Replaces the `targets` linear layers (by the last part of their name; default: every
    linear of attention and MLP) with LoRALinear, in place, and freezes every other weight.
    Returns the replaced modules' names. Bad options are a ValueError naming the field."""
    if r <= 0 or int(r) != r:
        raise ValueError(f"lora_r: must be a positive integer, got {r}")
    if not alpha > 0:
        raise ValueError(f"lora_alpha: must be > 0, got {alpha}")
    if not 0 <= dropout < 1:
        raise ValueError(f"lora_dropout: must be in [0, 1), got {dropout}")
    targets = list(targets or DEFAULT_TARGETS[model.family])
    linears = _linears(model)
    short = sorted({n.rsplit(".", 1)[-1] for n in linears})
    for t in targets:
        if t == "lm_head":  # chunked.py applies the head from its weight, a chunk at a time
            raise ValueError("lora_target_modules: the LM head (lm_head) cannot take an "
                             "adapter here; target the attention and MLP layers")
        if not any(n.rsplit(".", 1)[-1] == t for n in linears):
            raise ValueError(f"lora_target_modules: no module named {t!r} in this "
                             f"{model.family} model (its linear layers: {', '.join(short)})")
    chosen = [n for n in linears if n.rsplit(".", 1)[-1] in targets]
    for name in chosen:
        m = linears[name]
        if r > min(m.in_features, m.out_features):
            raise ValueError(f"lora_r: {r} is larger than {name}'s smallest side "
                             f"({m.in_features} x {m.out_features})")
    model.requires_grad_(False)
    for name in chosen:
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, attr, LoRALinear(linears[name], int(r), float(alpha), dropout))
    return chosen


def lora_modules(model) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def store_base_in(model, dtype: torch.dtype) -> None:
    """The adapted layers' frozen base weights kept in `dtype`, the training autocast's:
    autocast casts them to it for every matmul anyway (rounding the same way), so no result
    changes and the base takes half the memory; a pass outside autocast casts them back
    to its input's dtype. Merges come out in the adapters' fp32."""
    for m in lora_modules(model).values():
        m.weight.data = m.weight.data.to(dtype)


def is_lora(model) -> bool:
    """Whether `model` trains LoRA adapters (its checkpoints then hold them alone)."""
    return any(isinstance(m, LoRALinear) for m in model.modules())


@dataclass(frozen=True)
class LoRAFacts:
    """What a LoRA policy's checkpoints record and are checked against, in one place: its
    adapters' options, read off its LoRALinear layers (nothing is stored on the model), and
    the fingerprint of the base they sit on (checkpoint.check_base; None: not known)."""
    r: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]  # the adapted layers' short names, in the model's order
    base: str | None = None

    @classmethod
    def of(cls, model, base: str | None = None) -> LoRAFacts | None:
        """The facts of `model`'s adapters; None for a model without any."""
        mods = lora_modules(model)
        if not mods:
            return None
        m = next(iter(mods.values()))
        dropout = m.dropout.p if isinstance(m.dropout, nn.Dropout) else 0.0
        return cls(int(m.r), float(m.alpha), float(dropout),
                   tuple(dict.fromkeys(n.rsplit(".", 1)[-1] for n in mods)), base)

    def options(self) -> dict:
        """As checkpoints store them (their "lora")."""
        return {"r": self.r, "alpha": self.alpha, "dropout": self.dropout,
                "targets": list(self.targets)}

    def same_options(self, saved) -> bool:
        """Whether a checkpoint's stored options are these (the targets in any order)."""
        return isinstance(saved, dict) and isinstance(saved.get("targets"), list) and \
            {**saved, "targets": sorted(map(str, saved["targets"]))} == \
            {**self.options(), "targets": sorted(self.targets)}


def adapter_keys(state) -> dict:
    """The adapters' entries of a state dict (or of any mapping keyed by weight name)."""
    return {k: v for k, v in state.items() if ".lora_" in k}


def merged(model, items):
    """(name, tensor) of the plain model, from `items`, the (name, tensor) of `model`'s state
    dict in its order (a stream: under fsdp each is gathered as it is read): each adapted
    weight comes out as W + alpha/r * B @ A once its B has gone by, no lora_ entry comes
    out, everything else passes as it is. Without adapters, `items` unchanged."""
    mods = lora_modules(model)
    if not mods:
        yield from items
        return
    held, a = {}, {}  # base weights and A's waiting for their B
    for name, t in items:
        prefix, _, part = name.rpartition(".lora_")
        if part == "A.weight":
            a[prefix] = t
        elif part == "B.weight":
            yield f"{prefix}.weight", fold(held.pop(prefix), a.pop(prefix), t,
                                           mods[prefix].scaling)
        elif name.endswith(".weight") and name[:-len(".weight")] in mods:
            held[name[:-len(".weight")]] = t
        else:
            yield name, t
    if held:
        raise ValueError(f"merged: no adapter came for {next(iter(held))}")


@contextmanager
def adapters_disabled(model):
    """Every adapter off inside: the model runs as its base (the reference policy)."""
    mods = list(lora_modules(model).values())
    saved = [m.enabled for m in mods]
    for m in mods:
        m.enabled = False
    try:
        yield model
    finally:
        for m, on in zip(mods, saved):
            m.enabled = on


@torch.no_grad()
def merged_state_dict(model, state: dict | None = None) -> dict[str, torch.Tensor]:
    """The state dict of the plain model (from `state`, the model's full one if given: a
    sharded model's, gathered): each adapter folded into its base weight, no lora_ keys.
    The live model is not changed."""
    return dict(merged(model, (model.state_dict() if state is None else state).items()))


def _peft_key(model, name: str, part: str) -> str:
    return f"base_model.model.{_theirs(model.family, name + '.weight')[:-len('.weight')]}" \
           f".{part}.weight"


def save_adapter(model, directory: str | Path, base_model: str = "",
                 state: dict | None = None) -> Path:
    """adapter_config.json + adapter_model.safetensors, in PEFT's format, from the model's
    adapters (or from `state`, its full state dict: a sharded model's, gathered). Only into a
    new or empty directory or one save_adapter wrote (ConfigError otherwise); written to a
    temporary directory and renamed, so a kill never leaves half of one."""
    from safetensors.torch import save_file

    info = LoRAFacts.of(model)
    mods = lora_modules(model)
    if info is None:
        raise ValueError("save_adapter: the model has no LoRA adapters")
    state = adapter_keys(model.state_dict() if state is None else state)
    tensors = {}
    for name in mods:
        for part in ("lora_A", "lora_B"):
            tensors[_peft_key(model, name, part)] = \
                state[f"{name}.{part}.weight"].detach().to("cpu").contiguous()
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": info.r,
              "lora_alpha": info.alpha, "lora_dropout": info.dropout,
              "target_modules": list(info.targets), "bias": "none", "inference_mode": True,
              "fan_in_fan_out": model.family == "gpt", "base_model_name_or_path": base_model}

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))

    return replace_dir(directory, ADAPTER_FILES, fill)


def read_adapter_config(directory: str | Path) -> dict:
    """adapter_config.json, checked: r, lora_alpha, lora_dropout, target_modules, and every
    other key by allowlist (PLAIN_LORA, ADAPTER_TYPES); anything else is a ValueError naming
    the file, the key and the value."""
    path = Path(directory) / "adapter_config.json"
    config = read_json_object(path, MAX_CONFIG_BYTES)
    if config is None:
        raise ValueError(f"{path}: no such file (not a PEFT adapter directory)")
    r, alpha = config.get("r"), config.get("lora_alpha")
    targets, dropout = config.get("target_modules"), config.get("lora_dropout", 0.0)
    if type(r) is not int or r <= 0:
        raise ValueError(f"{path}: r must be a positive integer, got {r!r}")
    if type(alpha) not in (int, float) or not alpha > 0:
        raise ValueError(f"{path}: lora_alpha must be a positive number, got {alpha!r}")
    if type(dropout) not in (int, float) or not 0 <= dropout < 1:
        raise ValueError(f"{path}: lora_dropout must be in [0, 1), got {dropout!r}")
    if not (isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)):
        raise ValueError(f"{path}: target_modules must be a list of module names")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {config.get('peft_type')!r} is not LORA")
    for key, value in config.items():
        if key in PLAIN_LORA:
            known = any(value == v and type(value) is type(v) for v in PLAIN_LORA[key])
        elif key in ADAPTER_TYPES:
            known = type(value) in ADAPTER_TYPES[key]
        else:  # a name not ours, quoted: the message stays one line
            known, key = False, f"key {key!r:.60}"
        if not known:
            raise ValueError(f"{path}: {key} {value!r:.60} is not supported (mini-grpo loads "
                             f"plain LoRA, W + lora_alpha / r * B A on every target module, "
                             f"and reads only the options it knows); save the adapter as "
                             f"plain LoRA")
    return config


@torch.no_grad()
def load_adapter(model, directory: str | Path, r: int = 0, weights: bool = True) -> list[str]:
    """A PEFT LoRA adapter onto `model` (its base): applies LoRA with the adapter's options
    when the model has none, then loads every A and B, each checked against its layer's
    shape (an adapter made for another base is refused, naming the key). `r`: the rank the
    caller expects (0: any); `weights=False`: the layers only (a model on the meta device)."""
    from safetensors import safe_open

    config = read_adapter_config(directory)
    if config.get("fan_in_fan_out", model.family == "gpt") != (model.family == "gpt"):
        raise ValueError(f"{directory}: fan_in_fan_out {config['fan_in_fan_out']} does not fit "
                         f"a {model.family} model (its layers store weights "
                         f"{'in x out' if model.family == 'gpt' else 'out x in'})")
    if r and r != config["r"]:
        raise ValueError(f"lora_r: {r}, but the adapter {directory} has r {config['r']}")
    if not lora_modules(model):
        apply_lora(model, config["r"], config["lora_alpha"], config.get("lora_dropout", 0.0),
                   config["target_modules"])
    file = Path(directory) / "adapter_model.safetensors"
    if not file.is_file():
        raise ValueError(f"{file}: no such file")
    want = {_peft_key(model, name, part): getattr(m, part).weight
            for name, m in lora_modules(model).items() for part in ("lora_A", "lora_B")}
    try:
        f = safe_open(str(file), "pt")
    except Exception as e:  # a header safetensors cannot parse
        raise ValueError(f"{file}: not a safetensors file ({str(e).splitlines()[0]})") from None
    with f:
        keys = set(f.keys())
        # PEFT may name the adapter (".lora_A.default.weight"): the default adapter is ours
        alias = {k.replace(".default.weight", ".weight"): k for k in keys}
        missing = sorted(set(want) - set(alias))
        extra = sorted(set(alias) - set(want))
        if missing or extra:
            raise ValueError(f"{file}: {'missing ' + missing[0] if missing else ''}"
                             f"{'; ' if missing and extra else ''}"
                             f"{'unexpected ' + extra[0] if extra else ''} (an adapter for "
                             f"another model?)")
        for key, param in want.items():
            shape = tuple(f.get_slice(alias[key]).get_shape())
            if shape != tuple(param.shape):
                raise ValueError(f"{file}: {key} has shape {shape}, this model's "
                                 f"{tuple(param.shape)} (an adapter for another base)")
            if weights:
                t = f.get_tensor(alias[key])
                if not t.is_floating_point() or not torch.isfinite(t).all():
                    raise ValueError(f"{file}: {key} is not finite floating-point values")
                param.copy_(t)
    return sorted(lora_modules(model))
