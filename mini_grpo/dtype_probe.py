"""Which autocast dtype runs faster on this CPU, fp32 or bf16: a short probe on the run's own
model for the `auto` precision settings (precision.resolve_precision), cached per machine.

bf16 sampling is faster than fp32 on some CPUs with bf16 instructions (AMX) and slower on
others (AVX-512 BF16 alone), so the device type alone cannot decide. A command times only
what it runs (`parts`: "train" passes and/or "sample"-ing; `mini-grpo sample`, `evaluate` and
`rft-generate` only sample), and the figures are kept in a small JSON file keyed by what they
depend on (CPU model and the instruction sets its kernels may use, model spec, threads, torch
version, what was timed and on which shapes), so the next command does not probe again: the
probe was half of a `mini-grpo sample` on the SmolLM2-135M shape. A busy machine must
not fool it: the dtypes alternate, each figure is the median of three rounds, and when the
rounds do not all find the same dtype faster (a probe run beside other work once timed in
seconds what takes milliseconds) the log says so and the verdict is not cached: the
next command times again.

    $MINI_GRPO_PROBE_CACHE, else $XDG_CACHE_HOME/mini_grpo/probe.json,
    else ~/.cache/mini_grpo/probe.json

The file is untrusted input: a missing, unreadable or malformed file or entry is a miss (timed
again and rewritten), never an error; it is replaced atomically (outputs.write_file).
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch

from . import distributed as D
from .engines.native import generate
from .lora import LoRAFacts
from .outputs import OutputWriteError, write_file
from .precision import attention_impl

MAX_BYTES = 1 << 20  # the file holds a few hundred bytes per entry
MAX_ENTRIES = 64  # the newest kept


def cache_path() -> Path | None:
    if os.environ.get("MINI_GRPO_PROBE_CACHE"):
        return Path(os.environ["MINI_GRPO_PROBE_CACHE"])
    try:
        root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    except RuntimeError:  # no home directory: no cache
        return None
    return Path(root) / "mini_grpo" / "probe.json"


def _cpuinfo(field: str) -> str | None:
    """The value of /proc/cpuinfo's first `field` line; None off Linux or where none is."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    name = _cpuinfo("model name")
    return name if name is not None else platform.processor() or platform.machine()


# what decides which kernels run beside the model name: a VM's name can be one generic "Intel
# Xeon Processor" on hosts with and without AMX, and oneDNN's ISA can be capped
# (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 on an AMX Xeon runs the Zen4's kernels)
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")
ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")


def cpu_isa() -> dict:
    """The ISA_FLAGS this CPU has (/proc/cpuinfo; [] elsewhere) and the ISA_ENV caps set."""
    flags = set((_cpuinfo("flags") or "").split())
    return {"flags": [f for f in ISA_FLAGS if f in flags],
            **{k: os.environ[k] for k in ISA_ENV if os.environ.get(k)}}


# bumped when the timed code changes enough to turn a verdict (2: bf16 sampling on
# prepacked weights, models/packed.py; 3: medians of 3 rounds that agree; 4: the key holds
# LoRA's options and gradient checkpointing), so that figures of the old code are not reused
CODE_VERSION = 4


def cache_key(model, parts: tuple[str, ...], shape: dict) -> str:
    """What the figures depend on: the machine, the code, the model's shape and what its
    training pass does (LoRA's adapters: a full fine-tune's verdict was reused for them)."""
    lora = LoRAFacts.of(model)
    return json.dumps({"code": CODE_VERSION, "cpu": cpu_name(), "isa": cpu_isa(),
                       "family": model.family,
                       "config": asdict(model.cfg),
                       "lora": lora.options() if lora else None,
                       "checkpointing": bool(getattr(model, "gradient_checkpointing", False)),
                       "threads": torch.get_num_threads(), "torch": torch.__version__,
                       "parts": list(parts), **shape}, sort_keys=True)


def read_cache(path: Path) -> dict[str, dict[str, float]]:
    """The file's well-formed entries ({key: {figure: seconds}}); {} for a missing,
    unreadable or malformed file."""
    try:
        if path.stat().st_size > MAX_BYTES:
            return {}
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict) and all(
        isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) and s > 0
        for s in v.values())}


def write_cache(path: Path, entries: dict) -> None:
    """`entries` (the newest MAX_ENTRIES) as the file, atomically; a failure only loses the
    cache."""
    try:
        write_file(path, json.dumps(dict(list(entries.items())[-MAX_ENTRIES:]), indent=1))
    except OutputWriteError:
        pass


