"""`python -m mini_grpo train|evaluate|sample ...` (see mini_grpo/cli.py)."""

from mini_grpo.cli import leave, main

if __name__ == "__main__":
    leave(main())
