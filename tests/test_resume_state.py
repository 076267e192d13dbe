"""A resume checkpoint's training state is untrusted input: the step, the guard, the loss
scaler and the optimizer's state are checked like a config before any of it is used. An
AdamW moment of another shape made torch's fused and foreach kernels read out of bounds (a
segfault on the next step); now it is one line, exit 2."""

import copy
import math

import pytest
import torch
from conftest import TINY, entry, tiny_gpt

from mini_grpo.checkpoint import CheckpointError, list_checkpoints, load_checkpoint, save_checkpoint
from mini_grpo.job import train
from mini_grpo.optim import check_state, make_optimizer
from mini_grpo.state import check_train_state


def stepped(fused: bool):
    """A tiny GPT's AdamW (nanoGPT's two groups) after one step, and its state_dict."""
    model = tiny_gpt()
    opt = make_optimizer(model, 1e-3, weight_decay=0.1, fused=fused)
    model(torch.zeros(1, 4, dtype=torch.long))[0].float().sum().backward()
    opt.step()
    return opt, opt.state_dict()


def crafted(state, change):
    state = copy.deepcopy(state)
    change(state)
    return state


def set_moment(name, value):
    return lambda s: s["state"][0].__setitem__(name, value)


def set_group(key, value):
    return lambda s: s["param_groups"][0].__setitem__(key, value)


CASES = [
    # the segfault: a moment of another shape than its parameter's
    (set_moment("exp_avg", torch.zeros(3)), r"state\[0\]\.exp_avg: must be a torch.float32 "
                                            r"tensor of its parameter's shape \[24, 32\]"),
    (set_moment("exp_avg_sq", torch.zeros(24, 32, dtype=torch.float64)), "exp_avg_sq: must be"),
    (set_moment("exp_avg", torch.full((24, 32), math.nan)), "exp_avg: holds values that are "
                                                            "not finite"),
    (set_moment("exp_avg_sq", -torch.ones(24, 32)), "exp_avg_sq: holds values that are not "
                                                    "finite and >= 0"),
    (set_moment("exp_avg", [0.0] * 768), "exp_avg: must be a torch.float32 tensor .* got list"),
    (set_moment("step", "1"), r"state\[0\]\.step: must be a finite number >= 0"),
    (set_moment("step", torch.tensor(-1.0)), r"state\[0\]\.step: must be"),
    (lambda s: s["state"][0].pop("exp_avg_sq"), r"holds \['exp_avg', 'step'\], AdamW's are"),
    (lambda s: s["state"].__setitem__(999, s["state"][0]), r"state\[999\]: not a dict of a "
                                                           r"parameter the groups list"),
    (lambda s: s["state"].__setitem__(0, "x"), r"state\[0\]: not a dict"),
    (set_group("betas", "0.9"), r"param_groups\[0\]\.betas: '0.9' is not a value it takes"),
    (set_group("betas", (0.9, 1.5)), r"param_groups\[0\]\.betas"),
    (set_group("lr", math.nan), r"param_groups\[0\]\.lr"),
    (set_group("eps", 0.0), r"param_groups\[0\]\.eps"),
    (set_group("weight_decay", -1.0), r"param_groups\[0\]\.weight_decay"),
    (set_group("fused", "yes"), r"param_groups\[0\]\.fused"),
    (set_group("amsgrad", 1), r"param_groups\[0\]\.amsgrad"),
    (set_group("momentum", 0.9), r"param_groups\[0\]\.momentum: not a key"),
    (set_group("params", [0, 0] + list(range(2, 10))), r"param_groups\[0\]\.params: 0 is not"),
    (lambda s: s["param_groups"].pop(), "other parameter groups than this model's"),
    (lambda s: s.pop("state"), "not an optimizer state torch writes"),
    # found by tests/test_fuzz.py's test_resume_states: each passed, then failed in torch
    (set_group("lr", 2**1100), r"param_groups\[0\]\.lr: 1358298.* is not a value it takes"),
    (set_group("lr", 6.5e37), r"param_groups\[0\]\.lr"),  # lr / (1 - beta1): past float32
    (set_group("eps", 1e-320), r"param_groups\[0\]\.eps"),  # 0 in float32: 0 / 0, NaN
    (set_group("amsgrad", True), r"param_groups\[0\]\.amsgrad: True is not"),  # KeyError
    (set_group("amsgrad", None), r"param_groups\[0\]\.amsgrad: None"),  # fused: TypeError
    (set_group("capturable", True), r"param_groups\[0\]\.capturable"),  # on CPU: an error
    (set_group("differentiable", True), r"param_groups\[0\]\.differentiable"),  # fused: one
    (lambda s: s["param_groups"][0].pop("lr"), r"param_groups\[0\]: has no 'lr'"),
    (set_moment("step", 2**1100), r"state\[0\]\.step: must be"),  # was an OverflowError
    # one line, where the value's repr is several
    (set_group("weight_decay", torch.zeros(2, 2)),
     r"weight_decay: tensor\(\[\[0\., 0\.\], \[0\., 0\.\]\]\) is not a value it takes"),
    (set_group(7, 1), r"param_groups\[0\]\[7\]: not a key"),
]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("change, needle", CASES)
def test_a_crafted_optimizer_state_is_refused_before_it_is_loaded(fused, change, needle):
    opt, state = stepped(fused)
    check_state(opt, state)  # the state as torch wrote it passes
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=needle) as e:
        check_state(opt, crafted(state, change))
    assert len(str(e.value).splitlines()) == 1, str(e.value)
    after = opt.state_dict()  # nothing was loaded
    assert all(torch.equal(after["state"][k][m], before["state"][k][m])
               for k in before["state"] for m in before["state"][k])


