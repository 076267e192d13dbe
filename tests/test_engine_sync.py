"""The engine owns its weights' version: a sync with the weights unchanged since the last one
sends nothing (engines.base.WeightsSeen), so the trainer needs no flag of its own and a GRPO
stage pushes each version of the weights once."""

import copy
from types import SimpleNamespace

import torch
from conftest import tiny, tiny_gpt

import mini_grpo.run as run_module
from mini_grpo.engines.base import WeightsSeen
from mini_grpo.engines.client import ServerEngine
from mini_grpo.engines.native import NativeEngine
from mini_grpo.engines.vllm import VLLMEngine
from mini_grpo.job import train
from mini_grpo.optim import make_optimizer


def test_weights_seen_moves_with_every_write_and_nothing_else():
    m = tiny_gpt()
    seen = WeightsSeen()
    assert seen.changed(m)  # never synced
    seen.mark(m)
    assert not seen.changed(m)
    m(torch.tensor([[1, 2, 3]]))  # a forward pass writes no weight
    for fused in (True, False):  # the fused kernel moves no version counter by itself
        opt = make_optimizer(m, 1e-2, fused=fused)
        opt.zero_grad()  # a skipped step: no update
        assert not seen.changed(m)
        m(torch.tensor([[1, 2, 3]])).float().sum().backward()
        opt.step()
        assert seen.changed(m)
        seen.mark(m)
    seen.mark(m)
    m.load_state_dict(copy.deepcopy(m.state_dict()))  # a restore copies into the weights
    assert seen.changed(m)
    seen.mark(m)
    m.lm_head.weight = torch.nn.Parameter(m.lm_head.weight.detach().clone())  # replaced
    assert seen.changed(m)
    assert seen.changed(tiny_gpt(seed=1))  # another model


class FakeLLM:
    def __init__(self):
        self.reloads = 0

    def collective_rpc(self, name, kwargs):
        assert name == "reload_weights"
        sum(1 for _ in kwargs["weights_iterator"])  # the weights are consumed, as vLLM does
        self.reloads += 1

    def reset_prefix_cache(self):
        pass


def test_vllm_sync_sends_only_changed_weights():
    """The colocated engine's own sync (vLLM replaced by a counter): a second sync with the
    same weights reloads nothing; an update makes the next one reload."""
    from mini_grpo.models import Llama, LlamaConfig

    torch.manual_seed(0)
    m = Llama(LlamaConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_kv_head=2,
                          n_embd=64, head_dim=32, n_inner=128))
    engine = object.__new__(VLLMEngine)  # no vLLM started: only what sync uses
    engine.llm, engine.asleep, engine.dtype, engine.weights = FakeLLM(), False, \
        torch.float32, WeightsSeen()
    engine.device = torch.device("cpu")
    engine.sync(m)
    engine.sync(m)
    assert engine.llm.reloads == 1
    with torch.no_grad():
        next(m.parameters()).add_(1.0)
    engine.sync(m)
    engine.sync(m)
    assert engine.llm.reloads == 2


def test_server_sync_sends_only_changed_weights(monkeypatch):
    engine = object.__new__(ServerEngine)
    engine.rank, engine.weights, pushes = 0, WeightsSeen(), []
    engine.device = torch.device("cpu")
    monkeypatch.setattr(engine, "_push", lambda model: pushes.append(1), raising=False)
    m = tiny_gpt()
    engine.sync(m)
    engine.sync(m)
    assert len(pushes) == 1
    with torch.no_grad():
        m.lm_head.weight.mul_(2)
    engine.sync(m)
    assert len(pushes) == 2


class Counting(NativeEngine):
    """The native engine with a copy's bookkeeping: counts the pushes a real copy would get."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.weights, self.pushes = WeightsSeen(), 0

    def sync(self, model) -> None:
        if self.weights.changed(model):
            self.pushes += 1
            self.weights.mark(model)


def test_a_grpo_stage_pushes_each_version_of_the_weights_once(tmp_path, monkeypatch):
    """SFT, then the evaluation before GRPO, 3 steps with an evaluation after step 2, and
    the final one: the engine samples from 4 versions (after SFT, after each update) and
    gets each once; the trainer's own flag used to push the first one twice."""
    made = []

    def make_engine(cfg, model, tok, device, dist, max_len=None, tools=None):
        made.append(Counting(model, tok, cfg.kv_cache))
        return made[-1]

    monkeypatch.setattr(run_module, "make_engine", make_engine)
    train(tiny(tmp_path, mode="sft_grpo", sft_steps=2, max_steps=3, eval_every=2,
               save_every=100))
    assert made[0].pushes == 4


def test_rank0_with_weights_syncs_and_says_which_rank_works():
    synced = []
    run = SimpleNamespace(sync_engine=lambda: synced.append(1), model=tiny_gpt(),
                          dist=SimpleNamespace(is_main=True))
    with run_module.Run.rank0_with_weights(run) as main:
        assert main and synced == [1]


def test_a_step_the_fp16_scaler_skips_moves_no_version():
    """GradScaler hands the fused kernel `found_inf`, and the kernel skips the update: the
    weights did not change, so an engine has nothing to sync."""
    m = tiny_gpt()
    opt = make_optimizer(m, 1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu")
    seen = WeightsSeen()
    seen.mark(m)
    scaler.scale(m(torch.tensor([[1, 2, 3]])).float().sum() * float("inf")).backward()
    before = [p.detach().clone() for p in m.parameters()]
    scaler.step(opt)
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
    assert not seen.changed(m)
    opt.zero_grad()
    scaler.update()
    scaler.scale(m(torch.tensor([[1, 2, 3]])).float().sum()).backward()
    scaler.step(opt)
    assert seen.changed(m)
