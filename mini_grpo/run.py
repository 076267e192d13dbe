"""setup(cfg) -> Run: everything a job needs, built once in this order and torn down in one place.

    with setup(cfg) as run:            # train (job.py), benchmark.py
        train_grpo(run)
    with setup(cfg, checkpoint=state, log=False) as run:   # mini-grpo evaluate / rft-generate
        run.sync_engine()
        evaluate(run, greedy=True)
    with run.rank0_with_weights() as main:         # the job's evaluations: rank 0 samples
        if main:
            evaluate(run, greedy=True)

Order: distributed init -> checks that need the world size -> the run directory, claimed and
locked by rank 0 with every output the run will write there checked (a training run) ->
device, threads, allocator ->
task (its data) -> reward scorer (bad plugin names fail here, before any model is built) ->
policy and tokenizer (policy.build_policy: a given checkpoint's, else `init_from`'s, else our
GPT from the config's fields, randomly initialised from the seed, identical on every rank,
with the task's alphabet; shapes checked before anything is allocated) -> length check ->
precision (with its probe for `auto`) -> the trained form (sharded under fsdp, compiled, DDP
under torchrun) -> logger (rank 0 of a training run) -> the engine every sampler goes
through (`Run.sampler`; it serves the weights of its last `Run.sync_engine`, which sends
them only where they changed).
The reference policy is frozen later, when GRPO starts from whatever SFT left
(`Run.freeze_reference`). `close()` undoes it all in reverse.
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from . import distributed as D
from . import faults, fsdp
from .advantages import resolve_advantage
from .checkpoint import discard_checkpoints
from .config import ConfigError, GRPOConfig
from .dtype_probe import probe_dtypes
from .engines import Engine, check_engine, make_engine
from .engines.native import NativeEngine
from .engines.turns import ToolSetup
from .limits import check_lengths, check_sft_lengths, check_step_memory, check_world
from .logger import RunLogger
from .lora import ADAPTER_FILES, LoRAFacts, is_lora, store_base_in
from .losses import resolve_policy_loss
from .models import CausalLM, build, spec
from .models.hf import WRITTEN
from .outputs import check_in_place, check_replaceable, claim_run_dir
from .policy import build_policy, lora_facts, weights_from_rank0
from .precision import (
    Precision,
    attention_impl,
    compile_with_fallback,
    resolve_device,
    resolve_precision,
    setup_backends,
)
from .progress import EVERY, Phases
from .reference import AdaptersOff, Reference
from .scoring import RewardScorer
from .tasks import TaskData, build_task
from .tokenizer import CharTokenizer, Tokenizer


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
    lora: LoRAFacts | None = None  # the policy's adapters and their base (LoRA runs)
    tools: ToolSetup | None = None  # the config's tools or environment, resolved once
    claim: int | None = None  # rank 0 of a training run: its locked claim on out_dir

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
            return NativeEngine(self.model, self.tok, self.cfg.kv_cache, self.tools)
        return self.engine

    def sync_engine(self) -> None:
        """The engine takes the policy's current weights (on every rank: a collective where
        the engine keeps a copy; nothing to do for the native one, or where they have not
        changed since its last sync). Outside full_params."""
        self.engine.sync(self.model)

    @contextmanager
    def rank0_with_weights(self):
        """For work rank 0 does with the current policy (the job's evaluations, before and
        after GRPO and in it, the export): the engine syncs, every rank gathers the full
        weights (fsdp), and the body runs with True on rank 0 (False elsewhere). At its end
        the others wait for rank 0 however long its work takes (D.wait_for_main), not
        dist_timeout."""
        self.sync_engine()
        with fsdp.full_params(self.model):
            if self.dist.is_main:
                faults.rank0_alone(self.dist)
            yield self.dist.is_main
        D.wait_for_main()

    @property
    def sharded(self) -> bool:
        return self.cfg.parallelism == "fsdp" and self.dist.world_size > 1

    def identity(self) -> dict:
        """What every checkpoint carries besides weights: the config, the tokenizer, the
        model's architecture (models.spec) and, under LoRA, its adapters' options and their
        base's fingerprint (checkpoint.check_base)."""
        return {"config": self.cfg.to_dict(), "tokenizer": self.tok.state(),
                "model_spec": spec(self.model),
                "lora": self.lora.options() if self.lora else None,
                "base": self.lora.base if self.lora else None}

    def print0(self, message: str) -> None:
        self.dist.print0(message)

    def close(self, failed: bool = False) -> None:
        if self.engine is not None:
            self.engine.close()
        if self.scorer is not None:
            self.scorer.close()
        if self.logger is not None:
            self.logger.close()
        if self.claim is not None:
            os.close(self.claim)  # the lock goes with it
            self.claim = None
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
    # the device first: it picks the process group's backend (device: cpu on a GPU node
    # meets on gloo), and a rank without a GPU of its own is a one-line error, not CUDA's
    device = resolve_device(cfg, int(os.environ.get("LOCAL_RANK", 0)))
    dist = D.init(cfg.dist_timeout, use_cuda=device.type == "cuda")
    scorer = claim = None
    phases = Phases(dist.print0, "[mini-grpo] set-up")  # a line every 10 s, then its phases
    try:
        check_world(cfg, dist, device)
        claim = claim_out_dir(cfg, dist) if log else None
        check_engine(cfg, device)
        threads = setup_backends(cfg, dist.local_world_size)
        phases.begin("the task and its rewards")
        data = task if isinstance(task, TaskData) else build_task(cfg) if task else None
        if data is not None:
            scorer = RewardScorer.from_config(cfg, data)
        if train and "grpo" in cfg.mode:  # a user's own is imported now, before any work
            resolve_advantage(cfg.advantage_estimator)
            resolve_policy_loss(cfg.policy_loss)
        sharded = cfg.parallelism == "fsdp" and dist.world_size > 1
        # under fsdp, a pretrained model or a random init is read (drawn) by rank 0 alone and
        # sent to the others' shards, which start on the meta device: a node holds one copy
        # (on a CPU device every rank builds its own: the precision probe runs on each)
        from_rank0 = sharded and weights_from_rank0(cfg, checkpoint)
        tools = ToolSetup.of(cfg)  # the tools or environment, imported and checked once
        phases.begin("the model")
        model, tok = build_policy(cfg, data, checkpoint, meta=from_rank0 and not dist.is_main
                                  and device.type != "cpu",
                                  schemas=tools.schemas if tools is not None else ())
        lora = lora_facts(model, cfg)
        if not sharded:  # under fsdp each block goes to the device as it is sharded, so the
            model.to(device)  # device never holds the whole model
        phases.begin("the prompts' lengths")
        longest = check_lengths(cfg, tok, [ex.model_input for ex in data.train + data.eval]) \
            if data is not None else 0
        if train and data is not None:
            check_sft_lengths(cfg, tok, data.train)
            check_step_memory(cfg, model.cfg, dist.world_size,
                              min(longest + cfg.max_new_tokens, model.cfg.block_size))
        phases.begin("the precision probe")
        precision = resolve_precision(cfg, device, lambda parts: probe_dtypes(model, cfg, parts),
                                      train)
        model.attn_impl = attention_impl(cfg.attn_impl, device, precision.dtype)
        if is_lora(model) and precision.dtype in (torch.bfloat16, torch.float16):
            store_base_in(model, precision.dtype)  # half the frozen base's bytes, same results
        phases.begin("sharding and compiling" if sharded or cfg.compile_model else "wrapping")
        # in place, before compiling: dynamo then compiles between FSDP's hooks
        comm = _shard(model, cfg, device, precision, dist, from_rank0) if sharded else None
        trained = compile_with_fallback(model, cfg.compile_mode) if cfg.compile_model else model
        # DDP-wrapped under torchrun, as it is in a single process (then comm is None)
        net, comm = (trained, comm) if sharded else D.wrap_ddp(trained, device)
        logger = open_run_dir(cfg, tok) if log and dist.is_main else None
    except BaseException:
        phases.end()
        if scorer is not None:
            scorer.close()
        if claim is not None:
            os.close(claim)
        D.cleanup(wait=False)
        raise
    run = Run(cfg, dist, device, threads, precision, data, tok, model, net, comm, scorer, logger,
              lora=lora, claim=claim, tools=tools)
    try:  # before any work: a model the engine cannot serve is refused here
        phases.begin("the rollout engine")
        run.engine = make_engine(cfg, model, tok, device, dist, min(
            longest + cfg.max_new_tokens, model.cfg.block_size) if longest else None, tools)
    except BaseException:
        phases.end()
        run.close(failed=True)
        raise
    _report(run, log, phases)
    return run


