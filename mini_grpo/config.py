"""GRPOConfig: every knob of mini-grpo in one typed dataclass, and how it is resolved.

Sources, lowest precedence first:
    defaults < YAML file (a path, or a bare name looked up in configs/) < environment
    variables (ENV_VARS below) < command line `--key=value`.

Bad input raises ConfigError with one line that names the key, file or variable; entry points
turn it into exit code 2 before any work starts.

`task_args` belong to a task: a layer's task_args apply only when the task in effect after
that layer is the final one (a preset's chess_fen options are dropped, with a note on stderr,
when the command line picks countdown). The task validates them through task_registry, so
the config imports no task.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import typing
from dataclasses import dataclass
from typing import Any, Literal

import yaml

from .advantages import ADVANTAGES
from .config_layers import LEGACY_TASK_ARGS, Layers, resolve_config_path
from .fields import ConfigError, check_named, coerce, parse_cli, read_yaml_mapping, show
from .losses import POLICY_LOSSES
from .options import check_ranges, env_vars, expand_paths, opt
from .task_registry import MAX_GENERATED, resolve_task_args

TRACKERS = ("tensorboard", "wandb")  # report_to: where metrics go beside metrics.jsonl


@dataclass
class GRPOConfig:
    # Each field: opt(default, roles, range check, env=its environment variable); what each
    # role means (a stage it shapes, fixed on resume, a loss setting): options.ROLES. The comment
    # lines above a field and the one beside it are its --help text: tests fail for one without.

    # ---- run ----
    # run directory: config.yaml, metrics.jsonl, tb/, checkpoints/
    out_dir: str = opt("runs/default", "run", env="OUT_DIR", path=True)
    seed: int = opt(1337, "sft", f"0..{2**32 - 1}", env="SEED")  # every random draw derives from it
    device: str = opt("auto", "run")  # auto = cuda if available, else cpu
    resume: str = opt("auto", "run", path=True)  # auto | never | path to a checkpoint
    # which stages the train job runs; rft = SFT, then RFT data from it, then SFT on that data;
    # rft_grpo = RFT from init_from's model (data, then SFT on it), then GRPO
    mode: Literal["sft_grpo", "sft", "grpo", "rft", "rft_grpo"] = opt("sft_grpo", "run resume")
    # weights (and tokenizer) that start the run, before SFT: one of our checkpoints, or a local
    # Hugging Face model directory (config.json + safetensors + tokenizer files)
    init_from: str = opt("", "sft resume_lora", path=True)

    # ---- task and data ----
    # where prompts, targets and rewards come from: chess_fen, countdown, numeric, jsonl (tasks/)
    task: str = opt("chess_fen", "sft resume")
    # the task's own options, validated by the task (`--task_args.max_plies=8` on the command
    # line; `--task_args='{}'` clears a preset's); chess_fen: num_train, min_plies, max_plies,
    # move_format, pgn_path (tasks/). Options set for another task than the final one are
    # dropped with a note.
    task_args: dict = opt({}, "sft resume")
    # JSONL of {"prompt", "target"} rows; replaces the task's own data
    data_path: str = opt("", "sft resume", path=True)
    num_eval: int = opt(512, "sft", "> 0", at_most=MAX_GENERATED)  # held out, never trained on
    # > 0: this many training prompts are set apart as a validation split (never trained on)
    # and every evaluation runs on it instead of the held-out set: for choosing settings
    # without looking at the set a result is reported on (bench/rl_screen.py)
    num_val: int = opt(0, "sft resume", ">= 0", at_most=MAX_GENERATED)
    # [{name: ..., weight: ...}]; None = the task's defaults
    rewards: list | None = opt(None, "rft_data grpo")

    # ---- reward scoring ----
    # serial: in the trainer's thread; thread: a pool of threads (for plugins that wait on
    # I/O); process: worker processes (python-chess holds the GIL, so only processes scale it)
    reward_executor: Literal["serial", "thread", "process"] = opt("process", "run",
                                                                  env="REWARD_EXECUTOR")
    # the pool's threads or processes; each plugin's rows are cut into this many chunks
    num_reward_workers: int = opt(2, "run", "1..1024", env="NUM_WORKERS")
    reward_on_error: float = opt(0.0, "grpo", "[-1e9, 1e9]")  # reward of rows whose plugin failed
    # seconds per plugin call before it counts as failed
    reward_timeout: float = opt(30.0, "grpo", "(0, 86400]")
    # stop the run when more rows of one plugin fail
    reward_max_fail_frac: float = opt(0.5, "run", "[0, 1]")
    # async plugins: rows of `per_sample` ones in flight at once (requests to a verifier)
    reward_concurrency: int = opt(16, "run", "1..4096")

    # ---- model ----
    # our GPT's transformer blocks, for runs from scratch (init_from names its own model)
    n_layer: int = opt(4, "sft resume", "1..1048576")
    n_head: int = opt(4, "sft resume", "1..65536")  # our GPT's attention heads, a divisor of n_embd
    n_embd: int = opt(256, "sft resume", "1..16777216")  # our GPT's width (residual stream)
    # longest prompt + completion, in tokens (+ bos/eos)
    block_size: int = opt(192, "sft resume", "1..16777216")
    # prompts through the tokenizer's chat template as a user message (a Hugging Face
    # tokenizer's; auto = when it has one), after an optional system message
    chat_template: Literal["auto", "on", "off"] = opt("auto", "sft resume")
    # a system message before each prompt; needs the chat template; "" = none
    system_prompt: str = opt("", "sft resume")
    # our GPT's dropout probability in training passes (runs from scratch); 0 = off
    dropout: float = opt(0.0, "sft", "[0, 1)")
    # recompute each block's activations in backward instead of keeping them: less memory
    gradient_checkpointing: bool = opt(False, "run", env="GRADIENT_CHECKPOINTING")
    # sdpa: torch's scaled_dot_product_attention; manual: matmul, softmax, matmul; auto = manual
    # under bf16 autocast on CPU (SDPA's bf16 backward is slower there: docs/history.md), else sdpa
    attn_impl: Literal["auto", "sdpa", "manual"] = opt("auto", "run")

    # ---- LoRA (lora.py; docs/guide.md "LoRA") ----
    # adapters of this rank on init_from's frozen base; 0 = full fine-tuning
    lora_r: int = opt(0, "sft resume", "0..65536", env="LORA_R")
    # the update is scaled by lora_alpha / lora_r
    lora_alpha: float = opt(32.0, "sft resume", "(0, 1e6]")
    lora_dropout: float = opt(0.0, "sft", "[0, 1)")  # dropout on the adapters' input; 0 = off
    # by the last part of a module's name; null = every linear layer of attention and MLP
    lora_target_modules: list | None = opt(None, "sft resume")
    # a PEFT adapter directory to continue from (on init_from's base)
    adapter: str = opt("", "sft resume_lora", path=True)

    # ---- sampling ----
    # most tokens sampled per completion (a FEN after 12 plies is at most ~75 characters)
    max_new_tokens: int = opt(80, "rft_data loss", "1..1048576")
    kv_cache: bool = opt(True, "run")  # false = recompute the whole sequence per token
    # of all sampling (rollouts, RFT's data, sampled evaluation); why 0.7: docs/history.md
    temperature: float = opt(0.7, "rft_data grpo", "(0, 100]")
    top_k: int = opt(0, "rft_data grpo", "0..1048576")  # 0 = off
    top_p: float = opt(1.0, "rft_data grpo", "(0, 1]")  # 1.0 = off

    # ---- rollout engine (mini_grpo/engines; docs/guide.md "Rollouts with vLLM") ----
    # native: our KV-cached sampler; vllm: vLLM (`make setup VLLM=1`, Hugging Face models)
    rollout_engine: Literal["native", "vllm"] = opt("native", "run", env="ROLLOUT_ENGINE")
    # colocate: an in-process engine per rank; server: `mini-grpo vllm-serve` at the url
    vllm_mode: Literal["colocate", "server"] = opt("colocate", "run")
    vllm_server_url: str = opt("http://127.0.0.1:8000", "run")  # server mode: vllm-serve's URL
    vllm_server_timeout: float = opt(600.0, "run", "(0, 86400]")  # one request or weight push
    # auto: bf16 on GPUs
    vllm_dtype: Literal["auto", "float32", "bfloat16", "float16"] = opt("auto", "run")
    # on a GPU: its share for the engine
    vllm_gpu_memory_utilization: float = opt(0.3, "run", "(0, 1]")
    # colocate: consecutive ranks sharing one engine
    vllm_tensor_parallel_size: int = opt(1, "run", "1..1024")
    vllm_sleep: bool = opt(False, "run")  # colocate on GPUs: free its memory between rollouts

    # ---- tools: multi-turn rollouts (tools.py, engines/turns.py; docs/guide.md "Tools") ----
    # functions the model may call (calculator, or package.module:function), listed in every
    # prompt; [] = single-turn
    tools: list = opt([], "sft rft_data resume")
    max_tool_calls: int = opt(4, "rft_data grpo", "1..64")  # rounds of calls answered per row
    tool_timeout: float = opt(10.0, "grpo", "(0, 86400]")  # seconds per call, per env step
    tool_output_chars: int = opt(2000, "rft_data grpo", "1..1048576")  # a result's length cap
    # a class whose instances answer each turn of one row (package.module:Class: envs.py's
    # reset / step); "" = the tool loop of `tools`
    environment: str = opt("", "sft rft_data resume")
    # 0: from the GPU share; on a CPU, one step's rows
    vllm_kv_cache_gib: float = opt(0.0, "run", "[0, 1e6]")
    # importance sampling of vLLM's samples: exp(logp_old - logp_vllm) weights each token's
    # policy-gradient term, truncated to this cap (TRL and verl use about 2); 0 = off
    vllm_is_cap: float = opt(2.0, "loss", "[0, 1e6]")
    # the ratio of each token, or of its whole sequence; past the cap truncated, or masked
    vllm_is_mode: Literal["token_truncate", "token_mask", "sequence_truncate",
                          "sequence_mask"] = opt("token_truncate", "loss")

    # ---- GRPO ----
    max_steps: int = opt(150, "grpo", "1..10000000", env="MAX_STEPS")  # GRPO steps
    # the run's wall-clock limit in minutes (0: none): GRPO takes another step only if, at the
    # pace of its recent steps, the run still ends within it, the final evaluation included
    # (reserved at twice the evaluation before GRPO); the schedule stays max_steps' (trainer.py)
    max_minutes: float = opt(0.0, "grpo", "[0, 1e6]", env="MAX_MINUTES")
    # global batch of prompts; each gets group_size completions
    prompts_per_step: int = opt(16, "grpo", "> 0", at_most=MAX_GENERATED)
    # G completions per prompt (at least 2: advantages compare within a group)
    group_size: int = opt(8, "grpo resume", at_most=MAX_GENERATED)
    # rows per forward/backward, in whole groups (at least one)
    micro_batch_size: int = opt(32, "run", "> 0", at_most=MAX_GENERATED)
    micro_batch_tokens: int = opt(0, "run", "0..1000000000")  # most token positions a pass; 0: off
    num_iterations: int = opt(1, "grpo", "1..1000")  # policy passes per rollout
    # AdamW's peak learning rate (warm-up, then cosine decay to a tenth); why: docs/history.md
    lr: float = opt(3e-5, "grpo", "[0, 1e6]")
    weight_decay: float = opt(0.0, "sft grpo", "[0, 10]")  # AdamW's decoupled decay, matrices only
    # AdamW's eps: a coordinate whose gradient scale is far below it moves far less than lr
    adam_eps: float = opt(1e-8, "sft grpo", "(0, 1]")
    # GRPO's linear warm-up, in steps; SFT stages warm up min(5x this, a tenth of their steps)
    warmup_steps: int = opt(10, "sft grpo", "0..10000000")
    grad_clip: float = opt(1.0, "sft grpo", "[0, 1e6]")  # clips the global grad L2 norm; 0 = off
    beta: float = opt(0.04, "loss", "[0, 1e6]")  # KL weight; 0 skips the reference model
    # beta's KL in each row's reward (the sum of its tokens' kl_estimator, on the sampled
    # tokens) before the advantages, in place of the loss's KL term (verl's use_kl_in_reward)
    kl_in_reward: bool = opt(False, "loss")
    # PPO clip range of the probability ratio: [1 - epsilon_low, 1 + epsilon_high]
    epsilon_low: float = opt(0.2, "loss", "[0, 1]")
    epsilon_high: float = opt(0.28, "loss", "[0, 1e6]")  # DAPO clip-higher
    # advantages = reward - group mean, divided by the group's std (group), the whole batch's
    # std (batch), or nothing (none: Dr. GRPO)
    scale_rewards: Literal["group", "batch", "none"] = opt("group", "grpo")
    # advantages from the rewards (advantages.py; docs/guide.md): grpo (scaled by
    # scale_rewards), dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline, or
    # package.module:function
    advantage_estimator: str = opt("grpo", "grpo")
    # the KL term's per-token estimator of KL(pi || ref): k1, k2, k3 or low_var_kl (k3 clamped)
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = opt("k3", "loss")
    # each token's policy-gradient loss (losses.py; docs/guide.md): grpo (PPO's
    # clip), dual_clip, gspo, cispo, sapo, or package.module:function
    policy_loss: str = opt("grpo", "loss")
    dual_clip_c: float = opt(3.0, "loss", "[1, 1e6]")  # dual_clip: a loss at most c x |A|, A < 0
    sapo_tau_pos: float = opt(1.0, "loss", "(0, 1e6]")  # sapo's gate temperature, A > 0
    sapo_tau_neg: float = opt(1.05, "loss", "(0, 1e6]")  # and A < 0
    # the loss over tokens: grpo = mean per sequence, then over sequences; dapo = sum over
    # all tokens / their number in the global batch; dr_grpo = sum / (rows x max_new_tokens)
    loss_agg: Literal["grpo", "dapo", "dr_grpo"] = opt("dapo", "loss")
    dynamic_sampling: bool = opt(False, "grpo")  # drop groups whose rewards are all equal
    # with dynamic_sampling: draw this many times prompts_per_step prompts a step and keep
    # prompts_per_step groups, those whose rewards differ first (DAPO's refill, in one round)
    dynamic_sampling_factor: int = opt(1, "grpo", "1..64")
    # off-policy sequence masking (DeepSeek-V3.2): a row of negative advantage whose policy is
    # more than this (mean log pi_sampler - log pi) from the sampler's carries no loss; 0 = off
    off_policy_mask: float = opt(0.0, "loss", "[0, 1e6]")
    # policy-gradient loss only on the tokens whose entropy is in this top share of each
    # micro-batch's (Wang et al. 2025: the "forking" tokens; they use 0.2); 1 = every token
    top_entropy_quantile: float = opt(1.0, "loss", "(0, 1]")
    # rows that hit max_new_tokens without EOS carry no loss (DAPO); see overlong_penalty
    mask_truncated: bool = opt(False, "grpo")

    # ---- SFT warm start ----
    # optimizer steps on the task's (prompt, target) rows before GRPO; why: docs/history.md
    sft_steps: int = opt(1200, "sft", "0..10000000")
    sft_batch_size: int = opt(64, "sft", "> 0", at_most=MAX_GENERATED)  # rows per step, all ranks
    sft_lr: float = opt(1e-3, "sft", "[0, 1e6]")  # peak learning rate, scheduled as lr's

    # ---- rejection-sampling fine-tuning (mode: rft) ----
    # completions sampled per prompt
    rft_oversample: int = opt(16, "rft_data", "> 0", at_most=MAX_GENERATED)
    # prompts per generation pass (x rft_oversample rows); GPUs want far more (docs/history.md)
    rft_prompts_per_batch: int = opt(8, "run", "> 0", at_most=MAX_GENERATED)
    rft_min_reward: float = opt(0.9, "rft_data", "[-1e9, 1e9]")  # keep completions at or above
    # per prompt: the best one, or every distinct one
    rft_keep: Literal["best", "all"] = opt("best", "rft_data")
    # distinct training prompts to generate for (0 = the split)
    rft_num_prompts: int = opt(2048, "rft_data", "0..10000000")
    rft_sft_steps: int = opt(300, "rft", "0..10000000")  # SFT steps on the accepted completions
    rft_lr: float = opt(3e-4, "rft", "[0, 1e6]")  # peak learning rate of the SFT on RFT's data

    # ---- evaluation, logging, checkpoints ----
    eval_every: int = opt(50, "run", "1..10000000")  # greedy held-out eval every N GRPO steps
    # completions per held-out prompt in the sampled evaluation; > 1 adds pass@k (k = 1, 2,
    # 4, ... up to it): how often the model's own samples hold a solved answer
    eval_samples: int = opt(1, "run", "1..1024")
    log_every: int = opt(1, "run", "1..10000000")  # metrics every N steps, and at the last
    # metrics.jsonl always; plus any of tensorboard, wandb (pip install -e .[wandb])
    report_to: list = opt(["tensorboard"], "run")
    save_every: int = opt(50, "run", "1..10000000")  # GRPO checkpoint every N steps and at the end
    keep_checkpoints: int = opt(3, "run", "1..10000")  # GRPO checkpoints kept: the newest N
    # the run's end writes <out_dir>/hf/, a Hugging Face directory (transformers, vLLM), in
    # this dtype; auto = the dtype init_from's config.json names, else float32
    export_dtype: Literal["auto", "float32", "bfloat16", "float16"] = opt("auto", "run")

    # ---- parallelism (under torchrun) ----
    # ddp: every rank a full copy of weights, gradients and AdamW state; fsdp: each rank 1/N
    # of them (FSDP2), for models that do not fit one device (mini_grpo/fsdp.py)
    parallelism: Literal["ddp", "fsdp"] = opt("ddp", "run", env="PARALLELISM")
    # fsdp on GPUs: shards, gradients and optimizer step in CPU memory
    fsdp_cpu_offload: bool = opt(False, "run")
    # fsdp: ranks one copy of the model is sharded over (HSDP: shard within a node, replicate
    # across nodes, e.g. 8); 0 = all of them
    fsdp_shard_size: int = opt(0, "run", "0..65536")

    # ---- precision and speed ----
    # torch.autocast around training's forward passes, in amp_dtype
    use_amp: bool = opt(True, "sft", env="USE_AMP")
    # auto = bf16 on CUDA (fp16 without bf16); on a CPU with bf16 units the faster of bf16 and
    # fp32 in a probe at start (dtype_probe.py, cached; CPUs differ: docs/history.md), else fp32
    amp_dtype: Literal["bfloat16", "float16", "auto"] = opt("auto", "sft", env="AMP_DTYPE")
    # autocast while sampling: on = in amp_dtype, off = fp32; auto = follow use_amp, and on a
    # CPU the probe's faster of the two
    generation_amp: Literal["auto", "on", "off"] = opt("auto", "run")
    use_tf32: bool = opt(True, "run", env="USE_TF32")  # TF32 matmuls on Ampere+; no-op elsewhere
    # torch.compile the model's training forward (eager if compiling fails); a cold start of
    # ~30 s, and slower than eager on a CPU (docs/history.md): meant for GPUs
    compile_model: bool = opt(False, "run", env="COMPILE_MODEL")
    # torch.compile's mode, under compile_model
    compile_mode: Literal["default", "reduce-overhead", "max-autotune"] = opt(
        "default", "run", env="COMPILE_MODE")
    # fused AdamW kernel; false = the per-parameter loop
    fused_optimizer: bool = opt(True, "run", env="FUSED_OPTIMIZER")
    # keep the reference model's weights on CPU (under fsdp: instead of sharding them)
    offload_reference: bool = opt(False, "run", env="OFFLOAD_REFERENCE")
    # torch intra-op threads per process; 0 = cores / local ranks
    num_threads: int = opt(0, "run", "0..4096", env="NUM_THREADS")
    # CPU runs (glibc): keep freed blocks below 64 MiB for reuse, not hand them back to the OS,
    # whose page faults slow the policy update (docs/history.md); trimmed as each phase starts
    cpu_malloc_cache: bool = opt(True, "run", env="CPU_MALLOC_CACHE")
    # consecutive non-finite steps before the next fallback: AMP off, lr halved, restore, stop
    guard_patience: int = opt(3, "run", "1..1000")
    # a collective that waits longer than this (a dead or stuck rank) fails the job; the wait
    # for rank 0's evaluations and export is not bounded by it
    dist_timeout: float = opt(600.0, "run", "(0, 604800]")

    def validate(self) -> None:
        """Range checks types cannot express (values are typed and finite: fields.coerce);
        each error opens with the field's name (load_config adds where it was set)."""
        expand_paths(self)  # a path field's leading ~ (opt's path)
        check_ranges(self)  # each field's declared range (opt)
        k = self.dynamic_sampling_factor  # the rows sampled: k times those trained on
        rows = self.prompts_per_step * self.group_size * k
        if rows > MAX_GENERATED:
            raise ConfigError(f"prompts_per_step: {self.prompts_per_step:,} prompts x group_size "
                              f"{self.group_size:,}" + (f" x dynamic_sampling_factor {k}"
                                                        if k > 1 else "")
                              + f" = {rows:,} rows per step, more than {MAX_GENERATED:,}")
        if k > 1 and not self.dynamic_sampling:
            raise ConfigError(f"dynamic_sampling_factor: {k} draws more prompts to keep the "
                              f"groups with signal; it needs dynamic_sampling: true")
        if self.group_size < 2:
            raise ConfigError(f"group_size: must be >= 2 (advantages compare within a group), "
                              f"got {self.group_size}")
        if not self.vllm_server_url.startswith(("http://", "https://")):
            raise ConfigError(f"vllm_server_url: must be an http:// or https:// URL, got "
                              f"{self.vllm_server_url!r}")
        try:
            from urllib.parse import urlsplit
            url = urlsplit(self.vllm_server_url)
            if not url.hostname:
                raise ValueError("no host")
            url.port  # noqa: B018 (a port out of range raises here)
        except ValueError as e:
            raise ConfigError(f"vllm_server_url: {self.vllm_server_url!r} is not a valid URL "
                              f"({e})") from None
        if self.rollout_engine == "vllm" and not self.init_from:
            raise ConfigError("rollout_engine: vllm serves Hugging Face models: set init_from "
                              "to a model directory (a run from scratch trains our "
                              "character-level GPT, whose tokenizer vLLM cannot load)")
        if (self.lora_r or self.adapter) and not self.init_from:
            raise ConfigError(f"{'lora_r' if self.lora_r else 'adapter'}: LoRA adapts a "
                              f"pretrained model: set init_from to a Hugging Face directory "
                              f"or one of our checkpoints")
        if self.lora_target_modules is not None and not (
                self.lora_target_modules and
                all(isinstance(t, str) and t for t in self.lora_target_modules)):
            raise ConfigError(f"lora_target_modules: must be a non-empty list of module "
                              f"names, got {show(self.lora_target_modules)}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd: must be divisible by n_head ({self.n_head}), "
                              f"got {self.n_embd}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device: must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.resume not in ("auto", "never") and not self.resume:
            raise ConfigError("resume: must be auto, never or a checkpoint path")
        if self.rewards is not None:
            _check_rewards(self.rewards)
        if not all(isinstance(t, str) and t for t in self.tools):
            raise ConfigError(f"tools: must be a list of tool names, got {show(self.tools)}")
        if self.kl_in_reward and not self.beta:
            raise ConfigError("kl_in_reward: puts beta's KL in the reward; with beta 0 there is "
                              "none (set beta > 0)")
        check_named("advantage_estimator", self.advantage_estimator, ADVANTAGES, "estimator")
        check_named("policy_loss", self.policy_loss, POLICY_LOSSES, "loss")
        if self.tools and self.environment:
            raise ConfigError("environment: runs in place of the tool loop; an environment "
                              "that uses tools calls them itself (set tools: [])")
        if any(t not in TRACKERS for t in self.report_to):
            raise ConfigError(f"report_to: must list only {', '.join(TRACKERS)}, got "
                              f"{show(self.report_to)}")
        self.task_args = resolve_task_args(self.task, self.task_args)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | os.PathLike) -> None:
        from .outputs import write_file

        write_file(path, yaml.safe_dump(self.to_dict(), sort_keys=False))


