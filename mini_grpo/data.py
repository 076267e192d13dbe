"""Data order and batch encoding shared by SFT and GRPO.

The order is a function of (seed, step) alone: no iterator state to save, so a resumed run
sees exactly the prompts the uninterrupted run would have seen.
"""

from __future__ import annotations

import torch

from .conversation import encode_conversation
from .tokenizer import Tokenizer


def batch_indices(n: int, batch: int, step: int, seed: int) -> list[int]:
    """Indices of the `batch` examples of `step` (from 0): consecutive slices of a fresh
    permutation of range(n) per epoch, wrapping across epoch boundaries."""
    out: list[int] = []
    start = step * batch
    while len(out) < batch:
        epoch, offset = divmod(start + len(out), n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        out.extend(perm[offset:offset + batch - len(out)].tolist())
    return out


def shard(items: list, rank: int, world_size: int) -> list:
    """This rank's contiguous share of a global batch (sizes differ by at most one)."""
    n = len(items)
    return items[rank * n // world_size:(rank + 1) * n // world_size]


def sft_target(ex, multi_turn: bool) -> str | list[dict]:
    """What SFT trains a row on: where the run has tools or an environment, a multi-turn
    demonstration (meta "conversation": the task's, e.g. calculator's, or the whole
    conversation RFT kept, whose `completion` is only its last turn); else the completion
    RFT accepted, else the target."""
    if multi_turn and isinstance(ex.meta.get("conversation"), list):
        return ex.meta["conversation"]
    if "completion" in ex.meta:
        return ex.meta["completion"]
    return ex.target


def sft_row(tok: Tokenizer, prompt: str | list[dict],
            target: str | list[dict]) -> tuple[list[int], list[int]]:
    """One (prompt, target) pair as SFT reads it: (ids, labels) of one length, the model's
    input and what it is trained to predict at each position.

    The model reads BOS + prompt + target but its last token and is trained to predict
    target + EOS only: labels are -1 (ignored) on prompt positions. A target that is a list
    of messages is a multi-turn demonstration (conversation.encode_conversation): the model
    is trained on its own messages, not on the tools' answers between them.
    """
    if isinstance(target, list):
        seq, own = encode_conversation(tok, prompt, target)
        p = seq[:len(seq) - len(own)]
        t = [i if mine else -1 for i, mine in zip(seq[len(p):], own)]
    else:
        p = tok.encode_prompt(prompt)
        t = tok.encode(target, eos=True)
        seq = p + t
    return seq[:-1], [-1] * (len(p) - 1) + t


def sft_batch(tok: Tokenizer, pairs: list[tuple[str | list[dict], str | list[dict]]],
              device=None):
    """(prompt, target) pairs -> (idx (B, T), targets (B, T)) of their sft_rows,
    right-padded (targets -1 on padding)."""
    rows, labels = zip(*(sft_row(tok, prompt, target) for prompt, target in pairs))
    T = max(map(len, rows))
    idx = torch.full((len(rows), T), tok.pad_id, dtype=torch.long)
    tgt = torch.full((len(rows), T), -1, dtype=torch.long)
    for i, (r, lab) in enumerate(zip(rows, labels)):
        idx[i, :len(r)] = torch.tensor(r)
        tgt[i, :len(lab)] = torch.tensor(lab)
    return idx.to(device), tgt.to(device)
