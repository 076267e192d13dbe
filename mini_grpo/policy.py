"""The policy's weights and tokenizer, from wherever they come: a value that says where
(PolicySource), one small builder per kind, and build_policy, which dispatches on it and puts
the run's chat template and LoRA on top. Also what the commands read of a checkpoint before
they build anything (checkpoint_config: its config, checked like a user's; checkpoint_spec:
its architecture, checked against its weights on the meta device).

    src = PolicySource.of(cfg, checkpoint)     # gguf | hf | checkpoint | scratch (+ adapters)
    model, tok = build_policy(cfg, data, checkpoint)
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

import torch

from . import dcp_index
from .checkpoint import (
    CheckpointError,
    base_fingerprint,
    check_base,
    check_shapes,
    load_checkpoint,
    load_weights,
)
from .config import ConfigError, GRPOConfig, load_config, resolve_config_path
from .conversation import check_tool_answer
from .fields import read_yaml_mapping
from .lora import LoRAFacts, adapter_keys, apply_lora, load_adapter
from .models import CausalLM, GPTConfig, build, check_size, model_config
from .models.gguf import load_gguf
from .models.hf import load_hf_model
from .rewards import REWARDS
from .tasks import TaskData
from .tokenizer import (
    CharTokenizer,
    HFTokenizer,
    Tokenizer,
    check_model_vocab,
    tokenizer_from_state,
)
from .tools import BUILTIN_TOOLS, tool_schemas


@dataclass(frozen=True)
class PolicySource:
    """Where the policy's first weights come from, worked out once: a GGUF file, a Hugging
    Face directory, one of our checkpoints (`state`, loaded), or none (our GPT from the
    config, drawn from the seed). `adapters`: a LoRA checkpoint, whose adapters go on top of
    that base (it holds them alone: its base is init_from's, read again)."""
    kind: Literal["gguf", "hf", "checkpoint", "scratch"]
    path: str  # what the errors name
    state: dict | None = None
    adapters: dict | None = None

    @classmethod
    def of(cls, cfg: GRPOConfig, checkpoint: dict | None = None) -> PolicySource:
        """`checkpoint`: a loaded state given by a command (evaluate, export, ...), else
        init_from's, else none."""
        if checkpoint is not None and not checkpoint.get("lora"):
            return cls("checkpoint", "checkpoint", checkpoint)
        init, adapters = cfg.init_from, checkpoint
        if init and is_gguf(init):
            return cls("gguf", init, adapters=adapters)
        if init and is_model_dir(init):
            return cls("hf", init, adapters=adapters)
        if not init:
            return cls("scratch", "", adapters=adapters)
        state = load_checkpoint(init)
        if state.get("lora"):
            raise CheckpointError(f"{init}: a LoRA checkpoint holds its adapters alone: start "
                                  f"from its base with --init_from=BASE --adapter=DIR (a run's "
                                  f"<out_dir>/adapter)")
        return cls("checkpoint", init, state, adapters)

    @property
    def from_rank0(self) -> bool:
        """Weights that under fsdp rank 0 alone reads (or draws) and the others receive in
        shards: a pretrained model's or a random init's (ours: every rank reads them; a
        sharded one's read is a collective)."""
        return self.kind != "checkpoint"


def _from_gguf(src: PolicySource, cfg, data, meta: bool) -> tuple[CausalLM, Tokenizer]:
    return load_gguf(src.path, dtype=torch.float32, weights=not meta)


def _from_hf(src: PolicySource, cfg, data, meta: bool) -> tuple[CausalLM, Tokenizer]:
    model = load_hf_model(src.path, dtype=torch.float32, weights=not meta)  # fp32 masters
    try:
        tok = HFTokenizer.from_dir(src.path)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    if tok.vocab_size > model.cfg.vocab_size:
        raise CheckpointError(f"{src.path}: the tokenizer has {tok.vocab_size} tokens, the "
                              f"model's embedding {model.cfg.vocab_size}")
    return model, tok


def _from_checkpoint(src: PolicySource, cfg, data, meta: bool) -> tuple[CausalLM, Tokenizer]:
    tok = stored_tokenizer(src.state, src.path)
    spec = checkpoint_spec(src.state, cfg, tok, src.path)  # names and shapes checked
    torch.manual_seed(cfg.seed)
    model = build(spec)
    load_weights(src.state, model, source=src.path)
    return model, tok


def _from_scratch(src: PolicySource, cfg, data, meta: bool) -> tuple[CausalLM, Tokenizer]:
    tok = CharTokenizer(data.alphabet)
    spec = gpt_spec(cfg, tok.vocab_size)
    try:  # a checkpoint's spec is bounded by its weights, ours by memory
        check_size(spec, "n_layer/n_embd/block_size")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    with torch.device("meta") if meta else nullcontext():
        return build(spec), tok


BUILDERS = {"gguf": _from_gguf, "hf": _from_hf, "checkpoint": _from_checkpoint,
            "scratch": _from_scratch}


def build_policy(cfg: GRPOConfig, data: TaskData | None, checkpoint: dict | None = None,
                 meta: bool = False, schemas: list | None = None) -> tuple[CausalLM, Tokenizer]:
    """The policy (on CPU) and its tokenizer, from PolicySource.of(cfg, checkpoint): its
    builder, then the chat template, then with lora_r (or an adapter) LoRA on top, its base
    frozen, and a LoRA checkpoint's adapters. `meta`: where the source is read by rank 0
    alone (`from_rank0`), the model without weights, on the meta device; `schemas`: the
    tools' schemas the prompt lists, where the caller resolved them (else cfg.tools')."""
    src = PolicySource.of(cfg, checkpoint)
    meta = meta and src.from_rank0
    model, tok = BUILDERS[src.kind](src, cfg, data, meta)
    try:
        tok.configure_chat(cfg.chat_template, cfg.system_prompt,
                           tool_schemas(cfg.tools) if schemas is None else list(schemas))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.tools:
        check_tool_answer(tok)
    if cfg.environment and not getattr(tok, "chat", False):  # as configure_chat's for tools
        raise ConfigError("environment: a multi-turn conversation needs the chat template of "
                          "a Hugging Face tokenizer (init_from a model that has one)")
    if cfg.block_size > model.cfg.block_size:
        raise ConfigError(f"block_size: {cfg.block_size} exceeds the model's longest "
                          f"sequence ({model.cfg.block_size})")
    if cfg.lora_r or cfg.adapter:
        add_lora(model, cfg, meta)
    if src.adapters is not None:
        facts = lora_facts(model, cfg)
        check_base(src.adapters, facts.base, cfg.init_from, "checkpoint")
        if not facts.same_options(src.adapters["lora"]):
            raise CheckpointError(f"checkpoint: its adapters ({src.adapters['lora']}) are "
                                  f"not those its config describes ({facts.options()})")
        load_weights(src.adapters, model)
    model.gradient_checkpointing = cfg.gradient_checkpointing
    return model, tok


def add_lora(model: CausalLM, cfg: GRPOConfig, meta: bool = False) -> None:
    """LoRA adapters on `model` (a PEFT adapter's, or new ones of lora_r), its base frozen."""
    torch.manual_seed(cfg.seed)  # the same adapters on every rank
    try:
        if cfg.adapter:
            load_adapter(model, cfg.adapter, cfg.lora_r, weights=not meta)
        else:
            apply_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout,
                       cfg.lora_target_modules)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def lora_facts(model: CausalLM, cfg: GRPOConfig) -> LoRAFacts | None:
    """The LoRA facts of a policy built from `cfg`: its adapters' options and the base's
    fingerprint, its files as they are now (every checkpoint records it: check_base)."""
    facts = LoRAFacts.of(model)
    return facts and replace(facts, base=base_fingerprint(cfg.init_from))


