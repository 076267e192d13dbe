"""vLLM as the rollout engine (`rollout_engine: vllm`, `vllm_mode: colocate`), and the pieces
the server mode shares (server.py, client.py).

Each rank runs its own in-process vLLM engine (the engine core in this process:
VLLM_ENABLE_V1_MULTIPROCESSING=0) on its own device, for its own share of the prompts.
Under torchrun the engines are built with vLLM's `external_launcher` executor, as TRL's
colocate mode does, so each takes its rank's device (LOCAL_RANK). With
`vllm_tensor_parallel_size` N, N consecutive ranks form one engine: they gather their
prompts, all submit the same requests (same seeds), and each keeps its own rows.

Start-up never reads weights from disk: the engine is built from a directory holding only
config.json (our model's, in the engine's dtype, its LM head untied: `engine_config`) with
`load_format="dummy"`, and then gets every weight from the policy in memory (`sync`, which
the trainer calls before the first rollout and whenever an update or a restore changed the
weights). A sync sends each weight once, in
Hugging Face's names and the engine's dtype, through vLLM's `reload_weights`; under fsdp
each is all-gathered as it is sent (fsdp.full_tensors), so no rank holds a full copy of
the model besides the engine's own. The prefix cache is then cleared: prompt keys and values
computed with the old weights must not serve the new ones.

Sampling: one vLLM request per row with its own seed (drawn from the trainer's generator,
so a run is reproducible), `stop_token_ids` = every EOS id of the tokenizer, token ids in
and out (vLLM loads no tokenizer; our tokenizer encodes and decodes, as for the native
engine). Log-probs are `processed_logprobs`: those of the distribution vLLM sampled from.

A model vLLM cannot serve (our character-level GPT, a head size its CPU attention refuses)
is a ConfigError at start: the engine is built and asked for one token in `__init__`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .. import distributed as D
from .. import fsdp
from ..fields import ConfigError
from ..lora import merged
from ..models.hf import hf_tensors
from .base import Rollout, WeightsSeen
from .protocol import (
    check_servable,
    complete,
    engine_config,
    row_seeds,
    sampling_options,
    to_rollout,
    turns_rollout,
)
from .turns import ToolSetup

MIN_KV_BYTES = 64 << 20


def import_vllm():
    """The vllm module, with the engine core in this process; a ConfigError without it."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # vLLM's own log at ERROR unless asked (its INFO lines run to pages; with no tokenizer
    # loaded it also warns, with a traceback, that its chat-template warm-up failed)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        import vllm
    except Exception as e:  # ImportError, or a broken install (torchvision's, say)
        raise ConfigError(f"rollout_engine: vllm needs the vllm package (`make setup VLLM=1`"
                          f"; see README), and importing it failed: "
                          f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return vllm


def engine_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on a GPU that has it, else float32."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def kv_cache_bytes(model, rows: int, max_len: int, dtype: torch.dtype) -> int:
    """KV-cache bytes for `rows` sequences of `max_len` tokens, with a quarter to spare
    (vLLM allocates in blocks of 16 tokens)."""
    c = model.cfg
    kv_heads = getattr(c, "n_kv_head", c.n_head)
    head_dim = getattr(c, "head_dim", None) or c.n_embd // c.n_head
    per_token = 2 * c.n_layer * kv_heads * head_dim * dtype.itemsize
    return max(MIN_KV_BYTES, int(rows * (max_len + 16) * per_token * 1.25))


def build_llm(vllm, model_dir: str, dtype: torch.dtype, device: torch.device, seed: int,
              max_len: int | None, load_format: str = "dummy", kv_bytes: int = 0,
              gpu_memory_utilization: float = 0.9, external_launcher: bool = False,
              sleep: bool = False, tensor_parallel_size: int = 1):
    """vllm.LLM for `model_dir` (token ids in and out: no tokenizer loaded), asked for one
    token before it is returned, so that a model vLLM cannot run fails here."""
    kw = {"kv_cache_memory_bytes": kv_bytes} if kv_bytes else {}
    if external_launcher:
        kw["distributed_executor_backend"] = "external_launcher"
    if sleep:
        kw["enable_sleep_mode"] = True
    if device.type == "cpu":
        # a prompt prefilled in chunks has its first sampled token discarded, and vLLM 0.32
        # rewinds its seeded generator for that, which CPU generators cannot do ("CPU
        # Generator does not use offset"): larger batches (RFT's 128 rows) crashed. Whole
        # prefills instead, with a step budget that holds the longest sequence
        kw["enable_chunked_prefill"] = False
        kw["max_num_batched_tokens"] = max(max_len or 0, 8192)
    llm = vllm.LLM(model=str(model_dir), skip_tokenizer_init=True, load_format=load_format,
                   dtype=str(dtype).removeprefix("torch."), seed=seed, max_model_len=max_len,
                   logprobs_mode="processed_logprobs", enable_prefix_caching=True,
                   enforce_eager=device.type == "cpu",
                   gpu_memory_utilization=gpu_memory_utilization,
                   tensor_parallel_size=tensor_parallel_size, **kw)
    try:
        llm.generate([{"prompt_token_ids": [0]}],
                     vllm.SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
    except BaseException:
        shutdown(llm)
        raise
    return llm


def reload(llm, weights) -> None:
    """Every weight from `weights` ((Hugging Face name, tensor), consumed one at a time) into
    the engine, in place; then the prefix cache is cleared, since prompt keys and values
    computed with the old weights must not serve the new ones."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights,
                                                 "is_checkpoint_format": True})
    llm.reset_prefix_cache()


def shutdown(llm) -> None:
    """Shuts an engine down now, not at exit: its teardown destroys the default process group
    (vLLM's, or under torchrun ours), which must happen before distributed.cleanup looks at
    it (Run.close closes the engine first)."""
    llm.llm_engine.engine_core.shutdown()


class VLLMEngine:
    name = "vllm"

    def __init__(self, cfg, model, tok, device: torch.device, dist, max_len: int | None = None,
                 tools: ToolSetup | None = None):
        """`dist`: the run's distributed.DistInfo (rank, world size); `tools`: multi-turn
        rollouts (turns.py), in rounds of requests (protocol.complete_turns)."""
        tp, world = cfg.vllm_tensor_parallel_size, dist.world_size
        if world % tp:
            raise ConfigError(f"vllm_tensor_parallel_size: {tp} does not divide the {world} "
                              f"processes")
        self.tools = tools
        check_servable(tok)
        vllm = import_vllm()
        self.tok, self.device, self.llm, self.weights = tok, device, None, WeightsSeen()
        self.sleep, self.asleep = cfg.vllm_sleep, False
        # the ranks of one engine: they sample all their prompts together, each keeps its own
        self.group = D.consecutive_groups(tp)
        self.alone = self.group is None  # tensor parallel: the group generates together
        self.dtype = engine_dtype(cfg.vllm_dtype, device)
        self.SamplingParams = vllm.SamplingParams
        max_len = max_len or model.cfg.block_size
        rows = -(-cfg.prompts_per_step // world) * cfg.group_size * tp
        kv = int(cfg.vllm_kv_cache_gib * 2**30) if cfg.vllm_kv_cache_gib else \
            kv_cache_bytes(model, rows, max_len, self.dtype) if device.type == "cpu" else 0
        self.dir = Path(tempfile.mkdtemp(prefix="mini_grpo_vllm_"))
        (self.dir / "config.json").write_text(json.dumps(engine_config(model, self.dtype)))
        self.shm = tp > 1 and device.type == "cpu"
        if self.shm:
            _remove_cpu_shm()
            D.barrier()  # no rank creates its segment before every rank removed the old ones
        try:
            self.llm = build_llm(vllm, self.dir, self.dtype, device,
                                 cfg.seed + dist.rank // tp, max_len, kv_bytes=kv,
                                 gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                                 external_launcher=world > 1, sleep=self.sleep,
                                 tensor_parallel_size=tp)
        except Exception as e:
            self.close()
            raise ConfigError(f"rollout_engine: vllm cannot serve this model "
                              f"({model.family}, head size {_head_dim(model)}): "
                              f"{_summary(e)}") from None

    def generate(self, prompts: list, sampling, generator=None, autocast=None) -> Rollout:
        if self.tools is not None:
            return self._generate_turns(prompts, sampling, generator)
        enc = [self.tok.encode_prompt(p) for p in prompts]
        mine = (enc, row_seeds(len(enc), generator))
        shares, me = [mine], 0
        if self.group is not None:
            shares, me = D.all_gather_object(mine, self.group), D.group_rank(self.group)
        start = sum(len(share[0]) for share in shares[:me])
        self._wake()
        toks, lps = complete(self.llm, self.SamplingParams,
                             [ids for share in shares for ids in share[0]],
                             sampling_options(sampling, self.tok.eos_ids),
                             [s for share in shares for s in share[1]])
        toks, lps = toks[start:start + len(enc)], lps[start:start + len(enc)]
        self._sleep()
        return to_rollout(self.tok, enc, toks, lps, self.device, sampling)

    def _generate_turns(self, prompts: list, sampling, generator) -> Rollout:
        """Multi-turn rollouts of this rank's rows alone (the tool loop runs where its rows
        are; tensor parallelism is refused with tools: check_engine)."""
        options = sampling_options(sampling, self.tok.eos_ids)
        self._wake()
        r = turns_rollout(lambda prefixes, budgets, seeds: complete(
            self.llm, self.SamplingParams, prefixes, options, seeds, budgets),
            self.tools, self.tok, prompts, sampling, generator, self.device)
        self._sleep()
        return r

    def _sleep(self) -> None:
        if self.sleep:  # level 1: weights to CPU memory, KV cache freed, until the next wake
            self.llm.sleep(level=1)
            self.asleep = True

    def sync(self, model) -> None:
        if not self.weights.changed_anywhere(model, self.device):
            return
        self._wake()  # the rollout follows at once: it stays awake
        weights = merged(model, fsdp.full_tensors(model))  # LoRA: folded in, as exported
        reload(self.llm, hf_tensors(model, weights, self.dtype, head=True))
        self.weights.mark(model)

    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            shutdown(llm)
        if getattr(self, "shm", False):
            _remove_cpu_shm()
        shutil.rmtree(self.dir, ignore_errors=True)


def _remove_cpu_shm() -> None:
    """vLLM 0.32's CPU tensor parallelism under torchrun (external_launcher) names its shared
    memory from an empty identifier ("/dev/shm/-tp:0-[0-1]-cpushm_0"), the same in every
    run, and leaves the segments behind on exit, so the next run's engine fails to create
    them (errno 17): they are removed before the engine starts and after it stops."""
    for path in Path("/dev/shm").glob("-*-cpushm_*"):
        path.unlink(missing_ok=True)


def _head_dim(model) -> int:
    c = model.cfg
    return getattr(c, "head_dim", None) or c.n_embd // c.n_head


def _summary(e: BaseException) -> str:
    """The last line of an error's message (vLLM's say what failed there)."""
    lines = [s for s in str(e).splitlines() if s.strip()]
    return lines[-1].strip() if lines else type(e).__name__

