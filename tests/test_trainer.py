"""End-to-end GRPO on the tiny config: parameters move, runs reproduce, resume is exact."""

import json
import re
import time
import warnings
from contextlib import nullcontext
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from conftest import events, metrics, tiny_gpt
from conftest import tiny as tiny_config

from mini_grpo.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from mini_grpo.engines.native import generate
from mini_grpo.job import train
from mini_grpo.reference import Reference
from mini_grpo.state import TrainState
from mini_grpo.trainer import TimeLimit
from mini_grpo.trajectory import MicroBatch


def tiny(tmp_path, name, **kw):
    return tiny_config(tmp_path / name, **kw)


def final_weights(cfg):
    path, state = latest_checkpoint(f"{cfg.out_dir}/checkpoints")
    return state


def test_few_steps_change_parameters_and_reproduce(tmp_path):
    # bit for bit on a CPU; on an H200 two runs differed by 1 ulp (CUDA's kernels are not all
    # deterministic)
    a = tiny(tmp_path, "a", max_steps=2, lr=1e-2, device="cpu")
    train(a)
    b = tiny(tmp_path, "b", max_steps=2, lr=1e-2, device="cpu")
    train(b)
    sa, sb = final_weights(a), final_weights(b)
    assert sa["step"] == 2
    torch.manual_seed(a.seed)  # the initial weights, as the trainer builds them
    from mini_grpo.models import build
    from mini_grpo.policy import gpt_spec
    init = build(gpt_spec(a, len(sa["tokenizer"]) + 4)).state_dict()
    moved = [k for k in init if not torch.equal(init[k], sa["model"][k])]
    assert moved, "no parameter changed"
    for k in sa["model"]:
        assert torch.equal(sa["model"][k], sb["model"][k]), k
    lines = (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
    assert any('"reward/mean"' in line for line in lines)
    ev = json.loads((tmp_path / "a" / "eval.json").read_text())
    assert set(ev) == {"before", "after", "baselines"}
    assert ev["baselines"]["empty"] == 0.0 and 0.3 < ev["baselines"]["start_fen"] < 0.5
    assert ev["after"]["greedy"]["n"] == a.num_eval
    assert (tmp_path / "a" / "config.yaml").is_file()


def test_resume_gives_the_same_weights_as_a_straight_run(tmp_path):
    # bit for bit is promised for fp32 on a CPU; CUDA's kernels are not all deterministic
    opts = {"max_steps": 4, "save_every": 2, "lr": 1e-2, "device": "cpu"}
    straight = tiny(tmp_path, "s", **opts)
    train(straight)
    resumed = tiny(tmp_path, "r", **opts)
    train(resumed)
    ckpts = list_checkpoints(f"{resumed.out_dir}/checkpoints")
    assert [p.name for p in ckpts] == ["step_0000002.pt", "step_0000004.pt"]
    ckpts[-1].unlink()  # as if killed after step 2's checkpoint
    train(resumed)
    s, r = final_weights(straight), final_weights(resumed)
    assert r["step"] == 4
    for k in s["model"]:
        assert torch.equal(s["model"][k], r["model"][k]), k
    for a, b in zip(s["optimizer"]["state"].values(), r["optimizer"]["state"].values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"])


def test_truncated_checkpoint_is_skipped_with_a_warning(tmp_path):
    cfg = tiny(tmp_path, "t", max_steps=4, save_every=2)
    train(cfg)
    newest = list_checkpoints(f"{cfg.out_dir}/checkpoints")[-1]
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])
    with pytest.warns(UserWarning, match="skipping corrupt checkpoint"):
        path, state = latest_checkpoint(f"{cfg.out_dir}/checkpoints")
    assert state["step"] == 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(cfg)  # resumes from step 2 and finishes
    assert load_checkpoint(list_checkpoints(f"{cfg.out_dir}/checkpoints")[-1])["step"] == 4


