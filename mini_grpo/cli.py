"""Command-line entry: resolve the config, then run the job.

    python distributed_train.py --config default [--key=value ...]
    python distributed_train.py --config tiny --print-config   # show the resolved config

Config errors are reported before torch is even imported: one line on stderr, exit code 2.
The GRPO trainer has not landed yet: the job is the sampling demo in mini_grpo/demo.py.
"""

from __future__ import annotations

import sys

import yaml

from .config import ConfigError, load_config, parse_cli


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    print_config = "--print-config" in argv
    argv = [a for a in argv if a != "--print-config"]
    try:
        config, overrides = parse_cli(argv)
        cfg = load_config(config, overrides)
        if print_config:
            print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
            return 0
        from .demo import sampling_demo

        sampling_demo(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
