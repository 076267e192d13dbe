"""setup(cfg) -> Run: everything a job needs, built once in this order and torn down in one place.

    with setup(cfg) as run:            # train (job.py), benchmark.py
        train_grpo(run)
    with setup(cfg, checkpoint=state, log=False) as run:   # mini-grpo evaluate / rft-generate
        evaluate(run, greedy=True)

Order: distributed init -> checks that need the world size -> device, threads, allocator ->
task (its data) -> reward scorer (bad plugin names fail here, before any model is built) ->
policy and tokenizer (a given checkpoint's, else `init_from`'s: a Hugging Face directory or
one of our checkpoints, else our GPT from the config's fields, randomly initialised from the
seed, identical on every rank, with the task's alphabet; shapes checked before anything is
allocated) -> length check -> precision (with its probe for `auto`) -> the trained form
(sharded under fsdp, compiled, DDP under torchrun) -> logger (rank 0 of a training run).
The reference policy is frozen later, when GRPO starts from whatever SFT left
(`Run.freeze_reference`). `close()` undoes it all in reverse.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from . import distributed as D
from . import fsdp
from .checkpoint import (
    CheckpointError,
    base_fingerprint,
    check_base,
    check_shapes,
    load_checkpoint,
    load_weights,
)
from .config import ConfigError, GRPOConfig, load_config
from .dtype_probe import probe_dtypes
from .engines import Engine, check_engine, make_engine
from .engines.native import NativeEngine
from .limits import check_lengths, check_step_memory, check_world
from .logger import RunLogger
from .lora import adapter_keys, apply_lora, is_lora, load_adapter, store_base_in
from .models import CausalLM, GPTConfig, build, check_size, model_config, spec
from .models.gguf import load_gguf
from .models.hf import load_hf_model
from .precision import (
    Precision,
    attention_impl,
    compile_with_fallback,
    resolve_device,
    resolve_precision,
    setup_backends,
)
from .reference import AdaptersOff, Reference
from .rewards import REWARDS
from .scoring import RewardScorer
from .tasks import TaskData, build_task
from .tokenizer import (
    CharTokenizer,
    HFTokenizer,
    Tokenizer,
    check_model_vocab,
    tokenizer_from_state,
)


@dataclass
class Run:
    cfg: GRPOConfig
    dist: D.DistInfo
    device: torch.device
    threads: int
    precision: Precision
    task: TaskData | None
    tok: Tokenizer
    model: CausalLM  # the bare policy: sampling, evaluation, checkpoints
    net: torch.nn.Module  # the policy as trained: compiled and/or DDP-wrapped
    comm: D.CommTimer | None  # seconds in DDP's or FSDP's collectives
    scorer: RewardScorer | None
    logger: RunLogger | None  # rank 0 of a training run only
    reference: Reference | None = None
    # what samples (engines/): GRPO's rollouts, evaluation, RFT's data, `mini-grpo sample`
    engine: Engine | None = None

    def freeze_reference(self) -> None:
        """The reference policy: a frozen copy of the policy as it is now (beta 0: none).
        Under fsdp sharded like the policy (its passes are collectives, as the policy's) and
        made from each rank's shards, never gathered; or with offload_reference a full copy in
        CPU memory, streamed to the device per pass."""
        cfg = self.cfg
        if not cfg.beta:
            return
        if is_lora(self.model):  # LoRA: the base, with the adapters switched off; no copy
            self.reference = AdaptersOff(self.model)
            return
        if not self.sharded:
            self.reference = Reference(self.model, self.device, cfg.offload_reference)
            return
        with torch.device("meta"):
            model = build(spec(self.model))
        if cfg.offload_reference:  # a full copy in every rank's CPU memory
            model.assign(fsdp.model_state(self.model, everywhere=True))  # a collective
            model.attn_impl = self.model.attn_impl
        else:
            model = fsdp.frozen_copy(self.model, model, self.device,
                                     param_dtype=_fsdp_dtype(self.precision),
                                     cpu_offload=cfg.fsdp_cpu_offload,
                                     shard_size=cfg.fsdp_shard_size, timer=self.comm)
        self.reference = Reference(model, self.device, cfg.offload_reference, copy=False)

    def sampler(self, alone: bool = False) -> Engine:
        """The engine every caller samples through. It serves the weights of its last
        `sync_engine`. `alone`: for a rank that samples while the others do not (evaluation
        on rank 0), an engine with no collective in `generate`: the run's, or where that is a
        tensor-parallel vLLM group, our native sampler."""
        if alone and not self.engine.alone:
            return NativeEngine(self.model, self.tok, self.cfg.kv_cache)
        return self.engine

    def sync_engine(self) -> None:
        """The engine takes the policy's current weights (on every rank: a collective where
        the engine keeps a copy; nothing to do for the native one). Outside full_params."""
        self.engine.sync(self.model)

    @property
    def sharded(self) -> bool:
        return self.cfg.parallelism == "fsdp" and self.dist.world_size > 1

    def identity(self) -> dict:
        """What every checkpoint carries besides weights: the config, the tokenizer, the
        model's architecture (models.spec) and, under LoRA, its adapters' options and their
        base's fingerprint (checkpoint.check_base)."""
        return {"config": self.cfg.to_dict(), "tokenizer": self.tok.state(),
                "model_spec": spec(self.model), "lora": getattr(self.model, "lora", None),
                "base": getattr(self.model, "lora_base", None)}

    def print0(self, message: str) -> None:
        if self.dist.is_main:
            print(message, flush=True)

    def close(self, failed: bool = False) -> None:
        if self.engine is not None:
            self.engine.close()
        if self.scorer is not None:
            self.scorer.close()
        if self.logger is not None:
            self.logger.close()
        self.net = self.model  # DDP's reducer must not outlive the process group
        D.cleanup(wait=not failed)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(failed=exc_type is not None)


