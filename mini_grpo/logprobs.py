"""The one completion log-prob pass, for the policy (with gradients), the reference and tests.

Each distinct prompt goes through the model once (GPT.forward_shared) and its completions
attend to its keys and values; every token's position and visible context equal those of
sampling (engines/native.py), so the log-probs equal the ones recorded there up to rounding.

Log-probs are those of log_softmax(logits / temperature), in fp32, 0 where masked. Entropy is
a metric: it is computed without autograd, so it never adds a (B, N, V) tensor to the graph.
The model returns its final hidden states and the LM head runs in chunked.token_logprobs, so
with a big vocabulary (Qwen: 151k) no more than a bounded chunk of (tokens x V) logits exists
at once, in the forward or the backward.
"""

from __future__ import annotations

import torch

from .chunked import token_logprobs


def head_weight(model) -> torch.Tensor:
    """The LM head's weight, through a DDP wrapper; the compiled policy and the reference's
    streamed weights say it themselves (`head_weight()`)."""
    model = getattr(model, "module", model)  # DDP
    return model.head_weight() if hasattr(model, "head_weight") else model.lm_head.weight


def widen_prompts(prompt_ids, prompt_mask, multiple: int = 8):
    """Left-padded prompts (U, P) widened on the left to a multiple of `multiple` columns of
    hidden pads; positions come from the mask, so the log-probs stay the same. On a GPU a
    compiled model guards on the prompts' width being a multiple of 8 (inductor's alignment
    check) and compiled its forward again for each step whose width was not."""
    pad = -prompt_ids.size(1) % multiple
    if not pad:
        return prompt_ids, prompt_mask
    return (torch.nn.functional.pad(prompt_ids, (pad, 0), value=0),
            torch.nn.functional.pad(prompt_mask, (pad, 0), value=False))


def completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                        temperature: float = 1.0, prompt_index=None, entropy: bool = False):
    """logp (B, N) of the completion tokens, and with `entropy=True` also the entropy (B, N)
    of each token's distribution (detached): returns (logp, entropy) then.

    prompt_ids / prompt_mask (U, P) hold left-padded prompts and row i completes prompt
    prompt_index[i] (B,); without prompt_index, row i has prompt i.
    """
    if prompt_index is None:
        prompt_index = torch.arange(completion_ids.size(0), device=completion_ids.device)
    if prompt_ids.is_cuda:
        prompt_ids, prompt_mask = widen_prompts(prompt_ids, prompt_mask)
    h = model(completion_ids, prefix=(prompt_ids, prompt_mask, prompt_index), hidden=True)
    out = token_logprobs(h, head_weight(model), completion_ids, temperature, entropy=entropy)
    if not entropy:
        return out.masked_fill(~completion_mask, 0.0)  # (B, N)
    logp, ent = out
    return logp.masked_fill(~completion_mask, 0.0), ent.masked_fill(~completion_mask, 0.0)
