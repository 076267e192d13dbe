"""Autocast, TF32 and thread set-up from the config, for CUDA and CPU alike."""

from __future__ import annotations

import contextlib
import os

import torch

from .config import GRPOConfig


def resolve_device(cfg: GRPOConfig, local_rank: int = 0) -> torch.device:
    if cfg.device == "auto":
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device={cfg.device} but CUDA is not available")
    return torch.device(cfg.device)


def _cpu_has_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def amp_dtype(cfg: GRPOConfig, device: torch.device) -> torch.dtype | None:
    """The autocast dtype in force, or None for fp32. `auto` prefers bf16 where the hardware
    has it, falls back to fp16 on CUDA, and to fp32 on CPUs without bf16 units."""
    if not cfg.use_amp:
        return None
    if cfg.amp_dtype == "bfloat16":
        return torch.bfloat16
    if cfg.amp_dtype == "float16":
        return torch.float16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if _cpu_has_bf16() else None


def autocast(cfg: GRPOConfig, device: torch.device, generation: bool = False):
    """Context manager for forward passes: autocast when AMP is on, else a no-op.
    `generation=True` marks sampling, which follows `generation_amp`."""
    dtype = amp_dtype(cfg, device)
    if generation and cfg.generation_amp == "off":
        dtype = None
    elif generation and cfg.generation_amp == "on" and dtype is None:
        dtype = amp_dtype(GRPOConfig(use_amp=True, amp_dtype=cfg.amp_dtype), device)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def setup_backends(cfg: GRPOConfig, local_world_size: int = 1) -> int:
    """TF32 (a no-op off Ampere+ GPUs) and intra-op threads; returns the thread count.

    More threads than cores is ruinous (2 ranks x 2 threads ran 6x slower than 2 x 1 on a
    2-core machine), so the default splits the cores between the local ranks.
    """
    torch.backends.cuda.matmul.allow_tf32 = cfg.use_tf32
    torch.backends.cudnn.allow_tf32 = cfg.use_tf32
    threads = cfg.num_threads or max(1, (os.cpu_count() or 1) // max(1, local_world_size))
    torch.set_num_threads(threads)
    return threads


def grad_scaler(cfg: GRPOConfig, device: torch.device) -> torch.amp.GradScaler:
    """Loss scaling for float16 autocast only (bf16 and fp32 have fp32's range); disabled
    otherwise, in which case its calls pass straight through."""
    return torch.amp.GradScaler(device.type, enabled=amp_dtype(cfg, device) == torch.float16)