def test_a_junk_newest_checkpoint_costs_no_good_one(tmp_path):
    """keep_checkpoints 1 with a junk step 9 beside good step 4: the run resumes from 4, and
    retention keeps its newest good checkpoint (not the junk alone, as it did)."""
    cfg = tiny(tmp_path, "j", max_steps=4, save_every=1, keep_checkpoints=1)
    train(cfg)
    directory = f"{cfg.out_dir}/checkpoints"
    (tmp_path / "j" / "checkpoints" / "step_0000009.pt").write_bytes(b"junk")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(tiny(tmp_path, "j", max_steps=6, save_every=1, keep_checkpoints=1))
    assert any("skipping corrupt checkpoint" in str(w.message) for w in caught)
    assert [p.name for p in list_checkpoints(directory)] == ["step_0000006.pt",
                                                             "step_0000009.pt"]
    assert load_checkpoint(f"{directory}/step_0000006.pt")["step"] == 6
    with open(f"{cfg.out_dir}/metrics.jsonl") as f:
        steps = [json.loads(line)["step"] for line in f if "reward/mean" in line]
    assert steps == [1, 2, 3, 4, 5, 6]  # resumed from 4, nothing run twice


def test_max_minutes_ends_grpo_early_with_a_checkpoint_and_the_final_evaluation(tmp_path,
                                                                                capsys):
    # a limit long past when GRPO starts: its first step is taken, then no other fits
    cfg = tiny(tmp_path, "m", max_steps=4, save_every=3, max_minutes=1e-4, device="cpu")
    train(cfg)
    # the progress line's ETA is the limit's, not that of the 3 steps max_steps has left
    assert "step 1/4 " in (out := capsys.readouterr().out) and "ETA 0.0m (max_minutes)" in out
    assert [p.name for p in list_checkpoints(f"{cfg.out_dir}/checkpoints")] == \
        ["step_0000001.pt"]
    rows = metrics(cfg.out_dir)
    steps = [r for r in rows if "reward/mean" in r]
    assert [(r["step"], r["time/limit_reached"]) for r in steps] == [(1, 1.0)]
    assert [s for s, e in events(cfg.out_dir) if e.startswith("max_minutes: GRPO stops")] == [1]
    after = [r["step"] for r in rows if "eval_greedy/reward" in r]
    assert after == [0, 1]  # before GRPO, then the final evaluation at the last step taken
    assert set(json.loads((tmp_path / "m" / "eval.json").read_text())) == \
        {"before", "after", "baselines"}
    # without a limit the same run takes every step and logs no verdict
    full = tiny(tmp_path, "f", max_steps=2, device="cpu")
    train(full)
    steps = [r for r in metrics(full.out_dir) if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2] and "time/limit_reached" not in steps[0]


def test_the_last_step_is_logged_whatever_log_every(tmp_path):
    """log_every 4: steps 4 and the last, 5, as SFT logs its last; a run the time limit
    ends at step 1 logs that step, with its time/limit_reached."""
    cfg = tiny(tmp_path, "l", max_steps=5, log_every=4, device="cpu")
    train(cfg)
    assert [r["step"] for r in metrics(cfg.out_dir) if "reward/mean" in r] == [4, 5]
    assert list_checkpoints(f"{cfg.out_dir}/checkpoints")[-1].name == "step_0000005.pt"
    cut = tiny(tmp_path, "c", max_steps=5, log_every=4, max_minutes=1e-4, device="cpu")
    train(cut)
    assert [(r["step"], r["time/limit_reached"]) for r in metrics(cut.out_dir)
            if "reward/mean" in r] == [(1, 1.0)]


def test_a_time_limit_takes_a_step_only_if_the_slowest_recent_one_still_fits(monkeypatch):
    now = 1000.0  # a clock that stands still: what is left is exact
    monkeypatch.setattr(time, "monotonic", lambda: now)
    limit = TimeLimit(end=now + 100.0, reserve=10.0)
    assert limit.next_fits(5.0)  # ~now + 5 + 10 <= now + 100
    assert limit.left() == 90.0  # what GRPO has left: the limit less the reserve
    assert not limit.next_fits(95.0)
    assert not limit.next_fits(1.0)  # the 95 s step is still among the last three
    assert not limit.next_fits(1.0)
    assert limit.next_fits(1.0)  # it has dropped out
    assert "~1 s" in limit.why() and "10 s kept" in limit.why()


