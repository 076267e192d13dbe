"""Device, autocast, TF32 and thread set-up from the config, for CUDA and CPU alike.

`Precision` holds the autocast dtypes in force for training passes and for sampling, resolved
once at start. An `auto` that depends on the machine is decided by a short probe on the
model's own shapes, which the caller hands in (dtype_probe.py: it runs the sampler, which this
module does not import), logged with its figures: bf16 sampling is faster than fp32 on some
CPUs with bf16 instructions and slower on others, so the device type alone cannot decide.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import os
import sys
import warnings

import torch

from .config import ConfigError, GRPOConfig


def resolve_device(cfg: GRPOConfig, local_rank: int = 0) -> torch.device:
    """The device of the rank with this node-local rank; one GPU per rank (auto, cuda)."""
    if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"device: {cfg.device} asked for, but CUDA is not available here "
                          f"(use device: auto or cpu)")
    if cfg.device in ("auto", "cuda") and local_rank >= torch.cuda.device_count():
        n = torch.cuda.device_count()
        raise ConfigError(f"device: {cfg.device}: local rank {local_rank} has no GPU of its own "
                          f"(this node has {n}); start at most {n} processes per node "
                          f"(--nproc_per_node, NPROC), or set device: cpu to run them on gloo")
    return torch.device(f"cuda:{local_rank}" if cfg.device == "auto" else cfg.device)


def _cpu_has_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _dtype(name: str, device: torch.device) -> torch.dtype | None:
    """`auto` prefers bf16 where the hardware has it, falls back to fp16 on CUDA, and to fp32
    (None) on CPUs without bf16 units."""
    if name == "bfloat16":
        return torch.bfloat16
    if name == "float16":
        return torch.float16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if _cpu_has_bf16() else None


class Precision:
    """Autocast dtypes for training passes (`dtype`) and sampling (`generation_dtype`); None
    means fp32. `enabled=False` at a call site (the guard's amp_off rung) forces fp32."""

    def __init__(self, device: torch.device, dtype: torch.dtype | None,
                 generation_dtype: torch.dtype | None, probe: dict | None = None):
        self.device, self.dtype, self.generation_dtype = device, dtype, generation_dtype
        self.probe = probe or {}  # the measured figures behind an `auto`, for the log

    def autocast(self, generation: bool = False, enabled: bool = True):
        dtype = self.generation_dtype if generation else self.dtype
        if dtype is None or not enabled:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def scaler(self, enabled: bool = True) -> torch.amp.GradScaler:
        """Loss scaling for float16 autocast only (bf16 and fp32 have fp32's range); disabled
        otherwise, in which case its calls pass straight through."""
        return torch.amp.GradScaler(self.device.type,
                                    enabled=enabled and self.dtype == torch.float16)

    def describe(self) -> str:
        name = lambda d: str(d).replace("torch.", "") if d is not None else "fp32"
        text = f"autocast {name(self.dtype)}, sampling {name(self.generation_dtype)}"
        seconds = {k: v for k, v in self.probe.items() if not k.endswith("_disagreed")}
        if seconds:
            text += " (probe: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in
                                             seconds.items()) + ")"
        unsure = [k.removesuffix("_disagreed") for k in self.probe if k.endswith("_disagreed")]
        if unsure:
            text += (f"; the probe's rounds disagreed on {' and '.join(unsure)} (a busy machine, "
                     "or dtypes within noise): not cached, timed again by the next command")
        return text


@contextlib.contextmanager
def linear_weights_cast_once(model: torch.nn.Module, dtype: torch.dtype | None):
    """Within it, the trained fp32 weights of `model`'s nn.Linear layers are `dtype` copies,
    cast once, where autocast casts them again in every micro-batch's forward and casts each
    weight's gradient back to fp32 in its backward (those copies were a large share of the
    LM job's policy pass: docs/results.md). Each copy's gradient is added into its fp32
    parameter's `.grad` as the backward makes it (fp32 += the low-precision gradient, what
    autocast's cast-back and accumulation compute: the same bits). Forward and backward both
    belong inside (activation checkpointing forwards again in the backward).

    For a plain module only, under autocast in `dtype` (None: a no-op): not DDP-wrapped (its
    hooks are on the parameters), sharded or compiled. The LM head's weight (tied to the
    embedding or not: chunked.token_logprobs casts it and sums its gradient in fp32 itself; a
    bf16 copy would round that sum to bf16), a weight shared between modules and a frozen or
    low-precision one (LoRA's base) are left as they are."""
    if dtype is None:
        yield
        return
    count: dict[int, int] = {}
    for _, q in model.named_parameters(remove_duplicate=False):
        count[id(q)] = count.get(id(q), 0) + 1
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    swapped = []
    for mod in model.modules():
        w = mod._parameters.get("weight") if isinstance(mod, torch.nn.Linear) else None
        if (w is None or w is head or not w.requires_grad or w.dtype != torch.float32
                or count[id(w)] > 1):
            continue
        low = w.detach().to(dtype).requires_grad_()

        def add_into(low: torch.Tensor, w: torch.Tensor = w) -> None:
            if w.grad is None:
                w.grad = low.grad.to(w.dtype)
            else:
                w.grad.add_(low.grad)
            low.grad = None
        low.register_post_accumulate_grad_hook(add_into)
        swapped.append((mod, w, low))
    try:
        for mod, _, low in swapped:
            mod._parameters["weight"] = low
        yield
    finally:
        for mod, w, _ in swapped:
            mod._parameters["weight"] = w


