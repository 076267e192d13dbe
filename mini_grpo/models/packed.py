"""Linear layers on prepacked weights while sampling on a CPU (`packed(model, dtype)`).

At every call, oneDNN first reorders a bf16 matmul's weight into its blocked layout. For a
decode step, a few rows against the whole weight, that reorder is much of the work (with
AMX, a third of SmolLM2-135M's gate_proj call at 8 rows and half its LM head's). Inside
`packed`, every linear layer runs on a copy of its weight cast and reordered once
(`torch.ops.mkldnn._reorder_linear_weight`, the prepacking torch.compile's CPU backend does),
and the layers that read the same input (q/k/v, gate/up: a module's `fuse` names them) as one
matmul on their weights side by side. A LoRA
layer runs on its merged weight (`merged_weight()`), so sampling with adapters costs what it
costs without them. Outputs are in `dtype`, as autocast's would be, and equal them up to the
rounding of a different blocking (tests/test_packed.py).

In fp32 only the LM head is packed: MKL's sgemm took 14.8 ms for SmolLM2-135M's head at 8
rows, oneDNN 5.6 ms on the packed weight (a decode step 59 -> 51 ms); the other layers gained
nothing, the MLP's down projection lost.

The copies live for the `with` block alone: one generation (the weights change between
rollouts), taking the place of the casts autocast would have cached. On any other device or
dtype, or where oneDNN lacks bf16 or a weight is sharded, `packed` changes nothing.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


class PackedLinear:
    """y = x W^T + b on W cast to `dtype` and reordered once (x is cast to `dtype` first)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype, rows: int):
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype), rows)
        self.bias = None if bias is None else bias.detach().to(dtype)
        self.dtype = dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.weight, self.bias,
                                                  "none", [], "")


def usable(model: nn.Module, dtype) -> bool:
    """Packing applies: a CPU model, bf16 (with oneDNN's bf16 kernels) or fp32, unsharded
    weights."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return (dtype in (torch.bfloat16, torch.float32) and torch.backends.mkldnn.is_available()
            and (dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
            and bool(linears) and all(m.weight.device.type == "cpu" and
                                      type(m.weight.data) is torch.Tensor for m in linears))


def _weight(m: nn.Linear) -> torch.Tensor:
    return m.merged_weight() if hasattr(m, "merged_weight") else m.weight


def _fused(layers: list[nn.Linear], dtype, rows: int) -> PackedLinear:
    """The layers as one: their weights (and biases, zeros where one has none) stacked."""
    weight = torch.cat([_weight(m).detach().float() for m in layers])
    bias = None
    if any(m.bias is not None for m in layers):
        bias = torch.cat([m.bias.detach().float() if m.bias is not None else
                          torch.zeros(m.out_features) for m in layers])
    return PackedLinear(weight, bias, dtype, rows)


@contextmanager
def packed(model: nn.Module, dtype, rows: int = 8):
    """Inside, `model`'s linear layers run on prepacked `dtype` weights (see the module
    docstring); `rows`, the rows a call will have, picks oneDNN's kernel. For no-grad passes
    only: nothing here is differentiable."""
    if not usable(model, dtype):
        yield
        return
    groups = [m for m in model.modules() if getattr(m, "fuse", None)]
    members = {id(getattr(m, name)) for m in groups for name in m.fuse} | {
        id(c) for m in model.modules() if hasattr(m, "merged_weight") for c in m.modules()
        if c is not m}  # a LoRA layer's own A and B: it runs on its merged weight
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and id(m) not in members]
    if dtype == torch.float32:  # the LM head alone: packing the others gained nothing
        groups, linears = [], [model.lm_head]
    try:
        for m in linears:  # an instance's forward comes before its class's
            m.forward = PackedLinear(_weight(m), m.bias, dtype, rows)
        for m in groups:
            m.fused = _fused([getattr(m, name) for name in m.fuse], dtype, rows)
        yield
    finally:
        for m in linears:
            m.__dict__.pop("forward", None)
        for m in groups:
            m.__dict__.pop("fused", None)