def _shard(model, cfg, device, precision, dist, from_rank0: bool) -> D.CommTimer:
    """fsdp: `model` sharded in place over the ranks (from rank 0's weights where it alone
    read them) -> the timer of its collectives."""
    full = model.state_dict() if from_rank0 and dist.is_main else {}
    comm = D.CommTimer()
    fsdp.shard(model, device, _fsdp_dtype(precision), cfg.fsdp_cpu_offload,
               cfg.fsdp_shard_size, comm)
    if from_rank0:
        fsdp.load_from_rank0(model, full, device, cfg.fsdp_cpu_offload)
    return comm


def _report(run: Run, log: bool, phases: Phases) -> None:
    """The set-up's lines: how long it took (where that was 10 s or more: its phases), the
    task, model, processes and precision (rank 0), and for a training run what each rank
    holds."""
    phases.end()
    if sum(phases.seconds.values()) >= EVERY:
        phases.report()
    cfg, dist, data, model, device = run.cfg, run.dist, run.task, run.model, run.device
    threads, precision, logger = run.threads, run.precision, run.logger
    if data is not None:
        procs = f"{dist.world_size} process{'es' if dist.world_size > 1 else ''}"
        run.print0(f"[mini-grpo] task {data.name}: {len(data.train)} train / {len(data.eval)} "
                   f"{data.eval_split} prompts; model {model.num_params() / 1e6:.2f}M params; "
                   f"{procs} on {device}, {threads} threads; {precision.describe()}"
                   + (f"; run directory {cfg.out_dir}" if logger else ""))
    if data is not None and log:  # a training run: what each rank holds, as the table
        mem = {k: v / 2**20 for k, v in fsdp.memory_report(model).items()}
        how = f"{cfg.parallelism} over {dist.world_size}" if dist.enabled else "one process"
        frozen = f" (+ {mem['frozen']:.1f} MiB frozen: LoRA's base)" if mem["frozen"] else ""
        print(f"[mini-grpo] rank {dist.rank} holds ({how}): parameters {mem['params']:.1f} MiB"
              f"{frozen}, gradients {mem['grads']:.1f} MiB, AdamW state "
              f"{mem['optimizer']:.1f} MiB", flush=True)


