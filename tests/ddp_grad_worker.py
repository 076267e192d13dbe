"""Run by tests/test_distributed.py twice: as plain `python` (one process, the whole batch) and
under `torchrun --standalone --nproc_per_node=2` (each rank half the prompts, DDP).

For one fixed rollout batch and each case (loss aggregation x reward scaling x passes, on our
GPT, and two cases on a Llama-family model with an untied head, which the chunked log-prob
pass uses outside DDP's forward), it computes the gradient with the trainer's own functions
(the Trajectory's advantages with the global normalisers and its micro-batch plan,
policy_pass); rank 0 saves
{case: [grad per parameter]} to argv[1] for the test to compare.
"""

import gc
import sys
from contextlib import nullcontext

import torch
from conftest import make_rollout

from mini_grpo import distributed as D
from mini_grpo.config import load_config
from mini_grpo.engines.base import Rollout, Sampling, pad_left
from mini_grpo.models import GPT, GPTConfig, Llama, LlamaConfig
from mini_grpo.trainer import policy_pass
from mini_grpo.trajectory import Trajectory

PROMPTS, G, N = 4, 4, 12


def sft_rows(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) of an SFT batch: right-padded rows of these lengths (width 20, ids 4..23), their
    targets on each row's second half (-1 elsewhere)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.zeros(len(lengths), 20, dtype=torch.long)
    y = torch.full((len(lengths), 20), -1)
    for i, n in enumerate(lengths):
        x[i, :n] = torch.randint(4, 24, (n,), generator=g)
        y[i, n // 2:n] = torch.randint(4, 24, (n - n // 2,), generator=g)
    return x, y


class PlainState:
    """What sft_pass asks of a TrainState in fp32: its autocast (off), its backward (plain)
    and the weights' cast (none)."""
    def autocast(self):
        return nullcontext()

    def backward(self, loss):
        loss.backward()

    def cast_once(self, net):
        return nullcontext()


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
    r = make_rollout(pids, pmask, cids, cmask, old_lp, sampling=Sampling(N, temperature=0.7))
    return r, rewards, ref_lp


def take(r: Rollout, rows: slice) -> Rollout:
    return r.take(list(range(len(r.finished)))[rows])


def gradient(net, r, rewards, ref_lp, cfg) -> None:
    """The trainer's recipe: global normalisers, advantages, passes over micro-batches."""
    traj = Trajectory.of(r, rewards, cfg).replace(ref_logp=ref_lp)
    for _ in range(cfg.num_iterations):
        _, old = policy_pass(net, traj, cfg)
        traj = traj.replace(old_logp=old)


def main(out_path: str) -> None:
    dist = D.init(use_cuda=False)  # CPU tensors: gloo, whatever the machine has
    torch.set_num_threads(1)
    W = dist.world_size
    mine = slice(dist.rank * PROMPTS * G // W, (dist.rank + 1) * PROMPTS * G // W)
    grads = {}
    cases = [("gpt", agg, scale, iters) for agg in ("grpo", "dapo", "dr_grpo")
             for scale in ("group", "batch") for iters in (1, 2)]
    cases += [("llama", "dapo", "group", iters) for iters in (1, 2)]
    for family, agg, scale, iters in cases:
        cfg = load_config(None, {"loss_agg": agg, "scale_rewards": scale,
                                 "num_iterations": iters, "micro_batch_size": 3,
                                 "beta": 0.1, "group_size": G, "max_new_tokens": N,
                                 "use_amp": False, "epsilon_high": 0.28}, env={})
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=24, block_size=64, n_layer=2, n_head=2, n_embd=32)) \
            if family == "gpt" else Llama(LlamaConfig(
                vocab_size=24, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                head_dim=8, n_inner=48))
        r, rewards, ref_lp = make_batch(seed=1)
        net, _ = D.wrap_ddp(model, torch.device("cpu"))
        gradient(net, take(r, mine), rewards[mine], ref_lp[mine], cfg)
        del net  # its reducer must not outlive the process group (abort at exit)
        gc.collect()
        grads[f"{family}/{agg}/{scale}/iters{iters}"] = [p.grad.clone()
                                                         for p in model.parameters()]
    if dist.is_main:
        torch.save(grads, out_path)
    D.cleanup()


if __name__ == "__main__":
    main(sys.argv[1])
