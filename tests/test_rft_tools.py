"""RFT with tools and environments: each kept row holds its whole conversation (scored as GRPO
scores it, resumed like any row), a file's conversations are checked when read, and SFT on
them trains the model's own tokens only."""

import json
from pathlib import Path

import pytest
from conftest import tiny, tiny_lm_dir

from mini_grpo.conversation import encode_conversation
from mini_grpo.data import sft_batch, sft_target
from mini_grpo.fields import ConfigError
from mini_grpo.rft import first_prompts, generate_rft_data
from mini_grpo.tasks import load_jsonl

pytest.importorskip("transformers")

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "431 * 254"}}\n</tool_call>'
TALK = [{"role": "assistant", "content": CALL},
        {"role": "tool", "name": "calculator", "content": "109474"},
        {"role": "assistant", "content": "<answer>109474</answer>"}]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return tiny_lm_dir(tmp_path_factory.mktemp("lm") / "lm", positions=1024)


def record(talk=TALK, **over) -> str:
    """A line of RFT's output for a multi-turn row."""
    return json.dumps({"prompt": "What is 431 * 254?", "target": "<answer>109474</answer>",
                       "completion": TALK[-1]["content"], "reward": 1.0,
                       "rewards": {"numeric_answer": 1.0}, "conversation": talk, **over}) + "\n"


def test_rft_with_the_calculator_keeps_conversations_and_sft_trains_on_them(
        lm, tmp_path, monkeypatch):
    """mode rft with tools: SFT on the task's demonstrations, RFT's rows with their
    conversations, then the RFT stage's SFT on exactly those conversations."""
    import mini_grpo.sft as sft
    from mini_grpo.job import train

    batches, real = [], sft.sft_batch
    monkeypatch.setattr(sft, "sft_batch", lambda tok, pairs, device=None: batches.append(
        [t for _, t in pairs]) or real(tok, pairs, device))
    out = tmp_path / "run"
    train(tiny(out, init_from=str(lm), task="calculator", mode="rft",
               task_args=json.dumps({"num_train": 64}), tools=json.dumps(["calculator"]),
               sft_steps=4, sft_lr=3e-3, sft_batch_size=4, rft_sft_steps=2, rft_num_prompts=6,
               rft_oversample=4, rft_prompts_per_batch=6, rft_min_reward=0.0,
               max_new_tokens=40, block_size=1024, num_eval=4))
    rows = [json.loads(line) for line in (out / "rft" / "data.jsonl").open()]
    assert rows
    for r in rows:  # the whole conversation, whose last turn is the completion
        talk = r["conversation"]
        assert talk[0]["role"] == talk[-1]["role"] == "assistant"
        assert talk[-1]["content"] == r["completion"]
        assert r["reward"] == pytest.approx(0.1 * r["rewards"]["numeric_format"]
                                            + 0.9 * r["rewards"]["numeric_answer"])
    assert len(batches) == 4 + 2  # the SFT stage's, then the RFT stage's
    kept = [r["conversation"] for r in rows]
    assert all(isinstance(t, list) and t in kept for b in batches[4:] for t in b)
    assert (out / "rft" / "sft" / "step_0000002.pt").is_file()


def test_an_environment_s_conversations_and_rewards_survive_an_interrupted_run(lm, tmp_path):
    """Guess the number (every guess answered): rows keep their several turns and the reward
    the rollout got (the plugin's and the environment's `env` column); a run killed in its
    second batch and started again keeps the first batch's rows as written."""
    from mini_grpo.run import setup

    cfg = tiny(tmp_path / "run", init_from=str(lm), task="jsonl",
               data_path="examples/guess_number.jsonl",
               environment="examples.guess_number:GuessNumber",
               rewards=json.dumps([{"name": "examples.guess_number:guesses", "weight": 1.0}]),
               max_tool_calls=1, max_new_tokens=240, block_size=512, temperature=1.5,
               rft_oversample=8, rft_prompts_per_batch=3, rft_min_reward=-1.0, rft_keep="all")
    out = tmp_path / "rft.jsonl"
    with setup(cfg, log=False) as run:
        examples = first_prompts(run.task.train, 6)
        real, calls = run.scorer.score, {"n": 0}

        def dies_on_the_second_batch(*a, **kw):
            calls["n"] += 1
            if calls["n"] == 2:
                raise KeyboardInterrupt
            return real(*a, **kw)

        run.scorer.score = dies_on_the_second_batch
        with pytest.raises(KeyboardInterrupt):
            generate_rft_data(run, examples, out)
        first = [json.loads(line) for line in Path(f"{out}.rank0").open()]
        run.scorer.score = real
        summary = generate_rft_data(run, examples, out)
    assert summary["prompts_generated_now"] == 3
    rows = [json.loads(line) for line in out.open()]
    assert rows[:len(first)] == first and len(rows) > len(first)
    for r in rows:
        turns = sum(m["role"] == "assistant" for m in r["conversation"])
        assert r["rewards"]["guesses"] == pytest.approx(-0.05 * turns)
        assert r["reward"] == pytest.approx(r["rewards"]["guesses"] + r["rewards"]["env"])
    assert any(len(r["conversation"]) > 1 for r in rows)  # the environment answered
    loaded = load_jsonl(out)
    assert [sft_target(ex, True) for ex in loaded] == [r["conversation"] for r in rows]