def weights_from_rank0(cfg: GRPOConfig, checkpoint: dict | None) -> bool:
    """Whether under fsdp rank 0 alone reads (or draws) the first weights, decided before
    anything is loaded: no checkpoint given (a LoRA checkpoint's adapters, unlike
    PolicySource.from_rank0 for its base, go into every rank's full model), and init_from a
    pretrained model or nothing."""
    return checkpoint is None and (not cfg.init_from or is_pretrained(cfg.init_from))


def gpt_spec(cfg: GRPOConfig, vocab_size: int) -> dict:
    """Our GPT from the config's model fields (from-scratch runs, checkpoints without a spec)."""
    return {"family": "gpt", "config": asdict(GPTConfig(
        vocab_size=vocab_size, block_size=cfg.block_size, n_layer=cfg.n_layer,
        n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout))}


def is_model_dir(path: str) -> bool:
    """A Hugging Face model directory (not one of our sharded checkpoints, also directories)."""
    return Path(path).is_dir() and Path(path).suffix != ".dcp"


def is_gguf(path: str) -> bool:
    """A GGUF file (llama.cpp's format), by its name: `load_gguf` checks what it holds."""
    return Path(path).suffix.lower() == ".gguf" and not Path(path).is_dir()


def is_pretrained(path: str) -> bool:
    """A pretrained model from outside: a Hugging Face directory or a GGUF file."""
    return is_model_dir(path) or is_gguf(path)


def stored_tokenizer(state: dict, source: str) -> Tokenizer:
    try:
        return tokenizer_from_state(state.get("tokenizer"))
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None


