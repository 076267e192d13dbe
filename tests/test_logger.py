"""The run logger: metrics.jsonl always, TensorBoard and Weights & Biases (offline) on request."""

import pytest
from conftest import metrics, tiny

from mini_grpo.config import ConfigError
from mini_grpo.job import train


def test_report_to_names_known_trackers_only():
    with pytest.raises(ConfigError, match="report_to: must list only tensorboard, wandb"):
        tiny(None, report_to="[tensorboard, mlflow]")


def test_wandb_offline_gets_the_same_metric_names(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    train(tiny(out, mode="sft_grpo", sft_steps=2, max_steps=2, report_to="[wandb]"))
    assert not (out / "tb").exists()  # only what was asked for
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    # the offline run's records (protobuf) hold each metric's name as UTF-8 text
    records = b"".join(f.read_bytes() for f in runs[0].glob("*.wandb"))
    logged = {k for row in metrics(out) for k in row if k not in ("step", "event")}
    assert {"reward/mean", "loss", "kl", "sft/loss", "eval_greedy/reward"} <= logged
    missing = [k for k in logged if k.encode() not in records]
    assert not missing, missing[:5]
    assert b"sft/step" in records and b"mlflow" not in records
