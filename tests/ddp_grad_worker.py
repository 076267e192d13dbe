"""Run by tests/test_distributed.py under `torchrun --standalone --nproc_per_node=2`.

For one fixed rollout batch, each rank computes the DDP gradient of its half of the prompts
and, beside it, the single-process gradient of the whole batch; rank 0 writes the largest
difference per case (loss aggregation x reward scaling x passes) as JSON to argv[1].
"""

import copy
import gc
import json
import sys

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from mini_grpo import distributed as D
from mini_grpo.config import load_config
from mini_grpo.grpo import group_advantages
from mini_grpo.model import GPT, GPTConfig
from mini_grpo.rollout import Rollout, pad_left
from mini_grpo.trainer import accumulate_gradients

PROMPTS, G, N = 4, 4, 12


def make_batch(seed: int):
    """A rollout of PROMPTS x G rows with ragged prompts and completions, rewards and ref."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(PROMPTS):
        p = [1] + torch.randint(4, 24, (int(torch.randint(2, 9, (1,), generator=g)),),
                                generator=g).tolist()
        prompts += [p] * G
    pids, pmask = pad_left(prompts, 0)
    B = len(prompts)
    lengths = torch.randint(1, N + 1, (B,), generator=g)
    cmask = torch.arange(N)[None] < lengths[:, None]
    cids = torch.randint(4, 24, (B, N), generator=g).masked_fill(~cmask, 0)
    cids[torch.arange(B), lengths - 1] = 2  # EOS
    old_lp = (-torch.rand(B, N, generator=g) * 3).masked_fill(~cmask, 0)
    ref_lp = (-torch.rand(B, N, generator=g) * 3).masked_fill(~cmask, 0)
    rewards = torch.rand(B, generator=g)
    rewards[:G] = 0.5  # one zero-spread group
    r = Rollout(pids, pmask, cids, cmask, old_lp, torch.ones(B, dtype=torch.bool))
    return r, rewards, ref_lp


def take(r: Rollout, rows: slice) -> Rollout:
    return Rollout(r.prompt_ids[rows], r.prompt_mask[rows], r.completion_ids[rows],
                   r.completion_mask[rows], r.logprobs[rows], r.finished[rows])


def gradient(net, r, rewards, ref_lp, cfg, world_size: int):
    """The trainer's recipe: global normalisers, advantages, accumulate over micro-batches."""
    n = torch.tensor([float(len(rewards)), rewards.sum(), rewards.square().sum(),
                      float(r.completion_mask.sum())])
    if world_size > 1:
        D.all_reduce_sum(n)
    mean = n[1] / n[0]
    std = (n[2] / n[0] - mean**2).clamp(min=0).sqrt()
    adv, _ = group_advantages(rewards, G, cfg.scale_rewards, batch_std=std)
    for _ in range(cfg.num_iterations):
        accumulate_gradients(net, r, r.completion_mask, adv, ref_lp, cfg, n[0], n[3],
                             world_size)


def main(out_path: str) -> None:
    dist = D.init()
    torch.set_num_threads(1)
    half = slice(dist.rank * PROMPTS * G // 2, (dist.rank + 1) * PROMPTS * G // 2)
    diffs = {}
    for agg in ("grpo", "dapo", "dr_grpo"):
        for scale in ("group", "batch"):
            for iters in (1, 2):
                cfg = load_config(None, {"loss_agg": agg, "scale_rewards": scale,
                                         "num_iterations": iters, "micro_batch_size": 3,
                                         "beta": 0.1, "group_size": G, "max_new_tokens": N,
                                         "use_amp": False, "epsilon_high": 0.28}, env={})
                torch.manual_seed(0)
                model = GPT(GPTConfig(vocab_size=24, block_size=64, n_layer=2, n_head=2,
                                      n_embd=32))
                single = copy.deepcopy(model)
                r, rewards, ref_lp = make_batch(seed=1)
                gradient(single, r, rewards, ref_lp, cfg, world_size=1)
                ddp = DDP(model)
                gradient(ddp, take(r, half), rewards[half], ref_lp[half], cfg,
                         world_size=dist.world_size)
                del ddp  # its reducer must not outlive the process group (abort at exit)
                gc.collect()
                diffs[f"{agg}/{scale}/iters{iters}"] = max(
                    (a.grad - b.grad).abs().max().item()
                    for a, b in zip(model.parameters(), single.parameters()))
    if dist.is_main:
        with open(out_path, "w") as f:
            json.dump(diffs, f, indent=1)
    D.cleanup()


if __name__ == "__main__":
    main(sys.argv[1])
