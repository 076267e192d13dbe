"""Precision and speed switches: each one on and off gives a working tiny run."""

import os
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import metrics, tiny, tiny_lm_dir

from mini_grpo.checkpoint import latest_checkpoint
from mini_grpo.config import ConfigError, load_config
from mini_grpo.job import train
from mini_grpo.models import build
from mini_grpo.policy import gpt_spec
from mini_grpo.precision import compile_with_fallback, resolve_device, resolve_precision


def sft_losses(out_dir, steps=16, **kw):
    """The SFT stage's loss at every step, as the trainer logs it, under kw's precision."""
    train(tiny(out_dir, mode="sft", sft_steps=steps, sft_lr=6e-3, log_every=1, **kw))
    return [r["sft/loss"] for r in metrics(out_dir) if "sft/loss" in r]


def test_bf16_autocast_loss_tracks_fp32(tmp_path):
    fp32 = sft_losses(tmp_path / "fp32", use_amp=False)
    bf16 = sft_losses(tmp_path / "bf16", use_amp=True, amp_dtype="bfloat16")
    assert len(fp32) == len(bf16) == 16
    # stated tolerance: within 3% of the fp32 loss at every one of 16 steps
    for a, b in zip(fp32, bf16):
        assert abs(a - b) / a < 0.03, (fp32, bf16)
    assert fp32[-1] < 0.8 * fp32[0]  # and both actually train


def test_fp16_with_grad_scaler(tmp_path):
    cfg = tiny(tmp_path, use_amp=True, amp_dtype="float16")
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            torch.ones(2, 2) @ torch.ones(2, 2)
    except RuntimeError as e:
        pytest.skip(f"this CPU build has no float16 autocast: {e}")
    assert resolve_precision(cfg, torch.device("cpu")).scaler().is_enabled()
    losses = sft_losses(tmp_path / "fp16", use_amp=True, amp_dtype="float16")
    fp32 = sft_losses(tmp_path / "fp32", use_amp=False)
    assert all(abs(a - b) / a < 0.05 for a, b in zip(fp32, losses)), (fp32, losses)


@pytest.mark.parametrize("switch, value", [
    ("use_amp", True), ("use_tf32", False), ("gradient_checkpointing", True),
    ("fused_optimizer", False), ("offload_reference", True), ("reward_executor", "process"),
    ("generation_amp", "off"), ("attn_impl", "sdpa"),
])
def test_each_switch_gives_a_working_run(tmp_path, switch, value):
    cfg = tiny(tmp_path / "run", max_steps=2, **{switch: value})
    train(cfg)
    _, state = latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert state["step"] == 2 and state["config"][switch] == value
    assert all(torch.isfinite(p).all() for p in state["model"].values())


def test_compile_switch_trains_lora_adapters_as_eager_does(tmp_path):
    # one process, compiled, on LoRA's adapters (torchrun, fsdp and our GPT compile in
    # tests/test_fsdp.py): the same step as eager, gradient included
    lm = tiny_lm_dir(tmp_path / "lm")
    steps = {}
    for compiled in (False, True):
        out = tmp_path / str(compiled)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(tiny(out, compile_model=compiled, max_steps=1, init_from=str(lm), lora_r=4,
                       block_size=256, max_new_tokens=12, eval_every=100))
        assert not [w for w in caught if "uncompiled" in str(w.message)]  # it did compile
        steps[compiled] = [r for r in metrics(out) if "time/step" in r]
    _, state = latest_checkpoint(tmp_path / "True" / "checkpoints")
    assert state["step"] == 1 and state["lora"]["r"] == 4
    for eager, compiled in zip(steps[False], steps[True], strict=True):
        for key in ("loss", "grad_norm", "reward/mean"):
            assert abs(compiled[key] - eager[key]) <= 1e-4, (key, eager[key], compiled[key])


def test_compile_failure_falls_back_to_eager_with_one_warning(monkeypatch):
    def broken_compile(model, **kw):
        def run(*a, **k):
            raise RuntimeError("backend exploded")
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    torch.manual_seed(0)
    model = build(gpt_spec(load_config("tiny", env={}), 40))
    wrapped = compile_with_fallback(model)
    idx = torch.randint(4, 40, (2, 8))
    with pytest.warns(UserWarning, match="backend exploded") as rec:
        out = wrapped(idx)
        wrapped(idx)
    assert len(rec) == 1
    torch.testing.assert_close(out, model(idx))


