"""What a run's sizes must fit, refused with one line before any work starts: the processes
and threads (batches split over ranks, fsdp's shard groups and CPU offload, threads against
cores), the prompts and SFT's rows (block_size) and one step's rows (this machine's memory).
run.setup calls them in that order, as soon as each is known."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from . import distributed as D
from .config import ConfigError, GRPOConfig
from .data import batch_indices, sft_row, sft_target
from .fields import show
from .models import check_batch_memory

if TYPE_CHECKING:
    import torch

    from .tokenizer import Tokenizer


def check_world(cfg: GRPOConfig, dist: D.DistInfo, device: torch.device | None = None) -> None:
    """Combinations that would only fail deep inside the run, refused at the start."""
    # offloading moves nothing on a CPU device, and CPUOffloadPolicy's pinned memory needs an
    # accelerator (it was a traceback on every rank)
    if cfg.parallelism == "fsdp" and cfg.fsdp_cpu_offload and device is not None \
            and device.type == "cpu":
        raise ConfigError("fsdp_cpu_offload: moves the shards off a GPU into CPU memory; on a "
                          "CPU device they are there already (set it false)")
    cores = os.cpu_count() or 1
    if cfg.num_threads > 4 * cores:  # more threads than cores is ruinous already
        raise ConfigError(f"num_threads: {cfg.num_threads} threads on {cores} cores; at most "
                          f"4 x the cores ({4 * cores}), or 0 for cores / local ranks")
    if cfg.fsdp_shard_size and dist.world_size % cfg.fsdp_shard_size:
        raise ConfigError(f"fsdp_shard_size: {cfg.fsdp_shard_size} does not divide the "
                          f"{dist.world_size} processes")
    for key in ("prompts_per_step", "sft_batch_size"):
        if getattr(cfg, key) < dist.world_size:
            raise ConfigError(f"{key}: {getattr(cfg, key)} is smaller than the number of "
                              f"processes ({dist.world_size}): every rank needs at least one")


def check_lengths(cfg: GRPOConfig, tok: Tokenizer, prompts: list) -> int:
    """Every prompt (as the model sees it: BOS or chat template) plus max_new_tokens must fit
    in block_size; fail before work. Returns the longest prompt's tokens."""
    try:
        longest = max(len(tok.encode_prompt(p)) for p in prompts)
    except ValueError as e:  # messages without a chat template
        raise ConfigError(str(e)) from None
    if longest + cfg.max_new_tokens > cfg.block_size:
        raise ConfigError(f"block_size: {cfg.block_size} is too small for the longest prompt "
                          f"({longest} tokens) + max_new_tokens ({cfg.max_new_tokens})")
    return longest


# the modes whose stages (job.STAGES, which imports this module) begin with SFT on the task's
# rows
SFT_MODES = ("sft_grpo", "sft", "rft")


def check_sft_lengths(cfg: GRPOConfig, tok: Tokenizer, examples: list) -> None:
    """Where the run has an SFT stage, every training row it reads, as it reads it
    (data.sft_row: the prompt and its target, or its multi-turn demonstration), must fit in
    block_size; fail before work, naming the row (its file and line where it has them)."""
    if cfg.mode not in SFT_MODES or not cfg.sft_steps:
        return
    # the rows train_sft's steps read, in its order (its batches are consecutive slices of
    # one sequence): a row it never reaches is not encoded (smollm2_calculator's 30 steps
    # read 240 of 20000 demonstrations, each a chat template rendered)
    n = len(examples)
    read = sorted(set(batch_indices(n, min(n, cfg.sft_steps * cfg.sft_batch_size), 0,
                                    cfg.seed)))
    multi_turn = bool(cfg.tools or cfg.environment)  # as train_sft picks each row's target
    for i in read:
        ex = examples[i]
        target = sft_target(ex, multi_turn)
        ids, _ = sft_row(tok, ex.model_input, target)
        if len(ids) > cfg.block_size:
            prompt = len(tok.encode_prompt(ex.model_input))
            what = "demonstration conversation" if isinstance(target, list) else "target"
            raise ConfigError(
                f"block_size: {cfg.block_size} is too small for SFT on "
                f"{ex.where or f'training row {i + 1}'} (prompt {show(ex.prompt)}): its "
                f"prompt ({prompt} tokens) and {what} ({len(ids) + 1 - prompt} tokens, EOS "
                f"included) need {len(ids)} positions (the last token is predicted, not read)")


def check_step_memory(cfg: GRPOConfig, model_cfg, world_size: int, tokens: int) -> None:
    """The rows a rank samples together (a GRPO step's, an RFT batch's) against this machine's
    memory, before any work: ConfigError naming the fields that set them."""
    per_rank = -(-cfg.prompts_per_step // world_size) * cfg.group_size
    batches = [(per_rank, "prompts_per_step/group_size")]
    if cfg.mode in ("rft", "rft_grpo"):
        batches.append((cfg.rft_prompts_per_batch * cfg.rft_oversample,
                        "rft_prompts_per_batch/rft_oversample"))
    for rows, what in batches:
        try:
            check_batch_memory(model_cfg, rows, tokens, what)
        except ValueError as e:
            raise ConfigError(str(e)) from None