# environment variables: the fields' env= (docs/guide.md's table is config_help.env_table's)
LEGACY_ENV = {"PARALLEL_REWARDS": "parallel_rewards"}  # false = reward_executor serial
ENV_VARS: dict[str, str] = {**env_vars(GRPOConfig), **LEGACY_ENV}

FIELDS = {f.name: f for f in dataclasses.fields(GRPOConfig)}
TYPES = typing.get_type_hints(GRPOConfig)


def _check_rewards(rewards: Any) -> None:
    if not isinstance(rewards, list) or not rewards:
        raise ConfigError("rewards: must be a non-empty list of {name: ..., weight: ...}")
    for i, r in enumerate(rewards):
        if not isinstance(r, dict) or not isinstance(r.get("name"), str) or not r["name"]:
            raise ConfigError(f"rewards[{i}]: must be a mapping with a 'name' string, "
                              f"got {show(r)}")
        extra = set(r) - {"name", "weight"}
        if extra:
            raise ConfigError(f"rewards[{i}]: unknown key {sorted(extra)[0]!r} "
                              f"(allowed: name, weight)")
        w = r.get("weight", 1.0)
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ConfigError(f"rewards[{i}].weight: must be a finite number, got {show(w)}")


def from_environment(cfg: GRPOConfig, env=None) -> list[str]:
    """"VAR='value' (field)" for each environment variable whose value `cfg` holds: some have
    names other tools use too (SEED, OUT_DIR, NUM_WORKERS), and a shell's would set a run's
    fields unseen. (A command-line value equal to the variable's is counted too.)"""
    env = os.environ if env is None else env
    out = []
    for var, key in ENV_VARS.items():
        if var in env:
            try:
                held = coerce(key, env[var], TYPES[key]) == getattr(cfg, key)
            except ConfigError:
                held = False
            if held:
                out.append(f"{var}={env[var]!r} ({key})")
    return out


