"""mini-grpo training entry point.

    python distributed_train.py --config default            # one process
    python distributed_train.py --config tiny --lr=3e-4     # any field as --key=value
    python distributed_train.py --config tiny --print-config

Multi-process DDP under torchrun arrives with the trainer; today this runs the sampling demo
described in mini_grpo/cli.py. Exit codes: 0 ok, 2 bad input (one line on stderr), 1 other.
"""

import sys

from mini_grpo.cli import main

if __name__ == "__main__":
    sys.exit(main())