def test_offloaded_reference_gives_the_same_logprobs():
    m = tiny_gpt()
    r = generate(m, [[1, 5, 6], [1, 7]], 10, 2, 0, generator=torch.Generator().manual_seed(0))
    mb = MicroBatch(torch.arange(2), r.prompt_ids, r.prompt_mask, torch.arange(2),
                    r.completion_ids, r.completion_mask, r.completion_mask,
                    r.sampling.temperature)
    plain = Reference(m, torch.device("cpu"), offload=False).logprobs(mb)
    offloaded = Reference(m, torch.device("cpu"), offload=True).logprobs(mb)
    torch.testing.assert_close(plain, offloaded, rtol=0, atol=0)
    torch.testing.assert_close(plain, r.logprobs, rtol=0, atol=1e-5)


def test_evaluate_and_sample_commands_on_a_checkpoint(tmp_path, capsys):
    from mini_grpo.cli import main

    cfg = tiny(tmp_path, "c", max_steps=1)
    train(cfg)
    ckpt = str(list_checkpoints(f"{cfg.out_dir}/checkpoints")[-1])
    capsys.readouterr()
    assert main(["sample", "--checkpoint", ckpt, "--prompt", "e2e4 e7e5:", "--n", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(line.startswith("e2e4 e7e5: ") for line in lines)
    assert main(["evaluate", "--checkpoint", ckpt, "--json", str(tmp_path / "ev.json")]) == 0
    out = capsys.readouterr().out
    assert "greedy" in out and "valid_fen" in out
    assert (tmp_path / "ev.json").is_file()
    assert main(["sample", "--checkpoint", ckpt, "--prompt", "e2e4 Z:"]) == 2
    assert main(["evaluate", "--checkpoint", str(tmp_path / "missing.pt")]) == 2


def test_sft_then_grpo_under_bf16_autocast_runs_and_lowers_the_sft_loss(tmp_path):
    cfg = tiny(tmp_path, "bf16", mode="sft_grpo", use_amp=True, amp_dtype="bfloat16",
               sft_steps=30, sft_lr=3e-3, max_steps=1, log_every=1)
    train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "bf16" / "metrics.jsonl").open()]
    sft_loss = [r["sft/loss"] for r in rows if "sft/loss" in r]
    assert len(sft_loss) == 30 and sft_loss[-1] < 0.8 * sft_loss[0]
    assert any("reward/mean" in r for r in rows)


def test_micro_batch_plan_sorts_by_length():
    from mini_grpo.plan import plan_micro_batches

    lengths = [30, 100, 31, 98, 60, 101, 29, 62, 99, 61, 30, 100]
    plan = plan_micro_batches(lengths, size=4)
    assert [len(b) for b in plan] == [4, 4, 4]
    assert sorted(i for b in plan for i in b) == list(range(len(lengths)))  # each row once
    # slicing in order would push 3 x 4 x 101 = 1212 columns for these 801 real ones
    assert [sorted(lengths[i] for i in b) for b in plan] == [
        [29, 30, 30, 31], [60, 61, 62, 98], [99, 100, 100, 101]]
    assert plan_micro_batches([5, 3, 4], size=2) == [[1, 2], [0]]


