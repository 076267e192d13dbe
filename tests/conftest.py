"""Shared helpers for the tests: the tiny config, a tiny GPT, torchrun on loopback.

Test files import them as `from conftest import ...` (pytest puts tests/ on the path).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from mini_grpo.config import load_config
from mini_grpo.model import GPT, GPTConfig

ROOT = Path(__file__).resolve().parent.parent

# GRPO alone, fp32 (exact reproducibility and resume are promised for fp32 on CPU), a small
# held-out split, rewards scored in the trainer's thread
TINY = {"mode": "grpo", "num_eval": 8, "use_amp": False, "reward_executor": "serial"}


def tiny(out_dir=None, **overrides):
    """configs/tiny.yaml with TINY and `overrides` on top, environment ignored."""
    over = dict(TINY)
    if out_dir is not None:
        over["out_dir"] = str(out_dir)
    over.update(overrides)
    return load_config("tiny", {k: v if isinstance(v, dict) else str(v)
                                for k, v in over.items()}, env={})


def tiny_gpt(seed: int = 0, vocab_size: int = 24) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=vocab_size, block_size=64, n_layer=2, n_head=2,
                         n_embd=32)).eval()


def metrics(out_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").open()]


def events(out_dir) -> list[tuple[int, str]]:
    return [(r["step"], r["event"]) for r in metrics(out_dir) if "event" in r]


def clean_env(**extra) -> dict:
    """os.environ without the switches a developer may have set, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("USE_AMP", "MAX_STEPS", "MINI_GRPO_FAULT", "MINI_GRPO_NAN_STEPS",
                        "OUT_DIR", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                        "MASTER_PORT")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra})
    return env


def torchrun(*args, extra_env=None, timeout=300, nproc=2):
    """`torchrun --standalone --nproc_per_node=2 ARGS` on loopback, from the repository root."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                          env=clean_env(**(extra_env or {})), timeout=timeout)


def entry(*args, env=None, timeout=300, cwd=None):
    """`python distributed_train.py ARGS` as a user runs it."""
    return subprocess.run([sys.executable, str(ROOT / "distributed_train.py"), *args],
                          capture_output=True, text=True, cwd=cwd or ROOT,
                          env=clean_env(**(env or {})), timeout=timeout)