def resolve_precision(cfg: GRPOConfig, device: torch.device, probe=None,
                      train: bool = True) -> Precision:
    """The config's precision for this machine. On a CPU with bf16 units, `amp_dtype: auto`
    and `generation_amp: auto` are decided by `probe(parts)`, the seconds of the "train"
    and/or "sample" parts under fp32 and bf16 on the run's model (dtype_probe.probe_dtypes,
    which the caller hands in): bf16 where it ran faster than fp32. Only the parts still
    `auto` are probed; `train=False` (a command that only samples): no training autocast,
    and sampling alone is probed."""
    dtype = _dtype(cfg.amp_dtype, device) if cfg.use_amp else None
    if cfg.generation_amp == "auto":
        gen = dtype
    else:
        gen = _dtype(cfg.amp_dtype, device) if cfg.generation_amp == "on" else None
    if not train:  # nothing is trained: no training autocast (attn_impl auto: SDPA)
        dtype = None
    cpu_bf16 = lambda d: device.type == "cpu" and d == torch.bfloat16
    parts = tuple(part for part, auto in (
        ("train", cfg.use_amp and cfg.amp_dtype == "auto" and cpu_bf16(dtype)),
        ("sample", cfg.generation_amp == "auto" and cpu_bf16(gen))) if auto)
    figures = probe(parts) if parts and probe is not None else {}
    if "train_bf16" in figures and figures["train_bf16"] > figures["train_fp32"]:
        dtype = None
    if "sample_bf16" in figures:
        gen = torch.bfloat16 if figures["sample_bf16"] < figures["sample_fp32"] else None
    return Precision(device, dtype, gen, figures)


def attention_impl(attn_impl: str, device: torch.device, dtype: torch.dtype | None) -> str:
    """The config's attention implementation, `auto` resolved for training under `dtype`:
    manual attention under bf16 autocast on a CPU (SDPA's bf16 backward ran 2-3x slower
    there), else SDPA."""
    if attn_impl != "auto":
        return attn_impl
    return "manual" if device.type == "cpu" and dtype == torch.bfloat16 else "sdpa"


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters (malloc.h)
# blocks from this size up are mapped from the OS and unmapped on free, as glibc does by
# default above a threshold that moves between 128 KiB and 32 MiB: the heap keeps the rest.
# Kept in the heap too (the bound was none), the LM job's GRPO held 3.95 GiB after each step
# against 3.64, at the same step time.
KEEP_BELOW = 64 << 20