def test_row_batches_pick_the_plan_that_pushes_fewer_tokens():
    from conftest import rows_rollout as rollout

    from mini_grpo.plan import row_batches

    # 4 groups of 2 rows whose completions are alike: whole groups, every prompt once;
    # group 1 is left out (no tokens), group 3 has the longest completions
    r, cmask = rollout([2, 2, 0, 0, 1, 1, 3, 3])
    assert [b.tolist() for b in row_batches(r.prompt_mask, cmask, 4, 2)] == [[4, 5, 0, 1], [6, 7]]
    # 3 rows at most: three whole groups push 3 + 5 + 7 positions; two micro-batches of
    # rows by length push 9 + 12, which wins once a pass's fixed cost counts
    assert [b.tolist() for b in row_batches(r.prompt_mask, cmask, 3, 2, pass_cost=0)] == [
        [4, 5], [0, 1], [6, 7]]
    assert [b.tolist() for b in row_batches(r.prompt_mask, cmask, 3, 2, pass_cost=10)] == [
        [4, 5, 0], [1, 6, 7]]
    assert [b.tolist() for b in row_batches(r.prompt_mask, torch.zeros_like(cmask), 4, 2)] == [[0]]
    # one long completion in each group: sorting rows by length pads far less, even though
    # each micro-batch then computes both prompts
    r, cmask = rollout([1, 20, 2, 19, 1, 21, 2, 20])
    plan = [b.tolist() for b in row_batches(r.prompt_mask, cmask, 4, 2)]
    assert [sorted(b) for b in plan] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def bf16_rollout(m, cfg, new_tokens):
    """Two prompts x 4 rows of `m` sampled under bf16 autocast, and their trajectory."""
    from mini_grpo.trajectory import Trajectory

    prompts = [[1, 5, 6, 7]] * 4 + [[1, 8, 9]] * 4
    with torch.autocast("cpu", dtype=torch.bfloat16):
        r = generate(m, prompts, new_tokens, 2, 0, temperature=cfg.temperature,
                     generator=torch.Generator().manual_seed(0))
    return r, Trajectory.of(r, torch.tensor([0.0, 1, 0.5, 0.2, 1, 0, 0, 0.3]), cfg)


def test_first_pass_ratio_is_exactly_one_under_autocast_and_dropout():
    """num_iterations > 1: the old log-probs are the first pass's own, not the ones recorded
    while sampling (other kernels, eval mode), so a policy that has not moved is not clipped."""
    from mini_grpo.models import GPT, GPTConfig
    from mini_grpo.trainer import policy_pass

    cfg = tiny_config(None, num_iterations=2, use_amp=True, amp_dtype="bfloat16",
                      micro_batch_size=4)
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=24, block_size=64, n_layer=2, n_head=2, n_embd=32,
                      dropout=0.1))
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    r, traj = bf16_rollout(m, cfg, 12)
    traj = traj.replace(ref_logp=torch.zeros(r.completion_ids.shape))
    m.train()
    state = SimpleNamespace(autocast=bf16, backward=torch.Tensor.backward,
                            cast_once=lambda net: nullcontext())
    acc, old = policy_pass(m, traj, cfg, state)
    tokens = traj.num_tokens.item()
    assert acc.ratio.item() / tokens == 1.0  # the mean ratio, exactly
    assert acc.clip_low.item() == 0 and acc.clip_high.item() == 0  # nothing clipped
    assert traj.old_logp is None  # the record is as it was built: the old ones come back
    mask = traj.loss_mask
    assert not torch.equal(old[mask], r.logprobs[mask])  # what the old code used differs
    traj2 = traj.replace(old_logp=old)
    acc2, again = policy_pass(m, traj2, cfg, state)  # the second pass reuses them
    assert again is old
    assert acc2.ratio.item() / tokens != 1.0  # dropout: a fresh pass is not the same


