"""The one completion log-prob pass, for the policy (with gradients), the reference and tests.

Each distinct prompt goes through the model once (GPT.forward_shared) and its completions
attend to its keys and values; every token's position and visible context equal those of
sampling (rollout.generate), so the log-probs equal the ones recorded there up to rounding.

Log-probs are those of log_softmax(logits / temperature), in fp32, 0 where masked. Entropy is
a metric: it is computed without autograd, so it never adds a (B, N, V) tensor to the graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                        temperature: float = 1.0, prompt_index=None, entropy: bool = False):
    """logp (B, N) of the completion tokens, and with `entropy=True` also the entropy (B, N)
    of each token's distribution (detached): returns (logp, entropy) then.

    prompt_ids / prompt_mask (U, P) hold left-padded prompts and row i completes prompt
    prompt_index[i] (B,); without prompt_index, row i has prompt i.
    """
    if prompt_index is None:
        prompt_index = torch.arange(completion_ids.size(0), device=completion_ids.device)
    logits = model(completion_ids, prefix=(prompt_ids, prompt_mask, prompt_index))  # (B, N, V)
    logp_all = F.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, completion_ids[..., None]).squeeze(-1)
    logp = logp.masked_fill(~completion_mask, 0.0)
    if not entropy:
        return logp
    with torch.no_grad():
        ent = -(logp_all.exp() * logp_all).sum(-1).masked_fill(~completion_mask, 0.0)
    return logp, ent
