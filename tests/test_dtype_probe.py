"""The fp32-vs-bf16 probe behind `auto` precision: a command times only what it runs, the
figures are cached per machine and model (the cache file is untrusted), explicit dtypes are
never probed, and ranks agree whether or not their caches hit."""

import json

import pytest
import torch
from conftest import tiny, tiny_gpt

from mini_grpo import distributed as D
from mini_grpo import dtype_probe, precision
from mini_grpo.config import load_config
from mini_grpo.precision import resolve_precision
from mini_grpo.run import setup

FIGURES = {"sample_bf16": 1.0, "sample_fp32": 2.0, "train_bf16": 3.0, "train_fp32": 4.0}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The cache file, relocated into tmp_path; `measure` replaced by a counter."""
    path = tmp_path / "cache" / "probe.json"
    monkeypatch.setenv("MINI_GRPO_PROBE_CACHE", str(path))
    calls = []

    def measure(model, parts, **shape):  # three rounds that agree
        calls.append(parts)
        return {k: [v, v * 0.9, v * 1.2] for k, v in FIGURES.items() if k.split("_")[0] in parts}

    monkeypatch.setattr(dtype_probe, "measure", measure)
    return path, calls


def test_second_call_reads_the_cache_and_other_parts_are_timed_apart(cache):
    path, calls = cache
    model, cfg = tiny_gpt(), load_config("tiny", env={})
    first = dtype_probe.probe_dtypes(model, cfg, ("sample",))
    assert first == {"sample_bf16": 1.0, "sample_fp32": 2.0} and calls == [("sample",)]
    assert dtype_probe.probe_dtypes(model, cfg, ("sample",)) == first and len(calls) == 1
    # a training command times training too: another key, timed once, the first entry kept
    assert dtype_probe.probe_dtypes(model, cfg, ("train", "sample")) == FIGURES
    assert dtype_probe.probe_dtypes(model, cfg, ("train", "sample")) == FIGURES
    assert calls == [("sample",), ("train", "sample")]
    assert len(json.loads(path.read_text())) == 2
    # another model is another key
    dtype_probe.probe_dtypes(tiny_gpt(vocab_size=30), cfg, ("sample",))
    assert len(calls) == 3


def test_a_capped_instruction_set_is_timed_apart(cache, monkeypatch):
    """ONEDNN_MAX_CPU_ISA on the same CPU runs other kernels (an AMX Xeon capped to
    AVX512_CORE_BF16 runs the Zen4's): its verdict is not the uncapped one's."""
    path, calls = cache
    model, cfg = tiny_gpt(), load_config("tiny", env={})
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    dtype_probe.probe_dtypes(model, cfg, ("sample",))
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    dtype_probe.probe_dtypes(model, cfg, ("sample",))
    dtype_probe.probe_dtypes(model, cfg, ("sample",))
    assert calls == [("sample",)] * 2 and len(json.loads(path.read_text())) == 2
    assert [json.loads(k)["isa"].get("ONEDNN_MAX_CPU_ISA") for k in
            json.loads(path.read_text())] == [None, "AVX512_CORE_BF16"]


def test_a_corrupt_or_foreign_cache_is_ignored_and_rewritten(cache):
    path, calls = cache
    model, cfg = tiny_gpt(), load_config("tiny", env={})
    shape = {"block_size": cfg.block_size, "bf16_attn": "manual",
             "sample_rows": min(64, cfg.prompts_per_step * cfg.group_size)}
    key = dtype_probe.cache_key(model, ("sample",), shape)
    path.parent.mkdir()
    for bad in [b"\xff\xfe not json", b"[" * 100_000, b"[1, 2]", b'{"k": 1}',
                json.dumps({key: {"sample_bf16": "fast", "sample_fp32": True}}).encode(),
                json.dumps({key: {"sample_bf16": -1.0, "sample_fp32": 1e999}}).encode(),
                json.dumps({key: {"sample_bf16": 1.0}}).encode(),  # a figure missing
                json.dumps({key: [1.0, 2.0]}).encode()]:
        path.write_bytes(bad)
        calls.clear()
        assert dtype_probe.probe_dtypes(model, cfg, ("sample",))["sample_fp32"] == 2.0
        assert calls == [("sample",)], bad[:40]
        assert json.loads(path.read_text())[key] == {"sample_bf16": 1.0, "sample_fp32": 2.0}
    # a path that cannot be read or written (a directory) costs the cache, not the run
    path.unlink()
    path.mkdir()
    calls.clear()
    dtype_probe.probe_dtypes(model, cfg, ("sample",))
    dtype_probe.probe_dtypes(model, cfg, ("sample",))
    assert calls == [("sample",)] * 2 and path.is_dir()
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind


def test_a_rank_whose_cache_hits_still_times_when_another_missed(cache, monkeypatch):
    """Every rank adds its miss flag to one all-reduce: one miss anywhere and all time, so
    the probe's own all-reduce is reached by every rank."""
    path, calls = cache
    model, cfg = tiny_gpt(), load_config("tiny", env={})
    dtype_probe.probe_dtypes(model, cfg, ("sample",))  # this rank's cache now hits
    other_rank = {"missed": True}

    def all_reduce_sum(t):  # another rank contributes: a miss, then its own figures
        if other_rank["missed"]:
            t[0] += 1
            other_rank["missed"] = False
        else:
            t += torch.tensor([10.0, 20.0, 0.0], dtype=t.dtype)  # its rounds agreed
        return t

    monkeypatch.setattr(D, "all_reduce_sum", all_reduce_sum)
    assert dtype_probe.probe_dtypes(model, cfg, ("sample",)) == {"sample_bf16": 11.0,
                                                                 "sample_fp32": 22.0}
    assert calls == [("sample",), ("sample",)]


def test_only_the_parts_still_auto_are_probed_and_sampling_commands_train_nothing(monkeypatch):
    monkeypatch.setattr(precision, "_cpu_has_bf16", lambda: True)
    cpu = torch.device("cpu")
    asked = []

    def probe(parts):
        asked.append(parts)
        return {k: v for k, v in FIGURES.items() if k.split("_")[0] in parts}

    def resolve(train=True, **over):
        asked.clear()
        p = resolve_precision(load_config("tiny", {k: str(v) for k, v in over.items()},
                                          env={}), cpu, probe, train)
        return asked[:], p.dtype, p.generation_dtype

    bf16 = torch.bfloat16
    assert resolve() == ([("train", "sample")], bf16, bf16)
    assert resolve(train=False) == ([("sample",)], None, bf16)  # sample, evaluate, rft-generate
    assert resolve(generation_amp="off") == ([("train",)], bf16, None)
    assert resolve(amp_dtype="bfloat16") == ([("sample",)], bf16, bf16)
    assert resolve(amp_dtype="bfloat16", generation_amp="on") == ([], bf16, bf16)
    assert resolve(amp_dtype="bfloat16", generation_amp="off", train=False) == ([], None, None)
    assert resolve(use_amp=False) == ([], None, None)
    monkeypatch.setattr(precision, "_cpu_has_bf16", lambda: False)
    assert resolve() == ([], None, None)  # no bf16 units: fp32, nothing to time


def test_sampling_alone_does_no_backward(monkeypatch):
    model = tiny_gpt().train()

    def no_backward(*a, **k):
        raise AssertionError("the sampling probe ran a backward pass")

    monkeypatch.setattr(torch.Tensor, "backward", no_backward)
    monkeypatch.setattr(torch.autograd, "backward", no_backward)
    figures = dtype_probe.measure(model, ("sample",), block_size=64, sample_rows=8, reps=2)
    assert set(figures) == {"sample_bf16", "sample_fp32"} and all(
        len(v) == 2 and min(v) > 0 for v in figures.values())
    assert model.training and all(p.grad is None for p in model.parameters())
    monkeypatch.undo()
    figures = dtype_probe.measure(model, ("train",), block_size=64, sample_rows=8, reps=1)
    assert set(figures) == {"train_bf16", "train_fp32"}
    assert all(p.grad is None for p in model.parameters())  # its gradients dropped


def test_setup_of_a_sampling_command_probes_sampling_once(tmp_path, cache, monkeypatch):
    _, calls = cache
    monkeypatch.setattr(precision, "_cpu_has_bf16", lambda: True)
    cfg = tiny(tmp_path / "run", use_amp=True, device="cpu")  # the probe is a CPU's
    for _ in range(2):
        with setup(cfg, log=False, train=False) as run:
            assert run.precision.dtype is None
            assert run.precision.generation_dtype == torch.bfloat16  # 1.0 s against 2.0
    assert calls == [("sample",)]
    with setup(cfg, log=False) as run:  # a training run times training as well
        assert run.precision.dtype == torch.bfloat16
    assert calls == [("sample",), ("train", "sample")]


def test_rounds_that_disagree_are_said_and_not_cached(cache, monkeypatch):
    """A busy machine fooled the first probe on the Xeon: when the rounds do not all find the
    same dtype faster, the median still decides this run, the log says so, and the next
    command times again instead of reusing a verdict measured under load."""
    path, calls = cache
    model, cfg = tiny_gpt(), load_config("tiny", env={})
    busy = {"sample_bf16": [1.0, 3.0, 1.1], "sample_fp32": [2.0, 2.0, 2.0]}  # bf16 lost round 2
    monkeypatch.setattr(dtype_probe, "measure", lambda model, parts, **shape: (
        calls.append(parts), busy)[1])
    figures = dtype_probe.probe_dtypes(model, cfg, ("sample",))
    assert figures == {"sample_bf16": 1.1, "sample_fp32": 2.0, "sample_disagreed": 1.0}
    assert not path.exists()
    dtype_probe.probe_dtypes(model, cfg, ("sample",))
    assert calls == [("sample",)] * 2  # timed again
    text = precision.Precision(torch.device("cpu"), None, torch.bfloat16, figures).describe()
    assert text == ("autocast fp32, sampling bfloat16 (probe: sample_bf16 1100.0 ms, "
                    "sample_fp32 2000.0 ms); the probe's rounds disagreed on sample (a busy "
                    "machine, or dtypes within noise): not cached, timed again by the next "
                    "command")
    busy["sample_bf16"][1] = 1.9  # the rounds agree: cached, and the log says nothing more
    figures = dtype_probe.probe_dtypes(model, cfg, ("sample",))
    assert figures == {"sample_bf16": 1.1, "sample_fp32": 2.0} and path.exists()
    assert "disagreed" not in precision.Precision(torch.device("cpu"), None, None,
                                                  figures).describe()


def test_lora_is_timed_apart_and_the_probe_leaves_the_global_rng_alone(tmp_path, monkeypatch):
    """A full fine-tune's cached verdict was reused for LoRA adapters on the same shape; and
    the probe's training passes drew dropout from the global RNG, so a run's dropout masks
    differed between a cache miss and a hit of the same config."""
    from mini_grpo.lora import apply_lora

    monkeypatch.setenv("MINI_GRPO_PROBE_CACHE", str(tmp_path / "probe.json"))
    cfg = load_config("tiny", env={})
    full = tiny_gpt()
    lora = tiny_gpt()
    apply_lora(lora, r=2, alpha=4.0, dropout=0.5)
    assert dtype_probe.cache_key(full, ("train",), {}) != \
        dtype_probe.cache_key(lora, ("train",), {})
    torch.manual_seed(0)
    before = torch.get_rng_state()
    dtype_probe.probe_dtypes(lora, cfg, ("train",))  # a miss: timed, dropout drawn
    assert torch.equal(torch.get_rng_state(), before)


def test_a_one_token_pass_without_a_mask_under_bf16_on_a_cpu_without_amx(monkeypatch):
    """SFT's pass over one-token rows (no mask, no cache) under bf16 where SDPA is skipped
    for decode steps (a CPU without AMX: the Zen4) reached the manual path with the mask
    "causal", a string: AttributeError."""
    import mini_grpo.models.core as core
    from mini_grpo.models import Llama, LlamaConfig
    from mini_grpo.sft import sft_loss

    monkeypatch.setattr(core, "_AMX", False)
    torch.manual_seed(0)
    m = Llama(LlamaConfig(vocab_size=32, block_size=64, n_layer=2, n_head=4, n_kv_head=2,
                          n_embd=64, n_inner=96, head_dim=16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = sft_loss(m, torch.tensor([[1], [2]]), torch.tensor([[5], [6]]))
    assert torch.isfinite(loss)
