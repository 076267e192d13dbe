"""Sampling under FSDP: weights gathered once per rollout (fsdp.full_params, what the trainer
does) against FSDP's default, an all-gather of every block at every decoded token.

    torchrun --standalone --nproc_per_node=2 bench/fsdp_generation.py [--config default]

Both ranks decode the same number of tokens (EOS ignored), which the per-token variant needs
anyway: every forward of a sharded model is a collective, so ranks whose rows end at different
steps would wait on each other forever. Prints the median seconds per rollout of each.
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mini_grpo import distributed as D  # noqa: E402
from mini_grpo import fsdp  # noqa: E402
from mini_grpo.config import load_config, parse_cli  # noqa: E402
from mini_grpo.engines.native import generate  # noqa: E402
from mini_grpo.models import build  # noqa: E402
from mini_grpo.policy import gpt_spec  # noqa: E402


def main() -> None:
    config, overrides = parse_cli(sys.argv[1:])
    cfg = load_config(config or "default", overrides)
    dist = D.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build(gpt_spec(cfg, 40))
    fsdp.shard(model, torch.device("cpu"))
    g = torch.Generator().manual_seed(dist.rank)
    prompts = [torch.randint(4, 40, (30,), generator=g).tolist() for _ in range(32)]
    runs = {"gathered once": [], "gathered per token": []}
    for _ in range(3):
        for name in runs:
            D.all_reduce_sum(torch.zeros(1))  # start together
            t0 = time.perf_counter()
            if name == "gathered once":
                with fsdp.full_params(model):
                    generate(model, prompts, 64, eos_id=-1, pad_id=0, generator=g)
            else:
                generate(model, prompts, 64, eos_id=-1, pad_id=0, generator=g)
            runs[name].append(time.perf_counter() - t0)
    if dist.is_main:
        for name, ts in runs.items():
            print(f"{name:20s} {statistics.median(ts):.3f} s per rollout (32 rows x 64 tokens,"
                  f" {cfg.n_layer} layers, median of 3)")
    D.cleanup()


if __name__ == "__main__":
    main()