def setup(cfg: GRPOConfig, checkpoint: dict | None = None, log: bool = True,
          task: bool | TaskData = True, train: bool = True) -> Run:
    """The Run for `cfg`; `checkpoint` (a loaded state) gives the policy's weights and
    tokenizer; `log=False` skips the run directory and logger (evaluation, sampling);
    `task=False` skips the task and scorer (sampling), a TaskData is used as it is (the
    benchmark's ablations build the task once); `train=False`: a command that only samples
    (evaluate, sample, rft-generate), whose precision probe times sampling alone."""
    dist = D.init(cfg.dist_timeout)
    scorer = None
    try:
        check_world(cfg, dist)
        device = resolve_device(cfg, dist.local_rank)
        check_engine(cfg, device)
        threads = setup_backends(cfg, dist.local_world_size)
        data = task if isinstance(task, TaskData) else build_task(cfg) if task else None
        if data is not None:
            scorer = RewardScorer.from_config(cfg, data)
        sharded = cfg.parallelism == "fsdp" and dist.world_size > 1
        # under fsdp, a pretrained model or a random init is read (drawn) by rank 0 alone and
        # sent to the others' shards, which start on the meta device: a node holds one copy
        # (on a CPU device every rank builds its own: the precision probe runs on each)
        from_rank0 = sharded and weights_from_rank0(cfg, checkpoint)
        model, tok = build_policy(cfg, data, checkpoint, meta=from_rank0 and not dist.is_main
                                  and device.type != "cpu")
        if not sharded:  # under fsdp each block goes to the device as it is sharded, so the
            model.to(device)  # device never holds the whole model
        longest = check_lengths(cfg, tok, [ex.model_input for ex in data.train + data.eval]) \
            if data is not None else 0
        if train and data is not None:
            check_step_memory(cfg, model.cfg, dist.world_size,
                              min(longest + cfg.max_new_tokens, model.cfg.block_size))
        precision = resolve_precision(cfg, device, lambda parts: probe_dtypes(model, cfg, parts),
                                      train)
        model.attn_impl = attention_impl(cfg.attn_impl, device, precision.dtype)
        if is_lora(model) and precision.dtype in (torch.bfloat16, torch.float16):
            store_base_in(model, precision.dtype)  # half the frozen base's bytes, same results
        if sharded:  # in place, before compiling: dynamo then compiles between FSDP's hooks
            full = model.state_dict() if from_rank0 and dist.is_main else {}
            comm = D.CommTimer()
            fsdp.shard(model, device, _fsdp_dtype(precision), cfg.fsdp_cpu_offload,
                       cfg.fsdp_shard_size, comm)
            if from_rank0:
                fsdp.load_from_rank0(model, full, device, cfg.fsdp_cpu_offload)
                del full
        trained = compile_with_fallback(model, cfg.compile_mode) if cfg.compile_model else model
        # DDP-wrapped under torchrun, as it is in a single process (then comm is None)
        net, comm = (trained, comm) if sharded else D.wrap_ddp(trained, device)
        logger = open_run_dir(cfg, tok) if log and dist.is_main else None
    except BaseException:
        if scorer is not None:
            scorer.close()
        D.cleanup(wait=False)
        raise
    run = Run(cfg, dist, device, threads, precision, data, tok, model, net, comm, scorer, logger)
    try:  # before any work: a model the engine cannot serve is refused here
        run.engine = make_engine(run, min(longest + cfg.max_new_tokens, model.cfg.block_size)
                                 if longest else None)
    except BaseException:
        run.close(failed=True)
        raise
    if data is not None:
        procs = f"{dist.world_size} process{'es' if dist.world_size > 1 else ''}"
        run.print0(f"[mini-grpo] task {data.name}: {len(data.train)} train / {len(data.eval)} "
                   f"held-out prompts; model {model.num_params() / 1e6:.2f}M params; {procs} on "
                   f"{device}, {threads} threads; {precision.describe()}"
                   + (f"; run directory {cfg.out_dir}" if logger else ""))
    if data is not None and log:  # a training run: what each rank holds, as the table
        mem = {k: v / 2**20 for k, v in fsdp.memory_report(model).items()}
        how = f"{cfg.parallelism} over {dist.world_size}" if dist.enabled else "one process"
        frozen = f" (+ {mem['frozen']:.1f} MiB frozen: LoRA's base)" if mem["frozen"] else ""
        print(f"[mini-grpo] rank {dist.rank} holds ({how}): parameters {mem['params']:.1f} MiB"
              f"{frozen}, gradients {mem['grads']:.1f} MiB, AdamW state "
              f"{mem['optimizer']:.1f} MiB", flush=True)
    return run


