"""The reward curve of a run as a picture: <out_dir>/reward.png, from its metrics.jsonl.

    python -m mini_grpo.plot runs/smollm2_numeric        # also written at the end of each run

GRPO's mean training reward per step (light) and its moving average (dark), and the held-out
evaluations' rewards (greedy and sampled) at the steps they ran, with their standard errors;
in a multi-turn run, the tool calls per rollout on a second axis.
SFT and RFT stages log under their own prefixes and are not drawn. matplotlib draws it; a run
without matplotlib says so once and goes on (TensorBoard has the same curves).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SMOOTH = 10  # steps in the moving average


def read_metrics(path: Path, calls: dict | None = None) -> tuple[dict, dict]:
    """({step: train reward}, {"greedy"/"sampled": {step: (reward, se)}}) of metrics.jsonl;
    a resumed run's later rows replace earlier ones of the same step. `calls`, if given, is
    filled with {step: tool calls per rollout} (multi-turn runs)."""
    train, evals = {}, {"greedy": {}, "sampled": {}}
    calls = {} if calls is None else calls
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
            step = row.get("step")
            if not isinstance(step, int):
                continue
            if isinstance(row.get("reward/mean"), float):
                train[step] = row["reward/mean"]
            if isinstance(row.get("tools/calls"), float):
                calls[step] = row["tools/calls"]
            for mode in evals:
                r, se = row.get(f"eval_{mode}/reward"), row.get(f"eval_{mode}/reward_se")
                if isinstance(r, float):
                    evals[mode][step] = (r, se if isinstance(se, float) else 0.0)
    return train, evals


def plot_rewards(out_dir: str | Path) -> Path | None:
    """Writes <out_dir>/reward.png; returns its path, or None without matplotlib or data."""
    out_dir = Path(out_dir)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[mini-grpo] no reward.png: matplotlib is not installed (pip install "
              "matplotlib); TensorBoard has the curves", flush=True)
        return None
    metrics = out_dir / "metrics.jsonl"
    if not metrics.is_file():
        return None
    calls: dict = {}
    train, evals = read_metrics(metrics, calls)
    if not train and not any(evals.values()):
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    if train:
        steps = sorted(train)
        values = [train[s] for s in steps]
        windows = [values[max(0, i - SMOOTH + 1):i + 1] for i in range(len(values))]
        smooth = [sum(w) / len(w) for w in windows]
        ax.plot(steps, values, color="tab:blue", alpha=0.25, linewidth=1)
        ax.plot(steps, smooth, color="tab:blue", linewidth=2,
                label=f"training reward ({SMOOTH}-step mean)")
    for mode, color in (("greedy", "tab:red"), ("sampled", "tab:orange")):
        if evals[mode]:
            steps = sorted(evals[mode])
            ax.errorbar(steps, [evals[mode][s][0] for s in steps],
                        yerr=[evals[mode][s][1] for s in steps], color=color, marker="o",
                        capsize=3, label=f"held-out, {mode}")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward")
    ax.set_title(out_dir.name)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if calls:  # multi-turn: tool calls per rollout, on an axis of their own
        right = ax.twinx()
        steps = sorted(calls)
        right.plot(steps, [calls[s] for s in steps], color="tab:green", linewidth=1.5,
                   label="tool calls per rollout")
        right.set_ylabel("tool calls per rollout")
        right.set_ylim(bottom=0)
        more = right.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels, loc="lower right")
    fig.tight_layout()
    path = out_dir / "reward.png"
    tmp = path.with_name(".reward.png.tmp")
    fig.savefig(tmp, format="png")
    plt.close(fig)
    tmp.replace(path)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m mini_grpo.plot RUN_DIR")
    written = plot_rewards(sys.argv[1])
    print(f"wrote {written}" if written else "nothing to plot")