def probe_dtypes(model, cfg, parts: tuple[str, ...]) -> dict[str, float]:
    """Seconds of each part under fp32 and bf16 ({"sample_bf16": ..., "sample_fp32": ...}),
    from the cache or timed (`measure`) and cached. Every rank gets the same figures (the sum
    over ranks), so all decide alike: when any rank misses the cache, every rank times."""
    shape = {"block_size": cfg.block_size,
             "sample_rows": min(64, cfg.prompts_per_step * cfg.group_size),
             "bf16_attn": attention_impl(cfg.attn_impl, torch.device("cpu"), torch.bfloat16)}
    names = sorted(f"{part}_{label}" for part in parts for label in ("bf16", "fp32"))
    path, key = cache_path(), cache_key(model, parts, shape)
    entries = read_cache(path) if path else {}
    hit = entries.get(key) if set(entries.get(key, ())) == set(names) else None
    agreed = D.all_reduce_sum(torch.tensor(  # (1 + figures,): ranks that missed, then sums
        [0.0 if hit else 1.0] + [hit[n] if hit else 0.0 for n in names], dtype=torch.float64))
    if agreed[0] == 0:
        return dict(zip(names, agreed[1:].tolist()))
    with torch.random.fork_rng(devices=[]):  # its training passes draw dropout: a run's
        rounds = measure(model, parts, **shape)  # masks must not depend on a cache hit
    mine = {n: statistics.median(v) for n, v in rounds.items()}
    unsure = disagreeing(rounds)
    if path and not unsure:
        entries.pop(key, None)
        write_cache(path, {**entries, key: mine})
    # then one flag per part: the ranks whose rounds disagreed
    summed = D.all_reduce_sum(torch.tensor([mine[n] for n in names] + [
        float(p in unsure) for p in sorted(parts)], dtype=torch.float64)).tolist()
    figures = dict(zip(names, summed))
    figures.update({f"{p}_disagreed": n for p, n in zip(sorted(parts), summed[len(names):])
                    if n})
    return figures


def disagreeing(rounds: dict[str, list[float]]) -> list[str]:
    """The parts whose rounds did not all find the same dtype faster: a busy machine, or
    two dtypes within noise of each other."""
    parts = sorted({name.rsplit("_", 1)[0] for name in rounds})
    return [p for p in parts if len({b < f for b, f in zip(rounds[f"{p}_bf16"],
                                                            rounds[f"{p}_fp32"])}) > 1]


def measure(model, parts: tuple[str, ...], block_size: int, sample_rows: int = 64,
            bf16_attn: str = "manual", reps: int = 3) -> dict[str, list[float]]:
    """This process's seconds, under fp32 and bf16, of a "train" forward+backward over
    4 x 64 tokens and of 8 cached "sample" steps for `sample_rows` rows (groups of 8 sharing
    a 32-token prompt, as a GRPO step samples them): each of `reps` rounds after a warm-up
    round, the dtypes alternating within a round. The bf16 training pass uses the attention
    `attn_impl: auto` picks under bf16 (manual). Only the parts asked for run: sampling alone
    does no backward."""
    T, P = max(2, min(64, block_size)), max(1, min(32, block_size - 8))
    g = torch.Generator().manual_seed(0)  # leaves the global RNG (dropout, init) alone
    x = torch.randint(4, model.cfg.vocab_size, (4, T), generator=g)
    prompts = [p for p in torch.randint(4, model.cfg.vocab_size, (max(1, sample_rows // 8), P),
                                        generator=g).tolist() for _ in range(8)][:sample_rows]
    was_training, impl = model.training, model.attn_impl

    def train(dtype):
        model.train()
        model.attn_impl = impl if dtype is None else bf16_attn
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = model(x).float().logsumexp(-1).mean()
        loss.backward()
        model.attn_impl = impl

    def sample(dtype):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            generate(model, prompts, 8, eos_id=-1, pad_id=0, greedy=True)

    times: dict[str, list[float]] = {}
    for rep in range(reps + 1):
        for name in parts:
            for label, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
                t0 = time.perf_counter()
                (train if name == "train" else sample)(dtype)
                if rep:  # the first round warms up
                    times.setdefault(f"{name}_{label}", []).append(time.perf_counter() - t0)
    if "train" in parts:
        model.zero_grad(set_to_none=True)
    model.train(was_training)
    return times