def _fsdp_dtype(precision: Precision) -> torch.dtype | None:
    """bf16 parameters under fsdp when training runs in bf16 (gradients reduced in fp32)."""
    return torch.bfloat16 if precision.dtype == torch.bfloat16 else None


def gpt_spec(cfg: GRPOConfig, vocab_size: int) -> dict:
    """Our GPT from the config's model fields (from-scratch runs, checkpoints without a spec)."""
    return {"family": "gpt", "config": asdict(GPTConfig(
        vocab_size=vocab_size, block_size=cfg.block_size, n_layer=cfg.n_layer,
        n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout))}


def build_policy(cfg: GRPOConfig, data: TaskData | None, checkpoint: dict | None = None,
                 meta: bool = False) -> tuple[CausalLM, Tokenizer]:
    """The policy (on CPU) and its tokenizer: those of `checkpoint` (a loaded state), else of
    `init_from` (a Hugging Face directory, a GGUF file or one of our checkpoints), else our
    GPT from the config's fields with the task's alphabet, randomly initialised from the
    seed; with lora_r (or an adapter) LoRA on top, its base frozen. A LoRA checkpoint holds
    adapters alone: its base is read from init_from again. `meta`: where `weights_from_rank0`
    allows, the model without weights, on the meta device."""
    adapters = checkpoint if checkpoint is not None and checkpoint.get("lora") else None
    checkpoint = None if adapters else checkpoint  # a LoRA checkpoint's base is init_from's
    source = "checkpoint"
    meta = meta and weights_from_rank0(cfg, checkpoint)
    if checkpoint is None and cfg.init_from and is_gguf(cfg.init_from):
        model, tok = load_gguf(cfg.init_from, dtype=torch.float32, weights=not meta)
    elif checkpoint is None and cfg.init_from and is_model_dir(cfg.init_from):
        model = load_hf_model(cfg.init_from, dtype=torch.float32,  # fp32 master weights
                              weights=not meta)
        try:
            tok = HFTokenizer.from_dir(cfg.init_from)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        if tok.vocab_size > model.cfg.vocab_size:
            raise CheckpointError(f"{cfg.init_from}: the tokenizer has {tok.vocab_size} "
                                  f"tokens, the model's embedding {model.cfg.vocab_size}")
    else:
        if checkpoint is None and cfg.init_from:
            checkpoint, source = load_checkpoint(cfg.init_from), cfg.init_from
            if checkpoint.get("lora"):
                raise CheckpointError(f"{source}: a LoRA checkpoint holds its adapters "
                                      f"alone: start from its base with --init_from=BASE "
                                      f"--adapter=DIR (a run's <out_dir>/adapter)")
        tok = CharTokenizer(data.alphabet) if checkpoint is None else \
            stored_tokenizer(checkpoint, source)
        spec = checkpoint_spec(checkpoint, cfg, tok, source) if checkpoint else \
            gpt_spec(cfg, tok.vocab_size)
        if checkpoint is None:  # a checkpoint's spec is bounded by its weights, ours by memory
            try:
                check_size(spec, "n_layer/n_embd/block_size")
            except ValueError as e:
                raise ConfigError(str(e)) from None
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        with torch.device("meta") if meta else nullcontext():
            model = build(spec)
        if checkpoint is not None:  # names and shapes checked by checkpoint_spec
            load_weights(checkpoint, model, source=source)
    try:
        tok.configure_chat(cfg.chat_template, cfg.system_prompt)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.block_size > model.cfg.block_size:
        raise ConfigError(f"block_size: {cfg.block_size} exceeds the model's longest "
                          f"sequence ({model.cfg.block_size})")
    if cfg.lora_r or cfg.adapter:
        torch.manual_seed(cfg.seed)  # the same adapters on every rank
        try:
            if cfg.adapter:
                load_adapter(model, cfg.adapter, cfg.lora_r, weights=not meta)
            else:
                apply_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout,
                           cfg.lora_target_modules)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        # the base as its files were when read, recorded in every checkpoint (check_base)
        model.lora_base = base_fingerprint(cfg.init_from)
    if adapters is not None:
        check_base(adapters, model.lora_base, cfg.init_from, "checkpoint")
        if model.lora != adapters["lora"]:
            raise CheckpointError(f"checkpoint: its adapters ({adapters['lora']}) are not "
                                  f"those its config describes ({model.lora})")
        load_weights(adapters, model)
    model.gradient_checkpointing = cfg.gradient_checkpointing
    return model, tok