def memory_gb(device: torch.device) -> dict[str, float]:
    """This process's resident memory now (GiB; Linux's /proc, else the peak so far) and, on
    a GPU, the most CUDA has held allocated: a step's figures, so growth shows in the log."""
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        scale = 1 if sys.platform == "darwin" else 1024  # macOS: bytes; Linux: KiB
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    out = {"mem/rss_gb": rss / 2**30}
    if device.type == "cuda":
        out["mem/cuda_max_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


@functools.cache
def _glibc(name: str):
    """glibc's function `name`, or None off Linux or off glibc (musl has no mallopt). Looked
    up once: find_library runs ldconfig, and release_freed_memory is called per batch."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def keep_freed_memory() -> bool:
    """glibc only: serve allocations below KEEP_BELOW from the heap and never trim it. Returns
    whether the setting took. There is no undo: setting these parameters also ends glibc's
    dynamic mmap threshold for the life of the process.

    By default glibc maps blocks of up to 32 MiB freshly from the OS (its threshold moves
    between 128 KiB and 32 MiB) and unmaps them on free, so every large activation is a new
    buffer whose first write page-faults: the production model's forward+backward spent a
    third of its time there on a CPU (docs/history.md).
    PyTorch has no caching allocator for CPU tensors; this makes glibc one. Blocks from
    KEEP_BELOW up (the LM job's logits, an evaluation's key/value cache) are still mapped
    and unmapped: few, so their page faults cost little, and kept they left holes in the
    heap that smaller blocks could not fill. GPU runs do not need it (CUDA has its own
    caching allocator).
    """
    mallopt = _glibc("mallopt")
    return bool(mallopt and mallopt(_M_MMAP_THRESHOLD, KEEP_BELOW)
                and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def release_freed_memory(device: torch.device) -> bool:
    """Called as each phase starts (an evaluation, RFT's sampling, SFT, GRPO): frees what
    only reference cycles still hold, then, glibc only and on a CPU run, hands the pages of
    every freed heap block back to the OS (`malloc_trim(0)`); the blocks stay in the heap,
    and their pages come back, zeroed, when next written. Returns whether pages went back.

    A cycle held a whole finished stage: the first optimizer a process builds imports
    torch._dynamo, and torch.fx's `wrap` keeps its own frame, so every frame below it (the
    stage's TrainState with its AdamW state and gradients, 1.5 GiB for SmolLM2-135M) stayed
    alive until Python's next full collection, into the stages after it. And with
    cpu_malloc_cache, what one phase freed and the next does not fit (the optimizer's state,
    a pass's activations) stayed resident (docs/history.md)."""
    gc.collect()
    trim = _glibc("malloc_trim") if device.type == "cpu" else None
    return bool(trim and trim(ctypes.c_size_t(0)))


# oneDNN (PyTorch's CPU matmuls) keeps each new shape's primitive, with its scratchpad and
# reordered weights, up to 1024 of them: a job whose sequence lengths change every step grew
# by ~0.3 GB a step until it held GBs. 16 of each: the LM job's GRPO peak 6.2 -> 4.9 GB at the
# same step time (docs/results.md). A value the user set is kept.
ONEDNN_CACHES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16", "LRU_CACHE_CAPACITY": "16"}
# LoRA's layers add their adapters' matmuls, each shape in forward and backward: a micro-batch
# cycles through more primitives than 16, so each of its 30 layers missed the cache and built
# its primitives again (where a primitive is a JIT-compiled kernel, as with AMX, that doubled
# the LM job's policy pass). 128 holds a micro-batch's; LoRA frees 1.7 GiB of
# gradients and AdamW state, so the cache costs it no headroom (docs/history.md)
ONEDNN_LORA_PRIMITIVES = "128"


def bound_onednn_caches(lora: bool = False) -> None:
    """Caps oneDNN's primitive cache and ideep's weight cache (read when first used); a run
    that trains LoRA adapters keeps ONEDNN_LORA_PRIMITIVES primitives."""
    caps = dict(ONEDNN_CACHES)
    if lora:
        caps["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = ONEDNN_LORA_PRIMITIVES
    for key, value in caps.items():
        os.environ.setdefault(key, value)


def setup_backends(cfg: GRPOConfig, local_world_size: int = 1) -> int:
    """TF32 (a no-op off Ampere+ GPUs), intra-op threads and, for CPU runs, the allocator
    (`cpu_malloc_cache`, see keep_freed_memory); returns the thread count.

    More threads than cores is ruinous (each rank's threads wait on the others' at every
    barrier of a parallel region), so the default splits the cores between the local ranks.
    """
    torch.backends.cuda.matmul.allow_tf32 = cfg.use_tf32
    torch.backends.cudnn.allow_tf32 = cfg.use_tf32
    if resolve_device(cfg).type == "cpu":
        bound_onednn_caches(lora=bool(cfg.lora_r or cfg.adapter))
        if cfg.cpu_malloc_cache:
            keep_freed_memory()
    threads = cfg.num_threads or max(1, (os.cpu_count() or 1) // max(1, local_world_size))
    torch.set_num_threads(threads)
    return threads


class _CompiledWithFallback(torch.nn.Module):
    """torch.compile'd forward that falls back to eager, once and for good, if compiling or
    running the compiled graph fails: a run never dies over compilation."""

    def __init__(self, model: torch.nn.Module, mode: str):
        super().__init__()
        self.model = model
        self.cfg = model.cfg
        # dynamic=True: micro-batches are trimmed to their real length, so shapes vary from
        # call to call; one dynamic graph compiled in ~27 s on the tiny config, where static
        # shapes recompiled on every new length (3 steps: 57 s against 34 s)
        object.__setattr__(self, "compiled",  # not a child module
                           torch.compile(model, mode=mode, dynamic=True))
        self.failed = False

    def forward(self, *args, **kwargs):
        if not self.failed:
            try:
                return self.compiled(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - any compiler failure means: run eager
                self.failed = True
                warnings.warn(f"torch.compile failed, continuing uncompiled: "
                              f"{type(e).__name__}: {str(e).splitlines()[0][:200]}",
                              stacklevel=2)
        return self.model(*args, **kwargs)

    def head_weight(self) -> torch.Tensor:
        return self.model.lm_head.weight

    @property
    def wrapped(self) -> torch.nn.Module:
        """The model itself (fsdp.is_sharded asks it)."""
        return self.model


def compile_with_fallback(model: torch.nn.Module, mode: str = "default") -> torch.nn.Module:
    try:
        return _CompiledWithFallback(model, mode)
    except Exception as e:  # noqa: BLE001 - torch.compile unavailable on this platform
        warnings.warn(f"torch.compile unavailable, continuing uncompiled: {e}", stacklevel=2)
        return model
