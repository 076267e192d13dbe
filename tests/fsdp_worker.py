"""Run by tests/test_fsdp.py as one plain process, and under torchrun with 2 ranks and DDP or
FSDP, or 4 ranks and HSDP (2 replicas of a model sharded over 2 ranks): 3 GRPO steps of the
trainer's own functions (advantages with the global normalisers, the micro-batch plan,
policy_pass with fsdp's padding to equal passes, clipping, fused AdamW) on fixed rollout
batches, for our GPT, a Llama-family model with an untied head, that Llama training LoRA
adapters on its frozen base, and a Gemma 3 (tied head, a sliding window). Rank 0 saves {family: full
parameters, family/memory: each rank's memory report, family/passes: each rank's micro-batch
counts, and under fsdp family/from_plain: see resumed_from_plain, family/from_rank0: see
sent_from_rank0, family/reference(_bytes): the full weights and each rank's bytes of
fsdp.frozen_copy's copy of the trained model, sft: sft_gradient's full gradient}
to argv[1].
"""

import copy
import gc
import sys

import torch
from ddp_grad_worker import PROMPTS, G, PlainState, make_batch, sft_rows, take

from mini_grpo import distributed as D
from mini_grpo import fsdp
from mini_grpo.config import load_config
from mini_grpo.lora import apply_lora
from mini_grpo.models import GPT, Gemma, GemmaConfig, GPTConfig, Llama, LlamaConfig
from mini_grpo.optim import make_optimizer
from mini_grpo.precision import compile_with_fallback
from mini_grpo.sft import sft_pass
from mini_grpo.trainer import policy_pass
from mini_grpo.trajectory import Trajectory


def build(family: str):
    """gpt, llama, llama_lora (the Llama with LoRA adapters, r 4, on its frozen base), or
    gemma (Gemma 3: tied head, a sliding layer whose window of 4 is shorter than the rows)."""
    torch.manual_seed(0)
    if family == "gpt":
        return GPT(GPTConfig(vocab_size=24, block_size=64, n_layer=2, n_head=2, n_embd=32))
    if family == "gemma":
        return Gemma(GemmaConfig(vocab_size=24, block_size=64, n_layer=2, n_head=4,
                                 n_kv_head=2, n_embd=32, head_dim=8, n_inner=48,
                                 layer_types=["sliding_attention", "full_attention"],
                                 sliding_window=4, query_pre_attn_scalar=8.0))
    model = Llama(LlamaConfig(vocab_size=24, block_size=64, n_layer=2, n_head=4, n_kv_head=2,
                              n_embd=32, head_dim=8, n_inner=48))
    if family == "llama_lora":
        apply_lora(model, r=4, alpha=8)
    return model