def load_config(config: str | None = None, overrides: dict[str, Any] | None = None,
                env: dict[str, str] | None = None, base: dict[str, Any] | None = None,
                base_where: str = "") -> GRPOConfig:
    """Builds the config from defaults < `base` (a checkpoint's stored config, checked like
    any other layer) < YAML < environment < overrides, then validates it."""
    layers, rows, notes = Layers(FIELDS, TYPES), None, []
    for key, value in (base or {}).items():
        if key in LEGACY_TASK_ARGS:  # saved before task_args existed
            key = f"task_args.{key}"
        layers.set(str(key), value, f"{base_where}config key ")
    layers.end_layer(base_where.rstrip(": ") or "the stored config")
    if config:
        path = resolve_config_path(config)
        rows = read_yaml_mapping(path)
        for key, (value, line) in rows.items():
            layers.set(key, value, f"{path}:{line}: ")
        layers.end_layer(str(path))
        if not rows:
            notes.append(f"{path} sets nothing: every key takes its default")
    env = os.environ if env is None else env
    for var, key in ENV_VARS.items():
        if var in env:
            layers.set(key, env[var], f"environment variable {var}: ")
    layers.end_layer("the environment")
    for key, value in (overrides or {}).items():
        layers.set(key, value, "command line: --", replace=True)
    layers.end_layer("the command line")
    task_args, task_args_from, dropped = layers.task_args()
    cfg = GRPOConfig(**{**layers.values, "task_args": task_args})
    try:
        cfg.validate()
    except ConfigError as e:  # its message opens with the field: say where that was set
        where = {**layers.where, **{f"task_args.{k}": v for k, v in task_args_from.items()}}
        # a key may hold a ':'; "rewards[0].weight: ..." is the rewards key's
        fields = [k for k in where if str(e).startswith((f"{k}:", f"{k}["))]
        if fields:
            raise ConfigError(where[max(fields, key=len)] + str(e)) from None
        raise
    for note in notes + dropped:
        print(f"[mini-grpo] note: {note}", file=sys.stderr)
    return cfg


__all__ = ["GRPOConfig", "ConfigError", "ENV_VARS", "load_config", "parse_cli",
           "resolve_config_path"]