_MALLINFO = r"""
import ctypes, sys, torch
from mini_grpo.precision import keep_freed_memory
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
took = keep_freed_memory() if sys.argv[1] == "on" else False
x = torch.ones(8 * 2**20)  # 32 MiB: glibc maps blocks this big from the OS by default
mapped = libc.mallinfo2().hblkhd  # bytes in blocks mapped from the OS
y = torch.ones(32 * 2**20)  # 128 MiB: above KEEP_BELOW, mapped even when kept
print(took, mapped >= 32 * 2**20, libc.mallinfo2().hblkhd - mapped >= 128 * 2**20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_cpu_malloc_cache_serves_big_tensors_from_the_heap():
    def run(mode):
        r = subprocess.run([sys.executable, "-c", _MALLINFO, mode], capture_output=True,
                           text=True, timeout=120)
        if "mallinfo2" in r.stderr:
            pytest.skip("glibc without mallinfo2")
        assert r.returncode == 0, r.stderr
        return r.stdout.split()
    # default glibc: the 32 MiB tensor is its own mapping (page faults on every fresh one)
    assert run("off") == ["False", "True", "True"]
    # kept: it comes from the heap, which freed blocks go back to for the next allocation;
    # a block from KEEP_BELOW up is still mapped, so it leaves no hole in the heap
    assert run("on") == ["True", "False", "True"]


_HUGE = r"""
import mini_grpo, torch
x = torch.ones(16 * 2**20)  # 64 MiB, every page written
with open("/proc/self/smaps_rollup") as f:
    huge = next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages"))
print(huge // 1024)
"""


def thp_mode():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


@pytest.mark.skipif(thp_mode() not in ("madvise", "always"), reason="no transparent huge pages")
def test_importing_mini_grpo_puts_big_cpu_tensors_on_huge_pages():
    """PyTorch's allocator reads THP_MEM_ALLOC_ENABLE at its first allocation: mini_grpo's
    import sets it first, and a user's own setting wins."""
    def huge_mib(value):  # None: the variable unset, as a user starts a run
        env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
        r = subprocess.run([sys.executable, "-c", _HUGE], capture_output=True, text=True,
                           timeout=120, env=env if value is None else
                           {**env, "THP_MEM_ALLOC_ENABLE": value})
        assert r.returncode == 0, r.stderr
        return int(r.stdout)
    on = huge_mib(None)
    assert on >= 60, on  # the 64 MiB tensor on huge pages
    if thp_mode() == "madvise":  # only asked-for regions get them: the user's 0 is kept
        assert huge_mib("0") < 60


_TRIM = r"""
import os, torch
from mini_grpo.precision import keep_freed_memory, release_freed_memory
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
assert keep_freed_memory()
x = torch.ones(12 * 2**20)  # 48 MiB (below KEEP_BELOW: in the heap), every page written
y = torch.arange(1000.0)  # above it in the heap: x's block is a hole, not the heap's top
del x
kept = rss()
released = release_freed_memory(torch.device("cpu"))
print(released, round(kept - rss()), release_freed_memory(torch.device("meta")),
      float(y.sum()))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_freed_heap_blocks_stop_counting_once_released():
    """cpu_malloc_cache keeps a freed block's pages resident (fast reuse, but what the next
    phase cannot fit stays in RSS); release_freed_memory hands the pages back, keeps the
    block, and leaves live tensors alone. Not on a device other than the CPU."""
    r = subprocess.run([sys.executable, "-c", _TRIM], capture_output=True, text=True,
                       timeout=120)
    if "malloc_trim" in r.stderr or "AssertionError" in r.stderr:
        pytest.skip("not glibc")
    assert r.returncode == 0, r.stderr
    released, freed_mb, other_device, total = r.stdout.split()
    assert released == "True" and int(freed_mb) >= 40, r.stdout  # of the 48 MiB hole
    assert other_device == "False" and float(total) == 499500.0


_STAGES = r"""
import gc, sys, weakref
sys.path.insert(0, sys.argv[1])
from conftest import tiny
from mini_grpo import job, trainer
from mini_grpo.state import TrainState
gc.disable()  # Python's own collections come at no fixed time: only the run's may free it
states, alive = [], []
init = TrainState.__init__
def spy(self, *a, **k):
    init(self, *a, **k)
    states.append(weakref.ref(self))
TrainState.__init__ = spy
policy_pass = trainer.policy_pass
def first_pass(*a, **k):
    if not alive:  # GRPO's first pass: which stages' states (optimizer, gradients) live
        alive.append([r() is not None for r in states])
    return policy_pass(*a, **k)
trainer.policy_pass = first_pass
finish = job.finish
def final(*a, **k):  # the final evaluation: no stage's state is of use any more
    alive.append([r() is not None for r in states])
    return finish(*a, **k)
job.finish = final
job.train(tiny(sys.argv[2], mode="rft_grpo", max_steps=1, rft_sft_steps=1,
               rft_num_prompts=4, rft_min_reward=-100))