def weights_from_rank0(cfg: GRPOConfig, checkpoint: dict | None) -> bool:
    """Whether the policy's first weights are a Hugging Face directory's or a random init's,
    which under fsdp rank 0 alone reads (or draws) and the others receive in shards (ours:
    every rank reads them; a sharded one's read is a collective)."""
    return checkpoint is None and (not cfg.init_from or is_pretrained(cfg.init_from))


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
                   for k, s in fsdp.sharded_shapes(state["sharded"]).items()}
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


def checkpoint_config(path: str, overrides: dict[str, str]) -> tuple[dict, GRPOConfig]:
    """(state, config) of a checkpoint for `mini-grpo evaluate / sample / rft-generate`.

    The stored config is untrusted input, checked exactly like a user's (unknown keys, bad
    values: CheckpointError naming the key). Reward plugins it names that mini-grpo does not
    ship are not imported unless the command line names the rewards itself. The model it
    describes must match the stored weights' shapes before anything is allocated: the
    comparison runs on the meta device.
    """
    if is_pretrained(path):  # a Hugging Face directory or GGUF: the defaults, its model
        try:
            return None, load_config(None, {**overrides, "init_from": path}, env={})
        except ConfigError as e:
            raise CheckpointError(str(e)) from None
    state = load_checkpoint(path)
    stored = state.get("config")
    if not isinstance(stored, dict):
        raise CheckpointError(f"{path}: not a mini-grpo checkpoint (no config)")
    tok = stored_tokenizer(state, path)
    try:
        cfg = load_config(None, overrides, env={}, base=stored, base_where=f"{path}: ")
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    if "rewards" not in overrides:
        foreign = [r["name"] for r in cfg.rewards or [] if r["name"] not in REWARDS]
        if foreign:
            raise CheckpointError(f"{path}: its config names reward plugins mini-grpo does not "
                                  f"ship ({', '.join(foreign)}); they are not imported from a "
                                  f"checkpoint: name the rewards yourself, e.g. "
                                  f"--rewards='[{{name: {foreign[0]}}}]', or --rewards=null "
                                  f"for the task's defaults")
    checkpoint_spec(state, cfg, tok, path)  # sharded: the shards are read by build_policy
    return state, cfg


def open_run_dir(cfg: GRPOConfig, tok: Tokenizer) -> RunLogger:
    """Creates out_dir (an unusable one is a ConfigError naming it), saves a character
    tokenizer's alphabet (tokenizer.json) and opens the logger. The resolved config is saved
    by the job once it knows the run may go on (a refused resume must not overwrite the
    config.yaml of the run it refused)."""
    out = Path(cfg.out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"out_dir: cannot write to {out} ({e.strerror or e})") from None
    if isinstance(tok, CharTokenizer):
        tok.save(out / "tokenizer.json")
    return RunLogger(out, cfg.max_steps, cfg.report_to, cfg.to_dict())
