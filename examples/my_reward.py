"""A reward plugin in a user's own file: credit for the right number of pieces on the board."""

from mini_grpo.rewards import per_sample


@per_sample
def piece_count(prompt: str, completion: str, target: str, meta: dict) -> float:
    count = lambda fen: sum(c.isalpha() for c in fen.split(" ")[0])
    return max(0.0, 1.0 - abs(count(completion) - count(target)) / 32)
