"""Reward plugins: the registry and API (registry.py) plus the built-in scorers.

Built-ins: fen_valid, board_accuracy, board_delta (fen.py); exact_match, levenshtein (text.py);
countdown_format, countdown_correct (countdown.py); math_answer, answer_format, numeric_answer,
numeric_format, numeric_tags (answers.py).
See docs/rewards.md for writing your own.
"""

from mini_grpo.rewards import answers, countdown, fen, text  # noqa: F401  (registers them)
from mini_grpo.rewards.registry import (
    ENTRY_POINT_GROUP,
    REWARDS,
    RewardFn,
    available_rewards,
    per_sample,
    register,
    resolve_reward,
)

__all__ = ["ENTRY_POINT_GROUP", "REWARDS", "RewardFn", "available_rewards", "per_sample",
           "register", "resolve_reward"]