@pytest.mark.parametrize("field, value, needle", [
    ("step", -5, "'step' must be an integer >= 0, got -5"),
    ("step", "3", "'step' must be an integer >= 0, got '3'"),
    ("step", 3.0, "'step' must be an integer >= 0, got 3.0"),
    ("step", True, "'step' must be an integer >= 0, got True"),
    ("step", None, "'step' must be an integer >= 0, got None"),  # missing
    ("guard", [1, 2], "'guard' must be a dict of skipped, next_rung, lr_scale, amp"),
    ("guard", {"skipped": "0"}, "'guard.skipped' must be an integer >= 0"),
    ("guard", {"next_rung": 99}, "'guard.next_rung' must be an integer in 0..4"),
    ("guard", {"lr_scale": math.inf}, "'guard.lr_scale' must be a number in (0, 1]"),
    ("guard", {"amp": "yes"}, "'guard.amp' must be true or false"),
    ("guard", {"rungs": 1}, "'guard' must be a dict of"),
    ("scaler", {"scale": -1.0}, "'scaler.scale' must be a number in [2**-149, 2**127]"),
    ("scaler", {"growth_interval": 0}, "'scaler.growth_interval' must be an integer >= 1"),
    ("scaler", "x", "'scaler' must be a dict of scale"),
    ("optimizer", "adamw", "'optimizer' must be an optimizer state (a dict), got 'adamw'"),
    ("logged", "junk", "'logged' must be an integer >= 0 (metrics.jsonl's size) or null"),
    ("logged", -1, "'logged' must be an integer"),
    # found by tests/test_fuzz.py's test_resume_states: each passed, then failed in torch
    ("scaler", {"scale": 65536.0}, "'scaler' must be all of scale, growth_factor, "
                                   "backoff_factor, growth_interval, _growth_tracker, or none"),
    ("scaler", {"_growth_tracker": 2**31}, "'scaler._growth_tracker' must be an integer in "
                                           "0..2**31-1"),  # an int32 tensor's
    ("scaler", {"scale": 2.0**128}, "'scaler.scale' must be a number in [2**-149, 2**127]"),
    ("guard", {"skipped": torch.zeros(2, 1)}, "got tensor([[0.], [0.]])"),  # one line
])
def test_a_crafted_training_state_is_one_error_naming_the_field(field, value, needle):
    ckpt = {"step": 3, "guard": {"skipped": 0, "next_rung": 0, "lr_scale": 1.0, "amp": True},
            "scaler": {}, "logged": 10, "optimizer": {}}
    check_train_state(ckpt, "c.pt")  # as a run writes it
    if value is None:
        del ckpt[field]
    else:
        ckpt[field] = value
    with pytest.raises(CheckpointError) as e:
        check_train_state(ckpt, "c.pt")
    assert str(e.value).startswith("c.pt: its ") and needle in str(e.value), str(e.value)
    assert len(str(e.value).splitlines()) == 1


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    train_args = {**TINY, "max_steps": 1, "save_every": 1}
    from conftest import tiny
    train(tiny(out, **train_args))
    return list_checkpoints(out / "checkpoints")[-1]


@pytest.mark.parametrize("fused", ["true", "false"])
def test_resuming_a_moment_of_the_wrong_shape_exits_2_not_a_segfault(checkpoint, tmp_path,
                                                                      fused):
    """Both kernels (fused, and the per-parameter loop) read out of bounds on such a state."""
    state = load_checkpoint(checkpoint)
    state["optimizer"]["state"][0]["exp_avg"] = torch.zeros(3)
    path = save_checkpoint(state, tmp_path / "bad", 1)
    r = entry("--config", "tiny", *(f"--{k}={v}" for k, v in TINY.items()),
              f"--resume={path}", f"--out_dir={tmp_path / 'run'}", "--max_steps=2",
              f"--fused_optimizer={fused}")
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0] == (
        f"error: {path}: optimizer.state[0].exp_avg: must be a torch.float32 tensor of its "
        f"parameter's shape [43, 32], got torch.float32 [3]"), r.stderr[-2000:]


def test_resuming_a_negative_step_exits_2(checkpoint, tmp_path):
    state = load_checkpoint(checkpoint)
    state["step"] = -5
    path = save_checkpoint(state, tmp_path / "bad", 1)
    r = entry("--config", "tiny", *(f"--{k}={v}" for k, v in TINY.items()),
              f"--resume={path}", f"--out_dir={tmp_path / 'run'}", "--max_steps=2")
    assert r.returncode == 2 and r.stderr.strip() == (
        f"error: {path}: its 'step' must be an integer >= 0, got -5"), r.stderr[-2000:]
