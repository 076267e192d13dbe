"""vLLM as the rollout engine (`rollout_engine: vllm`, `vllm_mode: colocate`).

Each rank runs its own in-process vLLM engine (the engine core in this process:
VLLM_ENABLE_V1_MULTIPROCESSING=0) on its own device, for its own share of the prompts.
Under torchrun the engines are built with vLLM's `external_launcher` executor, as TRL's
colocate mode does, so each takes its rank's device (LOCAL_RANK) and joins no other.

Start-up never reads weights from disk: the engine is built from a directory holding only
config.json (our model's, in the engine's dtype, its LM head untied: see __init__) with
`load_format="dummy"`, and then gets
every weight from the policy in memory (`sync`, which the trainer calls before the first
rollout and after every update that went through). A sync sends each weight once, in
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

from .. import fsdp
from ..fields import ConfigError
from ..models.hf import export_config, hf_tensors
from ..rollout import Rollout, pad_left
from ..tokenizer import HFTokenizer

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


class VLLMEngine:
    name = "vllm"

    def __init__(self, run, max_len: int | None = None):
        cfg, model, tok = run.cfg, run.model, run.tok
        if not isinstance(tok, HFTokenizer):
            raise ConfigError("rollout_engine: vllm serves Hugging Face models: set init_from "
                              "to a model directory (this run's policy is our character-level "
                              "GPT, whose tokenizer vLLM cannot load)")
        vllm = import_vllm()
        self.tok, self.device = tok, run.device
        self.dtype = engine_dtype(cfg.vllm_dtype, run.device)
        self.SamplingParams = vllm.SamplingParams
        max_len = max_len or model.cfg.block_size
        rows = -(-cfg.prompts_per_step // run.dist.world_size) * cfg.group_size
        self.dir = Path(tempfile.mkdtemp(prefix="mini_grpo_vllm_"))
        # untied: vLLM 0.32's in-place reload leaves a tied head on its old weights, so the
        # engine holds the head as a weight of its own, sent like any other
        config = {**export_config(model, self.dtype), "tie_word_embeddings": False}
        (self.dir / "config.json").write_text(json.dumps(config))
        kw = {}
        if cfg.vllm_kv_cache_gib:
            kw["kv_cache_memory_bytes"] = int(cfg.vllm_kv_cache_gib * 2**30)
        elif run.device.type == "cpu":  # on a CPU, gpu_memory_utilization is a share of RAM
            kw["kv_cache_memory_bytes"] = kv_cache_bytes(model, rows, max_len, self.dtype)
        if run.dist.world_size > 1:
            kw["distributed_executor_backend"] = "external_launcher"
        try:
            self.llm = vllm.LLM(
                model=str(self.dir), skip_tokenizer_init=True, load_format="dummy",
                dtype=str(self.dtype).removeprefix("torch."), seed=cfg.seed + run.dist.rank,
                max_model_len=max_len, logprobs_mode="processed_logprobs",
                enable_prefix_caching=True, enforce_eager=run.device.type == "cpu",
                gpu_memory_utilization=cfg.vllm_gpu_memory_utilization, **kw)
            self.llm.generate([{"prompt_token_ids": [tok.eos_id]}],
                              self.SamplingParams(max_tokens=1, detokenize=False),
                              use_tqdm=False)
        except Exception as e:
            self.close()
            raise ConfigError(f"rollout_engine: vllm cannot serve this model "
                              f"({model.family}, head size {_head_dim(model)}): "
                              f"{_summary(e)}") from None

    def generate(self, prompts: list, sampling, generator=None, autocast=None) -> Rollout:
        enc = [self.tok.encode_prompt(p) for p in prompts]
        seeds = torch.randint(2**31 - 1, (len(enc),), generator=generator,
                              device=generator.device if generator is not None else "cpu")
        params = [self.SamplingParams(
            temperature=0.0 if sampling.greedy else sampling.temperature,
            top_k=sampling.top_k or -1, top_p=sampling.top_p,
            max_tokens=sampling.max_new_tokens, stop_token_ids=list(self.tok.eos_ids),
            logprobs=0, detokenize=False, seed=int(s)) for s in seeds.tolist()]
        outs = self.llm.generate([{"prompt_token_ids": ids} for ids in enc], params,
                                 use_tqdm=False)
        return self._rollout(enc, [o.outputs[0] for o in outs])

    def _rollout(self, enc: list[list[int]], outs) -> Rollout:
        B, pad, eos = len(enc), self.tok.pad_id, set(self.tok.eos_ids)
        N = max(1, max(len(o.token_ids) for o in outs))
        ids = torch.full((B, N), pad, dtype=torch.long)
        mask = torch.zeros((B, N), dtype=torch.bool)
        lp = torch.zeros((B, N), dtype=torch.float32)
        finished = torch.zeros(B, dtype=torch.bool)
        for i, o in enumerate(outs):
            toks = list(o.token_ids)
            n = len(toks)
            ids[i, :n] = torch.tensor(toks, dtype=torch.long)
            mask[i, :n] = True
            lp[i, :n] = torch.tensor([d[t].logprob for t, d in zip(toks, o.logprobs)])
            finished[i] = n > 0 and toks[-1] in eos
        pids, pmask = pad_left(enc, pad, self.device)
        r = Rollout(pids, pmask, ids.to(self.device), mask.to(self.device),
                    lp.to(self.device), finished.to(self.device),
                    nonfinite=~torch.isfinite(lp).all().to(self.device))
        r.texts = [self.tok.decode(row) for row in ids.tolist()]
        return r

    def sync(self, model) -> None:
        weights = hf_tensors(model, fsdp.full_tensors(model), self.dtype, head=True)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights,
                                                          "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Shuts the engine down now, not at exit: its teardown destroys the default process
        group (vLLM's, or under torchrun ours), which must happen before distributed.cleanup
        looks at it (Run.close closes the engine first)."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(self.dir, ignore_errors=True)


def _head_dim(model) -> int:
    c = model.cfg
    return getattr(c, "head_dim", None) or c.n_embd // c.n_head


def _summary(e: BaseException) -> str:
    """The last line of an error's message (vLLM's say what failed there)."""
    lines = [s for s in str(e).splitlines() if s.strip()]
    return lines[-1].strip() if lines else type(e).__name__