def checkpoint_spec(state: dict, cfg: GRPOConfig, tok: Tokenizer, source: str) -> dict:
    """The architecture of a checkpoint's model: its stored spec (untrusted: checked, and
    its layer count compared with the weights before anything is built), or, for one saved
    before specs were stored, our GPT from the config's fields."""
    spec = state.get("model_spec") or gpt_spec(cfg, tok.vocab_size)
    weights = state.get("model")
    if state.get("sharded"):  # names and shapes from DCP's metadata, nothing read yet
        weights = {k: torch.empty(s, device="meta")
                   for k, s in dcp_index.sharded_shapes(state["sharded"]).items()}
    if not isinstance(weights, dict):
        raise CheckpointError(f"{source}: no model weights")
    try:
        n_layer = model_config(spec).n_layer
        check_model_vocab(tok, model_config(spec).vocab_size)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: {e}") from None
    layers = {k.split(".")[1] for k in weights if k.startswith(("blocks.", "layers."))}
    if n_layer != len(layers):
        raise CheckpointError(f"{source}: its model has {n_layer} layers, its weights "
                              f"{len(layers)}")
    try:  # sizes no machine holds would overflow even on the meta device
        check_size(spec, "its model_spec")
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None
    with torch.device("meta"):
        meta = build(spec)
    lora = state.get("lora")
    if lora is not None:  # LoRA's checkpoints hold the adapters alone
        try:
            apply_lora(meta, lora["r"], lora["alpha"], lora["dropout"], lora["targets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{source}: its LoRA options are not valid ({e})") from None
    expected = {k: v.shape for k, v in meta.state_dict().items()}
    check_shapes(adapter_keys(expected) if lora is not None else expected, weights, source)
    return spec


# The fields whose values name code to import (package.module:name), each with the values
# mini-grpo ships itself and how a user names it on the command line: a field of the kind
# added to the config is added here or to TRAINING_CODE, and tests/test_run.py checks each.
def foreign_code(cfg: GRPOConfig) -> dict[str, list[str]]:
    """{field: its values that would import code mini-grpo does not ship}."""
    return {"rewards": [r["name"] for r in cfg.rewards or [] if r["name"] not in REWARDS],
            "tools": [t for t in cfg.tools if t not in BUILTIN_TOOLS],
            "environment": [cfg.environment] if cfg.environment else []}


# Fields that name code only training runs (a user's advantage estimator, policy loss): the
# commands that read a checkpoint drop the checkpoint's value for the default, unless the user
# names it.
TRAINING_CODE = ("advantage_estimator", "policy_loss")


NAME_IT = {"rewards": ("--rewards='[{{name: {}}}]'", "--rewards=null for the task's defaults"),
           "tools": ("--tools='[{}]'", "--tools=[] for none"),
           "environment": ("--environment={}", "--environment='' for none")}


def refuse_stored_code(cfg: GRPOConfig, named: set[str], source: str) -> None:
    """The one rule for code a file names (a checkpoint's stored config; DESIGN.md): a field
    of foreign_code is imported only where the user named that field, on the command line or
    in their --config file (`named`); where the value is the file's alone, CheckpointError
    before anything is imported. A user who names the field takes what it runs as theirs."""
    for field, values in foreign_code(cfg).items():
        if values and field not in named:
            example, none = NAME_IT[field]
            raise CheckpointError(
                f"{source}: its config names {field} mini-grpo does not ship "
                f"({', '.join(values)}); code a checkpoint names is not imported: name the "
                f"{field} yourself, e.g. {example.format(values[0])}, or {none}")


def checkpoint_config(path: str, overrides: dict[str, str],
                      config: str | None = None) -> tuple[dict, GRPOConfig]:
    """(state, config) of a checkpoint for `mini-grpo evaluate / sample / rft-generate`:
    the defaults < the checkpoint's stored config < the user's `config` file (--config) <
    `overrides` (--key=value); for a Hugging Face directory or GGUF file, which stores none,
    init_from is the path.

    The stored config is untrusted input, checked exactly like a user's (unknown keys, bad
    values: CheckpointError naming the key). The code it names (reward plugins, tools, an
    environment) is never imported on its own say: refuse_stored_code.
    The model it describes must match the stored weights' shapes before anything is
    allocated: the comparison runs on the meta device.
    """
    if is_pretrained(path):
        try:
            return None, load_config(config, {**overrides, "init_from": path}, env={})
        except ConfigError as e:
            raise CheckpointError(str(e)) from None
    state = load_checkpoint(path)
    stored = state.get("config")
    if not isinstance(stored, dict):
        raise CheckpointError(f"{path}: not a mini-grpo checkpoint (no config)")
    tok = stored_tokenizer(state, path)
    try:
        cfg = load_config(config, overrides, env={}, base=stored, base_where=f"{path}: ")
        named = {*overrides, *(read_yaml_mapping(resolve_config_path(config)) if config
                               else ())}
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    for field in TRAINING_CODE:
        if field not in named:
            setattr(cfg, field, getattr(GRPOConfig, field))
    refuse_stored_code(cfg, named, path)
    checkpoint_spec(state, cfg, tok, path)  # sharded: the shards are read by build_policy
    return state, cfg
