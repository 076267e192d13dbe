"""The update's relative size (||delta theta|| / ||theta||) each step logs: what the step did,
measured on a fixed random sample of each weight's entries, against the exact figure."""

import pytest
import torch
from conftest import metrics, tiny, tiny_gpt

from mini_grpo.job import train
from mini_grpo.optim import UpdateProbe, make_optimizer


def exact_and_probed(model, fused):
    opt = make_optimizer(model, 1e-2, weight_decay=0.1, fused=fused)
    probe = UpdateProbe([p for p in model.parameters() if p.requires_grad])
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.zeros(2, 8, dtype=torch.long))[0].float().square().mean().backward()
    read = probe.read()
    opt.step()
    delta = sum((p.detach() - b).double().square().sum() for p, b in
                zip(model.parameters(), before))
    norm = sum(p.detach().double().square().sum() for p in model.parameters())
    sums = probe.sums(read)
    return (delta / norm).sqrt().item(), (sums[0] / sums[1]).sqrt().item()


@pytest.mark.parametrize("fused", [True, False])
def test_small_weights_are_read_whole_and_the_size_is_exact(fused):
    exact, probed = exact_and_probed(tiny_gpt(), fused)
    assert exact > 0 and probed == pytest.approx(exact, rel=1e-9)


def test_a_large_weights_sample_estimates_its_update_and_leaves_the_rng_alone():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 512), torch.nn.Linear(512, 2048))
    state = torch.get_rng_state()
    probe = UpdateProbe(model.parameters())
    assert torch.equal(torch.get_rng_state(), state)  # its own generator
    assert probe.parts[1][1] is not None and len(probe.parts[1][1]) == 4096 + 2048 * 512 // 64

    class Wrapped(torch.nn.Module):  # the shape exact_and_probed calls
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, x):
            return (self.m(x),)

    exact, probed = exact_and_probed(Wrapped(), fused=True)
    assert probed == pytest.approx(exact, rel=0.05)


def test_each_logged_step_has_its_update_size(tmp_path):
    train(tiny(tmp_path / "run", max_steps=2, eval_every=100, save_every=100))
    rows = [r for r in metrics(tmp_path / "run") if "update_size" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0 < r["update_size"] < 1 for r in rows), rows


def test_adam_eps_reaches_the_optimizer_and_damps_the_update(tmp_path):
    """adam_eps: with a floor far above the tiny model's gradient scale (1.0 against gradients
    of ~1e-3 a coordinate) the same first step moves the weights far less than with 1e-8."""
    sizes = {}
    for eps in (1e-8, 1.0):
        train(tiny(tmp_path / f"eps{eps}", adam_eps=eps, max_steps=1, eval_every=100,
                   save_every=100))
        sizes[eps] = [r["update_size"] for r in metrics(tmp_path / f"eps{eps}")
                      if "update_size" in r][0]
    assert 0 < sizes[1.0] < sizes[1e-8] / 10, sizes
