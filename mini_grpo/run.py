"""setup(cfg) -> Run: everything a job needs, built once in this order and torn down in one place.

    with setup(cfg) as run:            # train (job.py), benchmark.py
        train_grpo(run)
    with setup(cfg, checkpoint=state, log=False) as run:   # mini-grpo evaluate / rft-generate
        evaluate(run, greedy=True)

Order: distributed init -> checks that need the world size -> device, threads, allocator ->
task (its data) -> tokenizer -> length check -> reward scorer (bad plugin names fail here,
before any model is built) -> policy (random init from the seed, identical on every rank,
then `init_from` or the given checkpoint's weights, shapes checked before anything is
allocated) -> precision (with its probe for `auto`) -> the trained form (compiled, DDP) ->
logger (rank 0 of a training run). The reference policy is frozen later, when GRPO starts from
whatever SFT left (`Run.freeze_reference`). `close()` undoes it all in reverse.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from . import distributed as D
from .checkpoint import CheckpointError, check_shapes, load_checkpoint
from .config import ConfigError, GRPOConfig, load_config
from .logger import RunLogger
from .model import GPT, GPTConfig
from .precision import (
    Precision,
    compile_with_fallback,
    resolve_device,
    resolve_precision,
    setup_backends,
)
from .reference import Reference
from .rewards import REWARDS
from .scoring import RewardScorer
from .tasks import TaskData, build_task
from .tokenizer import CharTokenizer


@dataclass
class Run:
    cfg: GRPOConfig
    dist: D.DistInfo
    device: torch.device
    threads: int
    precision: Precision
    task: TaskData | None
    tok: CharTokenizer
    model: GPT  # the bare policy: sampling, evaluation, checkpoints
    net: torch.nn.Module  # the policy as trained: compiled and/or DDP-wrapped
    comm: D.CommTimer | None  # DDP's gradient all-reduce time, under torchrun
    scorer: RewardScorer | None
    logger: RunLogger | None  # rank 0 of a training run only
    reference: Reference | None = None

    def freeze_reference(self) -> None:
        """The reference policy: a frozen copy of the policy as it is now (beta 0: none)."""
        if self.cfg.beta:
            self.reference = Reference(self.model, self.device, self.cfg.offload_reference)

    def print0(self, message: str) -> None:
        if self.dist.is_main:
            print(message, flush=True)

    def close(self, failed: bool = False) -> None:
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
          task: bool | TaskData = True) -> Run:
    """The Run for `cfg`; `checkpoint` (a loaded state) gives the policy's weights and
    tokenizer; `log=False` skips the run directory and logger (evaluation, sampling);
    `task=False` skips the task and scorer (sampling), a TaskData is used as it is (the
    benchmark's ablations build the task once)."""
    dist = D.init(cfg.dist_timeout)
    scorer = None
    try:
        check_world(cfg, dist)
        device = resolve_device(cfg, dist.local_rank)
        threads = setup_backends(cfg, dist.local_world_size)
        data = task if isinstance(task, TaskData) else build_task(cfg) if task else None
        chars = checkpoint["tokenizer"] if checkpoint is not None else data.alphabet
        tok = CharTokenizer(chars)
        if data is not None:
            check_lengths(cfg, [ex.prompt for ex in data.train + data.eval])
            scorer = RewardScorer.from_config(cfg, data)
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        model = build_model(cfg, tok.vocab_size, device)
        if checkpoint is not None:
            load_weights(model, checkpoint["model"], "checkpoint")
        elif cfg.init_from:
            load_weights(model, load_checkpoint(cfg.init_from)["model"], cfg.init_from)
        precision = resolve_precision(cfg, device, model)
        model.attn_impl = attention_impl(cfg, precision)
        trained = compile_with_fallback(model, cfg.compile_mode) if cfg.compile_model else model
        net, comm = D.wrap_ddp(trained, device)  # (trained, None) in a single process
        logger = open_run_dir(cfg, tok) if log and dist.is_main else None
    except BaseException:
        if scorer is not None:
            scorer.close()
        D.cleanup(wait=False)
        raise
    run = Run(cfg, dist, device, threads, precision, data, tok, model, net, comm, scorer, logger)
    if data is not None:
        procs = f"{dist.world_size} process{'es' if dist.world_size > 1 else ''}"
        run.print0(f"[mini-grpo] task {data.name}: {len(data.train)} train / {len(data.eval)} "
                   f"held-out prompts; model {model.num_params() / 1e6:.2f}M params; {procs} on "
                   f"{device}, {threads} threads; {precision.describe()}"
                   + (f"; run directory {cfg.out_dir}" if logger else ""))
    return run


def check_world(cfg: GRPOConfig, dist: D.DistInfo) -> None:
    """Combinations that would only fail deep inside the run, refused at the start."""
    for key in ("prompts_per_step", "sft_batch_size"):
        if getattr(cfg, key) < dist.world_size:
            raise ConfigError(f"{key}: {getattr(cfg, key)} is smaller than the number of "
                              f"processes ({dist.world_size}): every rank needs at least one")


def check_lengths(cfg: GRPOConfig, prompts: list[str]) -> None:
    """Every prompt (with BOS) plus max_new_tokens must fit in block_size; fail before work."""
    longest = max(len(p) for p in prompts) + 1
    if longest + cfg.max_new_tokens > cfg.block_size:
        raise ConfigError(f"block_size: {cfg.block_size} is too small for the longest prompt "
                          f"({longest} tokens) + max_new_tokens ({cfg.max_new_tokens})")


def model_config(cfg: GRPOConfig, vocab_size: int) -> GPTConfig:
    return GPTConfig(vocab_size=vocab_size, block_size=cfg.block_size, n_layer=cfg.n_layer,
                     n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout)


def build_model(cfg: GRPOConfig, vocab_size: int, device=None) -> GPT:
    """The policy from the config's model fields, on `device` (default: CPU)."""
    model = GPT(model_config(cfg, vocab_size))
    model.gradient_checkpointing = cfg.gradient_checkpointing
    return model.to(torch.device(device or "cpu"))


def attention_impl(cfg: GRPOConfig, precision: Precision) -> str:
    """auto: manual attention under bf16 autocast on a CPU (SDPA's bf16 backward ran 2-3x
    slower there), else SDPA."""
    if cfg.attn_impl != "auto":
        return cfg.attn_impl
    cpu_bf16 = precision.device.type == "cpu" and precision.dtype == torch.bfloat16
    return "manual" if cpu_bf16 else "sdpa"


def load_weights(model: GPT, state: dict, source: str) -> None:
    check_shapes({k: v.shape for k, v in model.state_dict().items()}, state, source)
    model.load_state_dict(state)


def checkpoint_config(path: str, overrides: dict[str, str]) -> tuple[dict, GRPOConfig]:
    """(state, config) of a checkpoint for `mini-grpo evaluate / sample / rft-generate`.

    The stored config is untrusted input, checked exactly like a user's (unknown keys, bad
    values: CheckpointError naming the key). Reward plugins it names that mini-grpo does not
    ship are not imported unless the command line names the rewards itself. The model it
    describes must match the stored weights' shapes before anything is allocated: the
    comparison runs on the meta device.
    """
    state = load_checkpoint(path)
    stored = state.get("config")
    tokenizer = state.get("tokenizer")
    if not isinstance(stored, dict) or not isinstance(tokenizer, list) or \
            not all(isinstance(c, str) and len(c) == 1 for c in tokenizer):
        raise CheckpointError(f"{path}: not a mini-grpo checkpoint (no config or tokenizer)")
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
    with torch.device("meta"):
        meta = GPT(model_config(cfg, CharTokenizer(tokenizer).vocab_size))
    check_shapes({k: v.shape for k, v in meta.state_dict().items()}, state["model"], path)
    return state, cfg


def open_run_dir(cfg: GRPOConfig, tok: CharTokenizer) -> RunLogger:
    """Creates out_dir (an unusable one is a ConfigError naming it), saves the tokenizer and
    opens the logger. The resolved config is saved by the job once it knows the run may go
    on (a refused resume must not overwrite the config.yaml of the run it refused)."""
    out = Path(cfg.out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"out_dir: cannot write to {out} ({e.strerror or e})") from None
    tok.save(out / "tokenizer.json")
    return RunLogger(out, cfg.max_steps, cfg.report_to, cfg.to_dict())
