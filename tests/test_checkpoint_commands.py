"""Every command takes every checkpoint the project writes: a GRPO checkpoint of each built-in
task (tiny model) is sampled from, exported, evaluated and resumed. Task arguments of every
type round-trip through the checkpoint's config (numeric's `kinds` is a list[str]: the LM
job's checkpoints crashed sample, export and evaluate with a TypeError)."""

import json

import pytest
from conftest import ROOT, tiny

from mini_grpo.checkpoint import list_checkpoints, load_checkpoint
from mini_grpo.cli import main
from mini_grpo.job import train

TASKS = {"chess_fen": {}, "countdown": {},
         "numeric": {"task_args": {"num_train": 64, "kinds": ["add", "word_mul"]},
                     "block_size": 256},
         "jsonl": {"data_path": str(ROOT / "tests" / "data" / "rows.jsonl"), "num_eval": 2}}


@pytest.mark.parametrize("task", TASKS)
def test_sample_export_evaluate_and_resume_take_a_checkpoint_of_every_task(tmp_path, task):
    over = {"num_eval": 4, "max_new_tokens": 8, **TASKS[task]}
    out = tmp_path / "run"
    train(tiny(out, task=task, max_steps=1, **over))
    ckpt = list_checkpoints(out / "checkpoints")[-1]
    saved = load_checkpoint(ckpt)["config"]["task_args"]
    for key, value in TASKS[task].get("task_args", {}).items():
        assert saved[key] == value, key  # a list stays a list of the same items
    prompt = "e2e4:" if task == "jsonl" else "12 + 3 ="  # in the model's alphabet
    assert main(["sample", "--checkpoint", str(ckpt), "--prompt", prompt, "--n", "1",
                 "--max_new_tokens", "4"]) == 0
    assert main(["export", "--checkpoint", str(ckpt), "--output", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert main(["evaluate", "--checkpoint", str(ckpt), "--json", str(tmp_path / "e.json"),
                 "--num_eval=4", "--max_new_tokens=4"]) == 0
    assert "greedy" in json.loads((tmp_path / "e.json").read_text())
    train(tiny(out, task=task, max_steps=2, **over))  # resumes 1 -> 2
    assert load_checkpoint(list_checkpoints(out / "checkpoints")[-1])["step"] == 2


def test_sample_uses_the_checkpoints_temperature_unless_told(tmp_path, monkeypatch):
    from mini_grpo import engines
    out = tmp_path / "run"
    train(tiny(out, max_steps=1, temperature=0.7))
    ckpt = str(list_checkpoints(out / "checkpoints")[-1])
    seen, of = [], engines.Sampling.of
    monkeypatch.setattr(engines.Sampling, "of", staticmethod(
        lambda cfg, greedy=False: seen.append(cfg.temperature) or of(cfg, greedy)))
    args = ["sample", "--checkpoint", ckpt, "--prompt", "e2e4:", "--max_new_tokens", "2"]
    assert main(args) == 0
    assert main([*args, "--temperature", "1.3"]) == 0
    assert seen == [0.7, 1.3]
