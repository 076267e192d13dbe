"""`python -m mini_grpo train|evaluate|sample ...` (see mini_grpo/cli.py)."""

import sys

from mini_grpo.cli import main

if __name__ == "__main__":
    sys.exit(main())