def test_the_sft_target_of_a_record_labels_exactly_the_model_s_tokens(lm, tmp_path):
    """A record read back: SFT's labels are encode_conversation's ids where they are the
    model's own (its messages and their end-of-turn token), -1 on the tool's answer."""
    from mini_grpo.tokenizer import HFTokenizer
    from mini_grpo.tools import tool_schemas

    tok = HFTokenizer.from_dir(lm)
    tok.configure_chat("auto", "", tool_schemas(["calculator"]))
    path = tmp_path / "rft.jsonl"
    path.write_text(record())
    ex = load_jsonl(path)[0]
    assert sft_target(ex, True) == TALK and sft_target(ex, False) == TALK[-1]["content"]
    x, y = sft_batch(tok, [(ex.model_input, sft_target(ex, True))])
    seq, own = encode_conversation(tok, ex.model_input, TALK)
    p = len(seq) - len(own)
    assert x[0].tolist() == seq[:-1]
    assert y[0, :p - 1].eq(-1).all()
    assert y[0, p - 1:].tolist() == [t if mine else -1 for t, mine in zip(seq[p:], own)]
    assert 0 < sum(own) < len(own)  # the tool's answer is in the row, unlabelled
    labelled = tok.tk.decode([t for t in y[0].tolist() if t >= 0], skip_special_tokens=False)
    assert labelled == CALL + "<|im_end|><answer>109474</answer><|im_end|>"


def test_a_demonstration_longer_than_the_block_is_refused_where_sft_trains_on_it(lm, tmp_path):
    """With tools SFT trains on a row's conversation, the tools' answers inside it: one that
    does not fit block_size is refused at setup, naming its line; without tools SFT trains
    on the completion alone, which fits."""
    from mini_grpo.data import sft_row
    from mini_grpo.limits import check_sft_lengths
    from mini_grpo.tokenizer import HFTokenizer
    from mini_grpo.tools import tool_schemas

    tok = HFTokenizer.from_dir(lm)
    tok.configure_chat("auto", "", tool_schemas(["calculator"]))
    path = tmp_path / "rft.jsonl"
    long = [TALK[0], {**TALK[1], "content": "1" * 300}, TALK[2]]
    path.write_text(record() + record(long))
    rows = load_jsonl(path)
    block = len(sft_row(tok, rows[0].model_input, TALK)[0])  # the first row just fits
    over = {"init_from": str(lm), "mode": "sft", "block_size": block, "max_new_tokens": 8}
    with pytest.raises(ConfigError, match=f"SFT on {path}:2 .*: its prompt .* and "
                                          f"demonstration conversation"):
        check_sft_lengths(tiny(tools=json.dumps(["calculator"]), **over), tok, rows)
    check_sft_lengths(tiny(tools=json.dumps(["calculator"]), **over), tok, rows[:1])
    check_sft_lengths(tiny(**over), tok, rows)


@pytest.mark.parametrize("talk, why", [
    ("hi", r'"conversation" must be a list of 1 to 2048'),
    ([], r'"conversation" must be a list of 1 to 2048'),
    ([{"role": "assistant", "content": "a"}] * 2049, r'"conversation" must be a list'),
    ([TALK[0], {"role": "robot", "content": "x"}, TALK[2]], r"conversation\[1\] must be"),
    ([TALK[0], {"role": "tool", "content": 5}, TALK[2]], r"conversation\[1\] must be"),
    ([TALK[0], {"role": "tool"}, TALK[2]], r"conversation\[1\] must be"),
    ([TALK[0], {"role": "tool", "content": "x" * ((1 << 20) + 1)}, TALK[2]],
     r"conversation\[1\] must be"),
    ([{"role": "assistant", "content": "a", "name": ["x"]}], r"conversation\[0\] must be"),
    (["text"], r"conversation\[0\] must be"),
    (TALK[:2], r'"conversation" must open and end with the model\'s'),
    (TALK[1:], r'"conversation" must open and end with the model\'s'),
])
def test_a_bad_conversation_in_the_file_is_refused_naming_file_and_line(tmp_path, talk, why):
    path = tmp_path / "rft.jsonl"
    path.write_text(record() + record(talk))
    with pytest.raises(ConfigError, match=f"rft.jsonl:2: {why}"):
        load_jsonl(path)