def _fsdp_dtype(precision: Precision) -> torch.dtype | None:
    """bf16 parameters under fsdp when training runs in bf16 (gradients reduced in fp32)."""
    return torch.bfloat16 if precision.dtype == torch.bfloat16 else None


# what a run writes into out_dir: plain files, and directories (hf/ and adapter/ are exports)
RUN_FILES = ("config.yaml", "metrics.jsonl", "eval.json", "reward.png", "tokenizer.json")
RUN_DIRS = ("checkpoints", "tb", "sft", "rft", "wandb")
_EVENTS = re.compile(r"events\.out\.tfevents\..*")  # TensorBoard's files
# what a run writes in place (appends, a lock), so never under a hard link: metrics.jsonl and
# RFT's shards and lock in rft/; everything else it replaces whole (temporary file, rename)
_RFT_IN_PLACE = re.compile(r".*\.(rank\d+(\.done)?|rft\.lock)")


def claim_out_dir(cfg: GRPOConfig, dist: D.DistInfo) -> int | None:
    """Rank 0 takes out_dir for this run (outputs.claim_run_dir: new, empty or a run's, and
    locked) and checks every output the run writes there (one it writes in place: no link),
    so that nothing is refused after the work (`resume: never` clears the run before's
    checkpoints and logs later, once the run is set up: job.train). Every rank
    raises rank 0's refusal. Returns rank 0's locked claim (None on the others)."""
    claim = why = None
    if dist.is_main:
        try:
            claim = claim_run_dir(cfg.out_dir)
            out = Path(cfg.out_dir)
            for name in RUN_FILES + RUN_DIRS:
                p = out / name
                if (p.exists() or p.is_symlink()) and (p.is_symlink() or (
                        name in RUN_DIRS) != p.is_dir()):
                    raise ConfigError(f"out_dir {cfg.out_dir}: {name} is not the "
                                      f"{'directory' if name in RUN_DIRS else 'file'} a run "
                                      f"writes there; not overwritten (move it away)")
            for name, owned in (("hf", WRITTEN), ("adapter", ADAPTER_FILES)):
                check_replaceable(out / name, owned)
            for p in [out / "metrics.jsonl", *(out / "rft").glob("*")]:
                if p.name == "metrics.jsonl" or _RFT_IN_PLACE.fullmatch(p.name):
                    check_in_place(p)
        except ConfigError as e:
            if claim is not None:
                os.close(claim)
            claim, why = None, str(e)
    why = D.all_gather_object(why)[0]
    if why is not None:
        raise ConfigError(why)
    return claim


def start_afresh(out: Path, keep: Path | None = None) -> None:
    """`resume: never` in a run directory, once the run is set up (a refused config must not
    have cost the run before its files): that run's checkpoints (ours alone) and TensorBoard
    events (but `keep`, this run's) go, so that neither this run's logs nor a later resume
    mix the two runs; its metrics.jsonl is cut by the job (job.logged_until), and a finished
    SFT or RFT stage stays (it is reused only where its options and inputs match)."""
    discard_checkpoints(out / "checkpoints")
    if (out / "tb").is_dir() and keep is not None:  # unknown: this run's might go too
        for f in (out / "tb").iterdir():
            if _EVENTS.fullmatch(f.name) and f.is_file() and f != keep:
                f.unlink()


def open_run_dir(cfg: GRPOConfig, tok: Tokenizer) -> RunLogger:
    """Saves a character tokenizer's alphabet (tokenizer.json) into out_dir (claimed by
    claim_out_dir) and opens the logger. The resolved config is saved by the job once it knows
    the run may go on (a refused resume must not overwrite the config.yaml of the run it
    refused)."""
    out = Path(cfg.out_dir)
    if isinstance(tok, CharTokenizer):
        tok.save(out / "tokenizer.json")
    return RunLogger(out, cfg.max_steps, cfg.report_to, cfg.to_dict())