def resumed_from_plain(family: str) -> float:
    """The largest difference between a model trained 3 steps in this process alone and the
    same model sharded after 2 of them, given the first's weights and AdamW state (as a
    one-process or DDP checkpoint holds them, by parameter index), then stepped once more."""
    def step(model, opt, k):  # a fixed gradient, the same however the model is sharded
        sum((p * (k + 1) * 0.01).square().sum() for p in model.parameters()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    plain = build(family)
    opt = make_optimizer(plain, 1e-2)
    for k in range(2):
        step(plain, opt, k)
    weights = {k: v.clone() for k, v in plain.state_dict().items()}
    state = copy.deepcopy(opt.state_dict())
    step(plain, opt, 2)
    model = fsdp.shard(build(family), torch.device("cpu"))
    opt = make_optimizer(model, 1e-2)
    fsdp.load_model_state(model, weights)
    fsdp.load_optimizer_state(model, opt, state)
    step(model, opt, 2)
    full = fsdp.model_state(model, everywhere=True)
    return max((full[k] - v).abs().max().item() for k, v in plain.state_dict().items())


def sent_from_rank0(trained, family: str, is_main: bool) -> dict:
    """The full weights of a model sharded on the meta device on every rank but 0, which
    holds `trained`'s full weights: fsdp.load_from_rank0, as set-up loads a pretrained model."""
    full = fsdp.model_state(trained, everywhere=True)
    if is_main:
        model = build(family)
    else:
        with torch.device("meta"):
            model = build(family)
    fsdp.shard(model, torch.device("cpu"))
    fsdp.load_from_rank0(model, full if is_main else {}, torch.device("cpu"))
    assert bool(model.tied_head()) == (family in ("gpt", "gemma"))  # a tied head stays tied
    return {k: v.clone() for k, v in fsdp.model_state(model).items()}


def sft_gradient(dist, parallelism: str) -> list[torch.Tensor]:
    """The full gradient of one SFT step (sft_pass) on our GPT, each rank its share of 6 rows
    whose target counts are far apart (rank 0's 27 tokens, rank 1's 5: each rank's own mean,
    averaged, is not the batch's), rank 0 in smaller micro-batches than the others (fsdp
    pads the others' passes). Sharded, through the compile wrapper run.net is under
    compile_model, left eager (compiling costs ~30 s): fsdp must see the model inside."""
    x, y = sft_rows([20, 18, 16, 3, 4, 2], seed=5)
    W = dist.world_size
    rows = slice(dist.rank * 6 // W, (dist.rank + 1) * 6 // W)
    model = build("gpt")
    if parallelism in ("fsdp", "hsdp") and W > 1:
        fsdp.shard(model, torch.device("cpu"), shard_size=2 if parallelism == "hsdp" else 0)
        net = compile_with_fallback(model)
        net.failed = True  # its eager path: the same module, no compile
        assert fsdp.is_sharded(net)
    else:
        net, _ = D.wrap_ddp(model, torch.device("cpu"))
    sft_pass(net, x[rows], y[rows], 24 if dist.rank == 0 else 60, PlainState())
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
             for p in model.parameters()]
    del net  # DDP's reducer must not outlive the process group
    gc.collect()
    return grads


def main(out_path: str, parallelism: str) -> None:
    """parallelism: ddp, fsdp, or hsdp (fsdp over groups of 2 ranks, replicated across them)."""
    dist = D.init(use_cuda=False)  # CPU tensors: gloo, whatever the machine has
    torch.set_num_threads(1)
    W = dist.world_size
    mine = slice(dist.rank * PROMPTS * G // W, (dist.rank + 1) * PROMPTS * G // W)
    # rank 0 in smaller micro-batches, so that the ranks' passes differ and fsdp's padding
    # runs (the gradient is the same sums in other pieces)
    cfg = load_config(None, {"micro_batch_size": 2 if dist.rank == 0 else 3, "beta": 0.1,
                             "group_size": G,
                             "max_new_tokens": 12, "use_amp": False}, env={})
    out = {}
    for family in ("gpt", "llama", "llama_lora", "gemma"):
        model = build(family)
        sharded = parallelism in ("fsdp", "hsdp") and W > 1
        if sharded:
            shard_size = 2 if parallelism == "hsdp" else 0
            net = fsdp.shard(model, torch.device("cpu"), shard_size=shard_size)
        else:
            net, _ = D.wrap_ddp(model, torch.device("cpu"))
        opt = make_optimizer(model, 1e-2)
        counts = []
        for step in range(1, 4):
            r, rewards, ref_lp = make_batch(seed=step)
            r, rewards, ref_lp = take(r, mine), rewards[mine], ref_lp[mine]
            traj = Trajectory.of(r, rewards, cfg, model)  # fsdp: padded to equal passes
            traj = traj.replace(ref_logp=ref_lp)
            counts.append(len(traj.plan))
            policy_pass(net, traj, cfg)
            fsdp.clip_grad_norm(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[family] = {k: v.clone() for k, v in fsdp.model_state(model).items()}
        if sharded:
            out[f"{family}/from_plain"] = resumed_from_plain(family)
            out[f"{family}/from_rank0"] = sent_from_rank0(model, family, dist.is_main)
            with torch.device("meta"):
                empty = build(family)
            ref = fsdp.frozen_copy(model, empty, torch.device("cpu"), shard_size=shard_size)
            assert not any(p.requires_grad for p in ref.parameters())
            out[f"{family}/reference"] = {k: v.clone() for k, v in fsdp.model_state(ref).items()}
            out[f"{family}/reference_bytes"] = D.all_gather_object(sum(
                t.numel() * t.element_size() for t in fsdp.local_params(ref.parameters())))
        out[f"{family}/memory"] = D.all_gather_object(fsdp.memory_report(model))
        out[f"{family}/passes"] = D.all_gather_object(counts)
        del net, opt  # DDP's reducer must not outlive the process group
        gc.collect()
    out["sft"] = sft_gradient(dist, parallelism)
    if dist.is_main:
        torch.save(out, out_path)
    D.cleanup()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
