"""The frozen reference policy for the KL term, optionally offloaded to CPU.

With `offload`, the weights live in (pinned) CPU memory and are copied to the training device
only for the duration of the reference pass (torch.func.functional_call), so the GPU holds one
model's weights between passes; the log-probs are the same as without offload. On a CPU
device the same code path runs with no copy (which is how the tests exercise it).

Under LoRA the reference is the policy with its adapters switched off (AdaptersOff): the
frozen base, with no second copy of the weights.
"""

from __future__ import annotations

from copy import deepcopy

import torch
from torch.func import functional_call

from . import fsdp
from .lora import adapters_disabled


class _Streamed(torch.nn.Module):
    """Runs `model`'s forward with weights taken from `state` (device copies of CPU weights)."""

    def __init__(self, model: torch.nn.Module, state: dict[str, torch.Tensor]):
        super().__init__()
        self.model, self.state, self.cfg = model, state, model.cfg

    def forward(self, *args, **kwargs):
        return functional_call(self.model, self.state, args, kwargs, tie_weights=True)

    def head_weight(self) -> torch.Tensor:
        """The LM head's weight in `state` (stored once, under the embedding, when tied)."""
        return self.state[self.model.tied_head() or "lm_head.weight"]


class Reference:
    def __init__(self, model: torch.nn.Module, device: torch.device, offload: bool = False,
                 copy: bool = True):
        """`copy=False`: `model` is already a frozen copy (a sharded one under fsdp)."""
        self.model = (deepcopy(model) if copy else model).eval().requires_grad_(False)
        self.offload = offload
        self.device = device
        if offload:
            self.model.to("cpu")
            pin = device.type == "cuda"  # pinned memory makes the host-to-device copy async
            tied = "lm_head.weight" if self.model.tied_head() else None  # copied once
            self.cpu_state = {k: v.pin_memory() if pin else v
                              for k, v in self.model.state_dict().items() if k != tied}
        else:
            self.model.to(device)

    @torch.no_grad()
    def logprobs(self, mb) -> torch.Tensor:
        """(b, n) fp32 log-probs of a trajectory.MicroBatch's completion tokens under the
        reference policy, at the temperature they were sampled at."""
        if not self.offload:
            lp = mb.logprobs(self.model)
            fsdp.release(self.model)  # sharded: no backward frees the root's gathered weights
            return lp
        state = {k: v.to(self.device, non_blocking=True) for k, v in self.cpu_state.items()}
        return mb.logprobs(_Streamed(self.model, state))

    def logprobs_of(self, traj) -> torch.Tensor:
        """(B, N) the reference log-probs of a Trajectory's rows, micro-batch by micro-batch
        (its plan). `traj.pad` extra passes keep a sharded reference's collectives in step
        with the busiest rank (an offloaded reference is a whole copy: it has none)."""
        batches = traj.micro_batches()
        parts = [self.logprobs(mb) for mb in batches]
        for _ in range(0 if self.offload else traj.pad):
            self.logprobs(batches[-1])
        return traj.assemble(parts)


class AdaptersOff(Reference):
    """LoRA's reference policy: the policy itself with its adapters switched off, which is
    its frozen base exactly; no copy exists (offload_reference does not apply)."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.offload = model, False

    @torch.no_grad()
    def logprobs(self, mb) -> torch.Tensor:
        training = self.model.training
        self.model.eval()
        try:
            with adapters_disabled(self.model):
                lp = mb.logprobs(self.model)
        finally:
            self.model.train(training)
        fsdp.release(self.model)
        return lp
