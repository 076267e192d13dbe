"""benchmark.py's harnesses, kept out of the modules they measure: reward scoring throughput
(rewards.py), the chunked LM head's peak memory (logits.py), and the time budget's probe,
planner and progress lines (budget.py)."""
