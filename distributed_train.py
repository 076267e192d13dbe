"""mini-grpo training entry point: SFT warm start, GRPO, before/after evaluation.

    python distributed_train.py --config default             # the main job, one process
    python distributed_train.py --config tiny --lr=3e-4      # any config field as --key=value
    python distributed_train.py --config tiny --mode=grpo    # stages: sft_grpo | sft | grpo
    python distributed_train.py --config tiny --print-config

Under torchrun the same script runs one rank per process (see docs/guide.md, multi-process DDP).
Exit codes: 0 ok, 2 bad input (one line on stderr), 1 any other failure.
"""

import os
import sys

from mini_grpo.cli import exit_on_sigterm, leave, train_main


def main() -> int:
    exit_on_sigterm()  # a killed run stops its reward workers too
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # plain python: keep config errors instant
        return train_main(sys.argv[1:])
    # under torchrun, @record writes this rank's traceback where the launcher reports it
    # ("Root Cause ... rank: N ... <the exception>") when a rank fails
    from torch.distributed.elastic.multiprocessing.errors import record

    leave(record(train_main)(sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