def test_resume_refuses_what_cannot_work_and_logs_what_changed(tmp_path):
    from mini_grpo.checkpoint import CheckpointError
    from mini_grpo.config import ConfigError

    run = tmp_path / "r"
    train(tiny(tmp_path, "r", max_steps=2, save_every=2))
    saved = (run / "config.yaml").read_text()
    with pytest.raises(ConfigError, match=r"cannot resume with a different n_embd \(32 -> 64\)"):
        train(tiny(tmp_path, "r", max_steps=4, n_embd=64))
    assert (run / "config.yaml").read_text() == saved  # the refused run changed nothing
    with pytest.raises(ConfigError, match="max_steps: 1 is below the step of the checkpoint"):
        train(tiny(tmp_path, "r", max_steps=1))
    train(tiny(tmp_path, "r", max_steps=3, lr=1e-3))
    changed = [e for _, e in events(run) if e.startswith("resumed with changed options")]
    assert len(changed) == 1 and "lr 3e-05 -> 0.001" in changed[0]
    assert "max_steps 2 -> 3" in changed[0]
    # a checkpoint whose state cannot be restored: the error names its file
    bad = load_checkpoint(run / "checkpoints" / "step_0000002.pt")
    bad["rng"] = [{"torch": torch.zeros(3, dtype=torch.uint8)}]
    torch.save(bad, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match=re.escape(f"{tmp_path / 'bad.pt'}: cannot "
                                                        f"restore its RNG state's 'torch'")):
        train(tiny(tmp_path, "b", max_steps=3, resume=str(tmp_path / "bad.pt")))
    # an SFT checkpoint is a starting point, not a GRPO run to continue
    train(tiny(tmp_path, "s", mode="sft", sft_steps=2))
    with pytest.raises(CheckpointError, match="--init_from="):
        train(tiny(tmp_path, "g", resume=str(tmp_path / "s" / "sft" / "step_0000002.pt")))


@pytest.mark.parametrize("checkpointing,tied", [(False, True), (True, True), (False, False)])
def test_weights_cast_once_a_pass_give_autocasts_gradients_bit_for_bit(checkpointing, tied):
    """precision.linear_weights_cast_once: a pass casts the Linear weights to bf16 once, not
    once a micro-batch, and adds each copy's gradient into the fp32 one as autocast's cast-back
    and accumulation did: the same gradients, bit for bit, over several micro-batches, with
    activation checkpointing too; afterwards the model holds its own parameters again. The LM
    head, tied or its own, is left to the chunked head's cast (its gradient summed in fp32)."""
    from mini_grpo.models.llama import Llama, LlamaConfig
    from mini_grpo.precision import linear_weights_cast_once
    from mini_grpo.trainer import policy_pass

    cfg = tiny_config(None, use_amp=True, amp_dtype="bfloat16", micro_batch_size=2, beta=0.0,
                      gradient_checkpointing=checkpointing)
    torch.manual_seed(0)
    m = Llama(LlamaConfig(vocab_size=48, block_size=64, n_layer=2, n_head=4, n_kv_head=2,
                          n_embd=64, head_dim=16, n_inner=128, tie_word_embeddings=tied))
    m.gradient_checkpointing = checkpointing
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    _, traj = bf16_rollout(m, cfg, 10)
    assert len(traj.micro_batches()) >= 3
    m.train()
    params = dict(m.named_parameters())
    grads = {}
    for once in (False, True):
        m.zero_grad(set_to_none=True)
        state = SimpleNamespace(model=m if once else None, guard=SimpleNamespace(amp=True),
                                precision=SimpleNamespace(dtype=torch.bfloat16),
                                autocast=bf16, backward=torch.Tensor.backward)
        state.cast_once = partial(TrainState.cast_once, state)
        policy_pass(m, traj, cfg, state)
        grads[once] = {k: p.grad.clone() for k, p in m.named_parameters()}
        assert dict(m.named_parameters()) == params  # the same Parameter objects
    assert grads[True].keys() == grads[False].keys()
    for k, g in grads[False].items():
        assert g.dtype == torch.float32 and torch.equal(grads[True][k], g), k
    # a plain Linear's weight is a bf16 copy within; the head's stays the fp32 Parameter
    inner = m.layers[0].mlp.up_proj
    with linear_weights_cast_once(m, torch.bfloat16):
        assert inner.weight.dtype == torch.bfloat16 and m.lm_head.weight.dtype == torch.float32
    assert inner.weight is params["layers.0.mlp.up_proj.weight"]
