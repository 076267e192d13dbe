"""Every command takes every checkpoint the project writes: a GRPO checkpoint of each built-in
task (tiny model) is sampled from, exported, evaluated and resumed. Task arguments of every
type round-trip through the checkpoint's config (numeric's `kinds` is a list[str]: the LM
job's checkpoints crashed sample, export and evaluate with a TypeError)."""

import json

import pytest
from conftest import ROOT, tiny, tiny_lm_dir

from mini_grpo.checkpoint import list_checkpoints, load_checkpoint
from mini_grpo.cli import main
from mini_grpo.job import train

TASKS = {"chess_fen": {}, "countdown": {},
         "numeric": {"task_args": {"num_train": 64, "kinds": ["add", "word_mul"]},
                     "block_size": 256},
         "jsonl": {"data_path": str(ROOT / "tests" / "data" / "rows.jsonl"), "num_eval": 2},
         # a list[float] too; the calculator's tool needs a chat template: the bare answers
         "calculator": {"task_args": {"num_train": 64, "kinds": ["mul3", "mixed"],
                                      "weights": [1.5, 1.0]}, "block_size": 256}}


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
    from mini_grpo import run as run_module
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
    # sample's own defaults (the CPU, no compiling) give way to the user's: --device came
    # before them and lost, so a GPU was never used
    devices, setup = [], run_module.setup
    monkeypatch.setattr(run_module, "setup", lambda cfg, **kw: devices.append(
        cfg.device) or setup(cfg, **kw))
    assert main([*args, "--device=auto"]) == 0
    assert main(args) == 0
    assert devices == ["auto", "cpu"]


def test_a_config_file_comes_between_the_checkpoint_and_the_command_line(tmp_path, monkeypatch,
                                                                        capsys):
    """`--config FILE` on the commands that take a checkpoint: the defaults < the checkpoint's
    stored config < FILE < --key=value (for a Hugging Face directory, FILE over the defaults,
    init_from the directory). It was dropped without a word: `sample --config
    smollm2_calculator` of the calculator job's exported model sampled with no tool."""
    from mini_grpo import engines
    from mini_grpo.cli import _from_checkpoint

    out = tmp_path / "run"
    train(tiny(out, max_steps=1, temperature=0.7))
    ckpt = str(list_checkpoints(out / "checkpoints")[-1])
    mine = tmp_path / "mine.yaml"
    mine.write_text("temperature: 0.9\nnum_eval: 3\ntop_k: 5\n")
    _, cfg = _from_checkpoint(ckpt, ["--config", str(mine), "--num_eval=2"])
    assert (cfg.temperature, cfg.top_k, cfg.num_eval) == (0.9, 5, 2)
    lm = tiny_lm_dir(tmp_path / "lm")
    state, cfg = _from_checkpoint(str(lm), [f"--config={mine}"])
    assert state is None and (cfg.init_from, cfg.temperature) == (str(lm), 0.9)
    seen, of = [], engines.Sampling.of  # the command samples with it
    monkeypatch.setattr(engines.Sampling, "of", staticmethod(
        lambda cfg, greedy=False: seen.append(cfg.temperature) or of(cfg, greedy)))
    assert main(["sample", "--checkpoint", ckpt, "--prompt", "e2e4:", "--max_new_tokens", "2",
                 "--config", str(mine)]) == 0
    assert seen == [0.9]
    mine.write_text("temperature: 0.9\ntemprature: 1.0\n")  # a bad key: the file's line
    capsys.readouterr()
    assert main(["evaluate", "--checkpoint", ckpt, "--config", str(mine)]) == 2
    assert f"{mine}:2: " in capsys.readouterr().err