print(alive)
"""


def test_a_finished_stage_is_freed_before_the_next_starts(tmp_path):
    """The first optimizer a process builds imports torch._dynamo, whose torch.fx keeps its
    own frame, and with it every frame below: RFT's SFT stage (its AdamW state and
    gradients, 1.5 GiB on SmolLM2-135M) lived into GRPO until Python's next full collection.
    In a fresh process (the import happens once), with Python's collections off, GRPO's
    first pass finds the SFT stage's state freed and its own alive; the final evaluation
    finds GRPO's freed too (the calculator job's peak was set there: AdamW's moments beside
    the evaluation's KV caches)."""
    r = subprocess.run([sys.executable, "-c", _STAGES, os.path.dirname(__file__),
                        str(tmp_path / "run")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    alive = r.stdout.strip().splitlines()[-1]
    assert alive == "[[False, True], [False, False]]", \
        f"alive (SFT, GRPO) at GRPO's first pass, then at the final evaluation: {alive}"


def test_auto_precision_follows_the_probe_not_the_device_type(monkeypatch):
    """On a CPU with bf16 units, `auto` takes whichever dtype the probe timed faster, for
    training and sampling apart (a Zen4 sampled 1.5x slower in bf16, an AMX Xeon faster)."""
    from mini_grpo import precision

    monkeypatch.setattr(precision, "_cpu_has_bf16", lambda: True)
    cpu = torch.device("cpu")
    for figures, want in [
        ({"train_bf16": 1.0, "train_fp32": 2.0, "sample_bf16": 3.0, "sample_fp32": 2.0},
         (torch.bfloat16, None)),
        ({"train_bf16": 2.0, "train_fp32": 1.0, "sample_bf16": 1.0, "sample_fp32": 2.0},
         (None, torch.bfloat16))]:
        p = resolve_precision(load_config("tiny", env={}), cpu, lambda parts, f=figures: f)
        assert (p.dtype, p.generation_dtype) == want and p.probe == figures
        assert "probe: " in p.describe()
    # an explicit choice is never probed or overridden
    p = resolve_precision(load_config("tiny", {"amp_dtype": "bfloat16",
                                               "generation_amp": "off"}, env={}), cpu,
                          lambda parts: pytest.fail("probed"))
    assert (p.dtype, p.generation_dtype) == (torch.bfloat16, None)


def test_each_rank_gets_a_gpu_of_its_own_or_a_one_line_error(monkeypatch):
    """torchrun with more processes per node than GPUs: CUDA's "invalid device ordinal" at
    the first rank past the last GPU (seen on a one-GPU machine) becomes the config error."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device(tiny(), 1) == torch.device("cuda:1")
    for device in ("auto", "cuda"):
        with pytest.raises(ConfigError, match=rf"device: {device}: local rank 2 has no GPU of "
                           r"its own \(this node has 2\); start at most 2 processes per node"):
            resolve_device(tiny(device=device), 2)
    assert resolve_device(tiny(device="cpu"), 2) == torch.device("cpu")  # gloo, no GPU asked
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(tiny(), 3) == torch.device("cpu")
    with pytest.raises(ConfigError, match="device: cuda asked for, but CUDA is not available"):
        resolve_device(tiny(device="cuda"), 0)


def test_a_cpu_run_caps_onednns_caches_unless_the_user_set_them(monkeypatch):
    """Each new matmul shape kept a oneDNN primitive (up to 1024): the LM job grew ~0.3 GB a
    step. A CPU run caps both caches before its first matmul; a user's own value stands."""
    from mini_grpo.precision import ONEDNN_CACHES, setup_backends
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "64")
    threads = torch.get_num_threads()
    try:
        setup_backends(tiny(device="cpu", cpu_malloc_cache=False))
    finally:
        torch.set_num_threads(threads)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == ONEDNN_CACHES[
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "16"
    assert os.environ["LRU_CACHE_CAPACITY"] == "64"


def test_a_lora_run_keeps_enough_onednn_primitives_for_its_adapters(monkeypatch, tmp_path):
    """LoRA's adapters add matmul shapes: at 16 primitives each layer of a micro-batch built
    its own again (2x the policy pass on the AMX Xeon). A LoRA run keeps 128, a full one 16,
    and a user's own value stands."""
    from mini_grpo.precision import ONEDNN_LORA_PRIMITIVES, setup_backends
    threads = torch.get_num_threads()
    key = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
    try:
        for cfg, want in ((tiny(device="cpu", cpu_malloc_cache=False), "16"),
                          (tiny(device="cpu", cpu_malloc_cache=False, lora_r=4,
                                init_from=str(tmp_path)), "128")):
            monkeypatch.delenv(key, raising=False)
            setup_backends(cfg)
            assert os.environ[key] == want
        assert ONEDNN_LORA_PRIMITIVES == "128"
        monkeypatch.setenv(key, "512")
        setup_backends(cfg)
        assert os.environ[key] == "512"
    finally:
        torch.set_num_threads(threads)
