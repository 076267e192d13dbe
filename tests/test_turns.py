# ruff: noqa: E501 (Qwen2.5's chat template is embedded as its tokenizer_config.json writes it)
"""Multi-turn rollouts: the tool list and the tools' messages rendered as transformers renders
them, the native engine's turn loop (tokens of the environment attended to, never trained
on), the loss mask, and hostile model output through the whole loop."""

import json
import time

import pytest
import torch
from conftest import CHATML, tiny, tiny_gpt

from mini_grpo.conversation import continuation
from mini_grpo.engines.native import generate
from mini_grpo.engines.turns import ToolSetup, Turns
from mini_grpo.envs import Step, ToolEnv
from mini_grpo.logprobs import completion_logprobs
from mini_grpo.tokenizer import HFTokenizer
from mini_grpo.tools import calculator, resolve_tools, tool_schemas
from mini_grpo.trainer import policy_pass
from mini_grpo.trajectory import Trajectory

transformers = pytest.importorskip("transformers")

# Qwen2.5's template with tools (Hermes-style <tool_call> JSON; tool results as a user turn
# of <tool_response> blocks), as its tokenizer_config.json carries it
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "431 * 254"}}\n</tool_call>'


def tokenizers(tmp_path, template):
    """(ours, transformers') for one byte-level BPE with ChatML's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(["What is 431 * 254? The answer is 109474.", CALL], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>",
                                              pad_token="<|endoftext|>")
    hf.chat_template = template
    hf.save_pretrained(tmp_path)
    ours = HFTokenizer.from_dir(tmp_path)
    ours.configure_chat("auto", "", tool_schemas(["calculator"]))
    return ours, hf


@pytest.mark.parametrize("template", ["qwen25", "chatml"])
def test_a_conversation_token_by_token_is_the_template_s_rendering(tmp_path, template):
    """The prompt with its tool list, then the model's turns (kept as sampled) and what
    `continuation` appends after each, decode to what transformers' apply_chat_template
    renders for the whole conversation: through the template's own `tools` (Qwen2.5), or
    (a template without) the tool list in the system message."""
    ours, hf = tokenizers(tmp_path, QWEN25 if template == "qwen25" else CHATML)
    assert ours.tools_in_template == (template == "qwen25")
    question = "What is 431 * 254?"
    history = ours.messages_of(question)
    ids = ours.encode(ours.render(history))
    expect = [{"role": "user", "content": question}]
    if template == "qwen25":
        assert ours.render(history) == hf.apply_chat_template(
            expect, tools=[calculator], add_generation_prompt=True, tokenize=False)
    else:  # the fallback: the Hermes tool list in a system message of its own
        assert history[0]["role"] == "system" and '"name": "calculator"' in history[0]["content"]
        expect = history[:1] + expect
    replies = [CALL, "Then " + CALL, "The answer is 109474."]
    results = ["109474", "error: unknown tool 'x'"]
    for k, reply in enumerate(replies):
        ids += ours.encode(reply) + [ours.eos_id]  # the model's turn, as it sampled it
        if k == len(replies) - 1:
            break
        tool = [{"role": "tool", "content": results[k]}]
        history.append({"role": "assistant", "content": reply})
        ids += continuation(ours, history, tool, ours.eos_id)
        history += tool
        expect += [{"role": "assistant", "content": reply}] + tool
    expect.append({"role": "assistant", "content": replies[-1]})
    whole = hf.apply_chat_template(expect, tools=[calculator] if template == "qwen25" else None,
                                   tokenize=False)
    assert ours.tk.decode(ids, skip_special_tokens=False) + "\n" == whole


def eos_heavy(seed=0):
    """A tiny GPT and end-of-turn ids that it samples often (a third of its vocabulary)."""
    return tiny_gpt(seed), [3, 6, 9, 12, 15, 18, 21]


PROMPTS = [[1, 5, 6, 7], [1, 8], [1, 9, 10, 11, 12, 13, 14], [1, 8]]


class Scripted:
    """Turns' interface with a fixed answer: each ended turn gets `answer` for `rounds`
    rounds, then the row ends; records what it was handed."""

    def __init__(self, answer, rounds):
        self.answer, self.rounds, self.seen, self.cuts = answer, rounds, {}, {}

    def end_turn(self, rows, replies):
        out = []
        for g, ids in zip(rows, replies):
            self.seen.setdefault(g, []).append(ids)
            out.append(list(self.answer) if len(self.seen[g]) <= self.rounds else None)
        return out

    def cut(self, row, ids):
        self.cuts[row] = ids

    def unanswered(self, row):
        self.cuts[row] = "unanswered"

    # what TurnState.rollout reads of a conversation: nothing here
    counts = torch.zeros(len(PROMPTS), 5)  # every test here samples 4 rows

    def last_replies(self):
        return None

    def conversations(self):
        return None

    def env_rewards(self):
        return None


def test_with_no_turn_answered_the_rollout_equals_the_single_turn_one_bit_for_bit():
    m, eos = eos_heavy()
    for greedy in (False, True):
        a = generate(m, PROMPTS, 24, eos, 0, greedy=greedy,
                     generator=torch.Generator().manual_seed(7))
        b = generate(m, PROMPTS, 24, eos, 0, greedy=greedy, turns=Scripted([], 0),
                     generator=torch.Generator().manual_seed(7))
        for name in ("completion_ids", "completion_mask", "logprobs", "finished"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert torch.equal(b.model_mask, b.completion_mask)


@pytest.mark.parametrize("use_cache", [True, False])
def test_answers_are_taken_after_each_turn_attended_and_not_the_model_s(use_cache):
    m, eos = eos_heavy()
    answer = [4, 5, 20]
    turns = Scripted(answer, rounds=2)
    r = generate(m, PROMPTS, 40, eos, 0, temperature=1.0, turns=turns, use_cache=use_cache,
                 generator=torch.Generator().manual_seed(3))
    assert turns.seen  # some turns ended and were answered
    for g in range(len(PROMPTS)):
        ids = r.completion_ids[g][r.completion_mask[g]].tolist()
        own = r.model_mask[g][r.completion_mask[g]].tolist()
        # the row, rebuilt from what the model said and what answered it
        rebuilt, flags = [], []
        for k, turn in enumerate(turns.seen.get(g, [])):
            rebuilt += turn
            flags += [True] * len(turn)
            if k < 2:
                rebuilt += answer
                flags += [False] * len(answer)
        tail = ids[len(rebuilt):]  # the unfinished turn of a row cut off, if any
        assert ids[:len(rebuilt)] == rebuilt and own == flags + [True] * len(tail)
        assert r.finished[g] == (not tail and len(turns.seen.get(g, [])) == 3)
        assert turns.cuts.get(g, []) == tail
    assert (r.logprobs[~r.model_mask] == 0).all()
    # the engine's log-probs of the model's tokens are those of the training pass over the
    # whole conversation (its cache continued through the answers)
    lp = completion_logprobs(m, r.prompt_ids, r.prompt_mask, r.completion_ids,
                             r.completion_mask)
    torch.testing.assert_close(lp[r.model_mask], r.logprobs[r.model_mask], rtol=0, atol=1e-5)


def test_an_answer_that_does_not_fit_ends_the_row_as_cut_off():
    m, eos = eos_heavy()
    turns = Scripted(list(range(4, 24)) * 3, rounds=5)  # 60 ids: never fits in 24
    r = generate(m, PROMPTS, 24, eos, 0, turns=turns, generator=torch.Generator().manual_seed(3))
    for g, seen in turns.seen.items():
        assert not r.finished[g] and len(seen) == 1 and turns.cuts[g] == "unanswered"
        assert torch.equal(r.model_mask[g], r.completion_mask[g])


@pytest.mark.parametrize("budget, own, finished, cut", [
    # a turn is [7, 8, EOS]; each answer 3 ids; two rounds answered, then the row is over
    (20, "TTTFFFTTTFFFTTT", True, None),
    (14, "TTTFFFTTTFFFTT", False, [7, 8]),  # out of tokens in its third turn
    (8, "TTTFFFTT", False, [7, 8]),
    (6, "TTT", False, "unanswered"),  # the answer fits, but no token of its own after it
])
def test_vllm_s_rounds_keep_the_native_engine_s_rules(budget, own, finished, cut):
    """protocol.complete_turns drives the same TurnState as native.generate: where answers
    go, what is the model's own, when a row is finished or cut off."""
    from types import SimpleNamespace

    from mini_grpo.engines.base import Sampling
    from mini_grpo.engines.protocol import complete_turns, to_rollout
    from mini_grpo.engines.turns import TurnState

    def request(prefixes, budgets, seeds):  # each turn [7, 8, EOS], cut to the row's budget
        return [[7, 8, 3][:b] for b in budgets], [[-1.0, -1.0, -1.0][:b] for b in budgets]

    turns = Scripted([4, 5, 20], rounds=2)
    prompts = [[1, 2]] * len(PROMPTS)
    state = TurnState(turns, len(prompts), budget)
    toks, lps = complete_turns(request, state, prompts, budget, [3], [0] * len(prompts))
    tok = SimpleNamespace(pad_id=0, eos_ids=[3], decode=str)
    r = state.rollout(to_rollout(tok, prompts, toks, lps, "cpu", Sampling(budget)))
    for g in range(len(prompts)):
        mine = r.model_mask[g][r.completion_mask[g]]
        assert "".join("T" if x else "F" for x in mine.tolist()) == own
        assert r.completion_ids[g][r.completion_mask[g]][~mine].tolist() == \
            [4, 5, 20] * own.count("FFF")
        assert (r.logprobs[g][r.completion_mask[g]][~mine] == 0).all()
        assert bool(r.finished[g]) == finished and turns.cuts.get(g) == cut


def test_a_rollout_says_which_tokens_are_the_model_s():
    """No engine can leave model_mask out (it is required) or give it another shape."""
    from conftest import make_rollout

    from mini_grpo.engines.base import Rollout, Sampling

    ids, mask = torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(TypeError, match="model_mask"):
        Rollout(prompt_ids=ids, prompt_mask=mask, completion_ids=ids, completion_mask=mask,
                logprobs=torch.zeros(2, 3), finished=mask[:, 0], nonfinite=torch.tensor(False),
                sampling=Sampling(3))
    with pytest.raises(ValueError, match=r"model_mask is \(2, 2\), completion_ids \(2, 3\)"):
        make_rollout(ids, mask, ids, mask, model_mask=mask[:, :2])


def rollout_with_answers(m, eos, answer):
    """Two groups of two rows (a group shares its prompt)."""
    return generate(m, [PROMPTS[0]] * 2 + [PROMPTS[1]] * 2, 40, eos, 0,
                    turns=Scripted(answer, rounds=2), generator=torch.Generator().manual_seed(3))


def test_the_loss_and_its_gradient_leave_the_tools_tokens_out():
    """The trainer's loss (through the Trajectory) equals a loss written by hand over the
    model's tokens alone, gradients included; another answer's tokens change the later
    tokens' log-probs but add no loss term of their own."""
    m, eos = eos_heavy()
    cfg = tiny(group_size=2, beta=0.0, loss_agg="dapo")
    r = rollout_with_answers(m, eos, [4, 5, 20])
    assert (r.completion_mask & ~r.model_mask).any()
    traj = Trajectory.of(r, torch.tensor([1.0, 0.0, 0.5, 2.0]), cfg)
    assert traj.num_tokens == r.model_mask.sum()
    m.zero_grad()
    policy_pass(m, traj, cfg)
    ours = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    lp = completion_logprobs(m, r.prompt_ids, r.prompt_mask, r.completion_ids,
                             r.completion_mask)
    keep = r.model_mask.float()
    ratio = torch.exp(lp - lp.detach())  # 1, with the policy gradient's derivative
    by_hand = -(traj.advantages[:, None] * ratio * keep).sum() / keep.sum()
    by_hand.backward()
    for a, b in zip(ours, (p.grad for p in m.parameters())):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # another tool output: same loss tokens, other log-probs after it
    other = rollout_with_answers(m, eos, [4, 5, 17])
    first = (r.completion_mask & ~r.model_mask).int().argmax(1)
    g = int((r.completion_mask & ~r.model_mask).any(1).int().argmax())
    n = int(first[g]) + 3
    assert torch.equal(r.completion_ids[g, :n - 1], other.completion_ids[g, :n - 1])
    lp_other = completion_logprobs(m, other.prompt_ids, other.prompt_mask,
                                   other.completion_ids, other.completion_mask)
    assert not other.model_mask[g, n - 1] and other.model_mask[g, n]
    assert (lp[g, n] - lp_other[g, n]).abs() > 1e-6 or \
        r.completion_ids[g, n] != other.completion_ids[g, n]


def test_hostile_turns_come_back_as_error_messages_and_stay_bounded(tmp_path):
    """What a model may write at its worst, through the whole turn: parsed, run, answered,
    rendered; nothing raises, nothing runs, every answer is short."""
    ours, _ = tokenizers(tmp_path, QWEN25)
    setup = ToolSetup(lambda: ToolEnv(resolve_tools(["calculator"]), 200), 4, 10.0)
    hostile = {
        "huge": None,  # a call of 10 MB, below
        "deep": "<tool_call>" + "[" * 10_000 + "]" * 10_000 + "</tool_call>",
        "unknown": '<tool_call>{"name": "shell", "arguments": {"cmd": "rm -rf /"}}</tool_call>',
        "import": '<tool_call>{"name": "calculator", "arguments": {"expression": '
                  '"__import__(\'os\').system(\'touch pwned\')"}}</tool_call>',
        "many": '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}'
                '</tool_call>' * 10_000,
        "power": '<tool_call>{"name": "calculator", "arguments": {"expression": "9**9**9"}}'
                 '</tool_call>',
    }
    turns = Turns(setup, ours, ["q"] * len(hostile))
    t0 = time.process_time()  # CPU-bound (its threads' time included), not the wall clock
    replies = [ours.encode(text) + [ours.eos_id] for text in hostile.values() if text]
    piece = ours.encode("431 * 254 + ")  # ids decode to the concatenation of their texts
    replies.insert(0, ours.encode('<tool_call>{"name": "calculator", "arguments": '
                                  '{"expression": "') + piece * (10_000_000 // 12) +
                   ours.encode('1"}}</tool_call>') + [ours.eos_id])
    nxt = turns.end_turn(list(range(len(hostile))), replies)
    assert time.process_time() - t0 < 60  # bounded: no 9**9**9, no 10 MB parse
    assert not (tmp_path / "pwned").exists()
    for (name, _), ids, talk in zip(hostile.items(), nxt, turns.conversations()):
        answers = [m["content"] for m in talk if m["role"] == "tool"]
        assert ids is not None and answers, name
        if name != "many":
            assert len(answers) == 1 and answers[0].startswith("error:"), (name, answers)
        assert len(ours.decode(ids)) < 200 * 17 + 1000, name
    many = [m["content"] for m in turns.conversations()[4] if m["role"] == "tool"]
    assert many[:16] == ["2"] * 16 and "9984 more calls left out" in many[16]
    calls, failed, rounds, capped, broken = turns.counts.sum(0).tolist()
    assert rounds == len(hostile) and capped == broken == 0 and failed == calls - 16  # "many"'s 16 ran


def test_a_slow_or_failing_environment_answers_with_an_error_and_the_cap_ends_rows(tmp_path):
    ours, _ = tokenizers(tmp_path, CHATML)

    class Slow:
        def reset(self, example):
            return None

        def step(self, reply):
            if "slow" in reply:
                time.sleep(3)
            if "boom" in reply:
                raise RuntimeError("the environment broke\nsecond line")
            return Step([{"role": "tool", "content": "ok"}], done=False, calls=1)

    turns = Turns(ToolSetup(Slow, 1, 0.5), ours, ["a", "b", "c"])
    first = turns.end_turn([0, 1, 2], [ours.encode(t) + [ours.eos_id]
                                       for t in ("slow", "boom", "fine")])
    answers = [talk[-1]["content"] for talk in turns.conversations()]
    assert answers[0] == "error: no answer within 0.5 s (tool_timeout)"
    assert answers[1] == "error: the environment broke" and answers[2] == "ok"
    # an environment's errors come in the user's role: every chat template takes it
    assert [talk[-1]["role"] for talk in turns.conversations()] == ["user", "user", "tool"]
    assert all(ids is not None for ids in first)
    again = turns.end_turn([2], [ours.encode("fine") + [ours.eos_id]])  # max_rounds 1: capped
    assert again == [None] and turns.counts[2].tolist() == [2, 0, 1, 1, 0]
    assert turns.last_replies()[2] == "fine"
    turns.unanswered(0)  # its answer did not fit: it never reached the model
    assert [m["role"] for m in turns.conversations()[0]] == ["assistant"]
    assert turns.counts[0, 2] == 0


def test_each_step_has_its_own_timeout_and_a_hung_one_is_never_stepped_again(tmp_path):
    """The rows whose turns ended together step at once, a thread each: tool_timeout counts
    from a step's own start (with a pool of num_reward_workers, 2, steps queued behind the
    first two were answered "no answer" without running). A step that has not returned is
    not called again on its environment: its row ends at its next turn."""
    import threading

    ours, _ = tokenizers(tmp_path, CHATML)
    release, entered = threading.Event(), []

    class Env:
        def reset(self, example):
            return None

        def step(self, reply):
            entered.append(reply)
            if reply == "hang":
                release.wait(60)
            else:
                time.sleep(0.3)
            return Step([{"role": "user", "content": "ok"}], done=False)

    turns = Turns(ToolSetup(Env, 4, 2.0), ours, ["q"] * 9)
    try:
        nxt = turns.end_turn(list(range(9)), [ours.encode(t) + [ours.eos_id]
                                              for t in ["hang"] + ["fine"] * 8])
        answers = [talk[-1]["content"] for talk in turns.conversations()]
        assert answers == ["error: no answer within 2 s (tool_timeout)"] + ["ok"] * 8
        assert all(ids is not None for ids in nxt)
        again = turns.end_turn([0, 1], [ours.encode("more") + [ours.eos_id]] * 2)
        assert again[0] is None and again[1] is not None  # row 0's step still runs: it ends
        assert entered.count("more") == 1 and len(entered) == 10
    finally:
        release.set()


def test_a_turn_s_calls_each_get_the_timeout_and_the_answers_that_came_are_kept():
    """Three calls in one turn, one of them slow: the two that answered keep their results,
    the slow one is answered "no answer"; three calls counted, one failed (the whole turn's
    step timed out before, and its answers were lost: one call, one failed)."""
    import threading

    release = threading.Event()

    def slow(x: int) -> int:
        """Returns x, slowly.

        Args:
            x: a number
        """
        release.wait(60)
        return x

    env = ToolEnv({"calculator": calculator, "slow": slow}, timeout=0.5)
    call = '<tool_call>{{"name": "{}", "arguments": {}}}</tool_call>'
    try:
        st = env.step(call.format("calculator", '{"expression": "2+3"}') +
                      call.format("slow", '{"x": 1}') +
                      call.format("calculator", '{"expression": "6*7"}'))
    finally:
        release.set()
    assert [m["content"] for m in st.messages] == [
        "5", "error: no answer within 0.5 s (tool_timeout)", "42"]
    assert (st.calls, st.failed, st.done) == (3, 1, False)


_HANG = """
import sys, time
sys.path.insert(0, sys.argv[1])
from test_turns import tokenizers
from conftest import CHATML
from pathlib import Path
from mini_grpo.engines.turns import ToolSetup, Turns
from mini_grpo.envs import Step
class Env:
    def reset(self, example):
        return None
    def step(self, reply):
        time.sleep(3600)
ours, _ = tokenizers(Path(sys.argv[2]), CHATML)
turns = Turns(ToolSetup(Env, 4, 0.2), ours, ["q"])
print(turns.end_turn([0], [ours.encode("hi") + [ours.eos_id]]) != [None])
"""


def test_a_step_that_never_returns_does_not_keep_the_process_alive(tmp_path):
    """Its thread is a daemon: the process exits when its work is done (a ThreadPoolExecutor's
    thread is joined at exit, so a hung step kept `mini-grpo` from ever exiting)."""
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _HANG, os.path.dirname(__file__), str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr[-2000:]


@pytest.mark.parametrize("bad, needle", [
    (None, "step() returned None, not a mini_grpo.envs.Step"),
    ({"messages": []}, "step() returned {'messages': []}, not a mini_grpo.envs.Step"),
    (Step("higher", done=False), "messages must be a list of"),
    (Step([{"role": "user", "content": 3}], done=False), "messages must be a list of"),
    (Step([{"content": "x"}], done=False), "messages must be a list of"),
    # what RFT writes must read back (tasks/jsonl.py): answering roles, values strings
    (Step([{"role": "ipython", "content": "x"}], done=False),
     "messages must be a list of {'role': 'tool' | 'user' | 'system', 'content': str}"),
    (Step([{"role": "user", "content": "x", "calls": [1]}], done=False),
     "every value a string of at most 1048576 characters"),
    (Step([], done="no"), "done must be True or False, got 'no'"),
    (Step([], done=True, rewards=None), "rewards must be a dict of reward parts, got None"),
    (Step([], done=True, rewards={"won": float("nan")}), "reward part 'won' is nan"),
    (Step([], done=True, calls=-1), "calls must be an int in 0..16777216, got -1"),
    (Step([], done=True, calls=2**64), "calls must be an int in 0..16777216, got 1844"),
    (Step([], done=True, calls=1, failed=2), "failed (2) must be at most calls (1)"),
    ("reset", "reset(): messages must be a list of"),
])
def test_what_an_environment_returns_is_checked_and_the_error_names_it(tmp_path, bad, needle):
    from mini_grpo.envs import EnvError

    ours, _ = tokenizers(tmp_path, CHATML)

    class Broken:
        def reset(self, example):
            return {"role": "user"} if bad == "reset" else None

        def step(self, reply):
            return bad

    with pytest.raises(EnvError) as e:
        turns = Turns(ToolSetup(Broken, 4, 10.0, rewards=True), ours, ["q"])
        turns.end_turn([0], [ours.encode("hi") + [ours.eos_id]])
    assert str(e.value).startswith("environment test_turns:") and ".Broken: " in str(e.value)
    assert needle in str(e.value), str(e.value)


def test_tool_metrics_and_messages_reach_the_run(tmp_path):
    """A GRPO run with tools on a tiny Hugging Face model: prompts list the tool, rewards see
    the conversation, the step's metrics count calls and rounds."""
    from conftest import metrics, tiny_lm_dir

    from mini_grpo.job import train

    model = tiny_lm_dir(tmp_path / "lm", positions=1024)  # the tool list: ~770 tokens here
    cfg = tiny(tmp_path / "run", init_from=str(model), tools=json.dumps(["calculator"]),
               max_steps=2, eval_every=100, max_new_tokens=24, block_size=1024,
               prompts_per_step=2, group_size=2, save_every=100)
    train(cfg)
    rows = [r for r in metrics(tmp_path / "run") if "tools/calls" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["tools/calls"] >= 0 and 0 <= r["tools/capped_frac"] <= 1 for r in rows)


def test_the_example_game_answers_each_guess_and_rewards_the_right_one():
    from examples.guess_number import GuessNumber

    env = GuessNumber()
    assert env.reset("Game 1") is None
    secret = env.secret
    assert GuessNumber().reset("Game 1") is None and 1 <= secret <= 100
    low = env.step(f"I guess {secret - 1}" if secret > 1 else "0")
    assert not low.done and "higher" in low.messages[0]["content"]
    high = env.step(f"{secret + 1}")
    assert not high.done and "lower" in high.messages[0]["content"]
    right = env.step(f"It is {secret}.")
    assert right.done and right.rewards == {"solved": 1.0}
    assert env.step("no idea").done


def test_an_environment_named_in_the_config_answers_turns_and_its_rewards_count(tmp_path):
    """examples/guess_number.yaml's environment and reward plugin on a tiny model: the
    environment's reward parts are a column of the total (reward/env), the rounds counted."""
    from conftest import metrics, tiny_lm_dir

    from mini_grpo.job import train

    model = tiny_lm_dir(tmp_path / "lm")
    cfg = tiny(tmp_path / "run", init_from=str(model), task="jsonl",
               data_path="examples/guess_number.jsonl",
               environment="examples.guess_number:GuessNumber",
               rewards=json.dumps([{"name": "examples.guess_number:guesses", "weight": 1.0}]),
               max_steps=2, eval_every=100, max_new_tokens=40, block_size=256,
               temperature=1.5, prompts_per_step=2, group_size=4, save_every=100)
    train(cfg)
    rows = [r for r in metrics(tmp_path / "run") if "reward/env/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # the plugin counted the model's turns in the conversation it was given
        assert r["reward/guesses/mean"] == pytest.approx(-0.05 * (1 + r["tools/rounds"]))


def test_an_environment_that_is_not_one_is_refused_by_name():
    from mini_grpo.engines.turns import environment_class
    from mini_grpo.fields import ConfigError

    with pytest.raises(ConfigError, match="environment 'examples.guess_number:guesses': must "
                                          "be a class with reset"):
        environment_class("examples.guess_number:guesses")


def test_a_demonstration_trains_the_model_s_messages_only(tmp_path):
    """sft_batch on a multi-turn demonstration: the row is the conversation as the rollout
    would hold it (it decodes to transformers' rendering), and only the model's messages and
    their EOS carry labels."""
    from mini_grpo.data import sft_batch

    ours, hf = tokenizers(tmp_path, QWEN25)
    talk = [{"role": "assistant", "content": CALL},
            {"role": "tool", "name": "calculator", "content": "109474"},
            {"role": "assistant", "content": "<answer>109474</answer>"}]
    x, y = sft_batch(ours, [("What is 431 * 254?", talk), ("What is 2 * 3?", "<answer>6</answer>")])
    row = x[0].tolist() + [y[0, -1].item()]
    whole = hf.apply_chat_template([{"role": "user", "content": "What is 431 * 254?"}, *talk],
                                   tools=[calculator], tokenize=False)
    assert ours.tk.decode(row, skip_special_tokens=False) + "\n" == whole
    labelled = ours.tk.decode([t for t in y[0].tolist() if t >= 0], skip_special_tokens=False)
    assert labelled == CALL + "<|im_end|><answer>109474</answer><|im_end|>"
    short = [t for t in y[1].tolist() if t >= 0]
    assert ours.tk.decode(short, skip_special_tokens=False) == "<answer>6</answer><|im_end|>"
    with pytest.raises(ValueError, match="conversation: must open and end"):
        sft_batch(ours, [("q", talk[:2])])


def test_the_calculator_task_s_demonstrations_are_right_and_its_split_is_clean():
    from mini_grpo.rewards.answers import numeric_answer

    cfg = tiny(task="calculator", task_args=json.dumps({"num_train": 600}), num_eval=60)
    from mini_grpo.tasks import build_task

    data = build_task(cfg)
    assert {ex.prompt for ex in data.train}.isdisjoint(ex.prompt for ex in data.eval)
    rows = data.train + data.eval
    answers = [ex.meta["conversation"][-1]["content"] for ex in rows]
    assert numeric_answer([], answers, [ex.target for ex in rows], [ex.meta for ex in rows]) \
        == [1.0] * len(rows)
    for ex in rows:  # the demonstration's tool answer is the calculator's own
        call = json.loads(ex.meta["conversation"][0]["content"].split("\n")[1])
        assert calculator(**call["arguments"]) == ex.meta["conversation"][1]["content"]
    kinds = [ex.meta["kind"] for ex in data.train]
    assert 0.4 < kinds.count("mul3") / len(kinds) < 0.6  # weights 2 : 1 : 1
    assert build_task(cfg).train[0].prompt == data.train[0].prompt  # from the seed
    with pytest.raises(Exception, match="task_args.weights: one positive number per kind"):
        tiny(task="calculator", task_args=json.dumps({"kinds": ["mul3"]}))


def test_sft_on_demonstrations_then_grpo_with_tools_runs(tmp_path, capsys):
    """The calculator job's path on a tiny model: SFT on the task's demonstrations (tool
    tokens unlabelled), then GRPO with the tool; sample, evaluate and export take its
    checkpoint."""
    from conftest import metrics, tiny_lm_dir

    from mini_grpo.job import train

    model = tiny_lm_dir(tmp_path / "lm", positions=1024)
    cfg = tiny(tmp_path / "run", init_from=str(model), task="calculator", mode="sft_grpo",
               task_args=json.dumps({"num_train": 64}), tools=json.dumps(["calculator"]),
               sft_steps=3, sft_batch_size=4, max_steps=2, eval_every=100, max_new_tokens=40,
               block_size=1024, prompts_per_step=2, group_size=2, save_every=100)
    train(cfg)
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows if "sft/loss" in r] == [1, 2, 3]
    assert [r["step"] for r in rows if "tools/calls" in r] == [1, 2]
    # the commands take its checkpoint, the tool with it: sample prints the conversation,
    # evaluate counts the calls, export writes the model
    from mini_grpo.checkpoint import list_checkpoints
    from mini_grpo.cli import main

    ckpt = str(list_checkpoints(tmp_path / "run" / "checkpoints")[-1])
    capsys.readouterr()
    assert main(["sample", "--checkpoint", ckpt, "--prompt", "What is 12 * 34?", "--json",
                 "--max_new_tokens", "8"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["messages"][0]["role"] == "assistant"
    assert main(["evaluate", "--checkpoint", ckpt, "--num_eval=4", "--max_new_tokens=8",
                 "--json", str(tmp_path / "e.json")]) == 0
    assert "tools/calls" in json.loads((tmp_path / "e.json").read_text())["greedy"]
    assert main(["export", "--checkpoint", ckpt, "--output", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_a_multi_turn_run_killed_mid_run_resumes_to_the_straight_run_s_weights(tmp_path):
    """The guess-the-number environment answers every turn that ends (a random model seldom
    guesses right), so rollouts span several rounds. A run that dies abruptly at step 3 (no
    cleanup: os._exit, as after kill -9) and is started again ends with the weights and
    metrics rows of the run left alone, bit for bit (fp32 on a CPU)."""
    import subprocess
    import sys

    from conftest import ROOT, clean_env, entry, tiny_lm_dir
    from safetensors.torch import load_file

    model = tiny_lm_dir(tmp_path / "lm")
    args = ["--config", "tiny", "--mode=grpo", "--use_amp=false", "--device=cpu",
            "--reward_executor=serial", "--num_eval=4", f"--init_from={model}",
            "--task=jsonl", "--data_path=examples/guess_number.jsonl",
            "--environment=examples.guess_number:GuessNumber",
            '--rewards=[{"name": "examples.guess_number:guesses", "weight": 1.0}]',
            "--max_steps=4", "--save_every=1", "--eval_every=100", "--max_new_tokens=160",
            "--block_size=512", "--temperature=1.5", "--prompts_per_step=2",
            "--group_size=4", "--report_to=[]"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    r = entry(*args, f"--out_dir={straight}")
    assert r.returncode == 0, r.stderr[-3000:]
    crash = subprocess.run([sys.executable, str(ROOT / "tests" / "fault_worker.py"),
                            "--fault=crash:3", "--", *args, f"--out_dir={killed}"],
                           capture_output=True, text=True, cwd=ROOT, env=clean_env(),
                           timeout=300)
    assert crash.returncode == 13 and "exits abruptly at step 3" in crash.stdout, \
        crash.stderr[-3000:]
    r = entry(*args, f"--out_dir={killed}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming GRPO from step 2" in r.stdout

    def rows(out):
        timing = ("time/", "per_s", "seconds", "mem/")
        return [{k: v for k, v in json.loads(line).items() if not any(t in k for t in timing)}
                for line in (out / "metrics.jsonl").read_text().splitlines()]

    steps = [row for row in rows(straight) if "tools/rounds" in row]
    # multi-turn: a random model ends a turn (EOS, 1 token in 300) in ~40% of 160 tokens
    assert len(steps) == 4 and sum(row["tools/rounds"] for row in steps) > 0.5
    assert rows(killed) == rows(straight)
    a, b = (load_file(out / "hf" / "model.safetensors") for out in (straight, killed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


GUESS = ["--config", "tiny", "--mode=grpo", "--use_amp=false", "--device=cpu",
         "--reward_executor=serial", "--num_eval=4", "--task=jsonl",
         "--data_path=examples/guess_number.jsonl",
         "--environment=examples.guess_number:GuessNumber",
         '--rewards=[{"name": "examples.guess_number:guesses", "weight": 1.0}]',
         "--max_steps=2", "--eval_every=100", "--save_every=100", "--max_new_tokens=160",
         "--block_size=512", "--temperature=1.5", "--prompts_per_step=2", "--group_size=4",
         "--report_to=[]"]


@pytest.mark.parametrize("how", ["lora", "fsdp"])
def test_multi_turn_rollouts_train_lora_adapters_and_under_fsdp(tmp_path, how):
    """The guess-the-number environment with LoRA adapters (one process) and under FSDP (2
    ranks, each its own rows' environments): the turns are answered (rounds counted), the
    run ends, and LoRA's base stays as it was."""
    from conftest import entry, metrics, tiny_lm_dir, torchrun
    from safetensors.torch import load_file

    model = tiny_lm_dir(tmp_path / "lm")
    args = [*GUESS, f"--init_from={model}", f"--out_dir={tmp_path / 'run'}"]
    if how == "lora":
        r = entry(*args, "--lora_r=4", "--lr=1e-2")
    else:
        r = torchrun("distributed_train.py", *args, "--parallelism=fsdp")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [m for m in metrics(tmp_path / "run") if "tools/rounds" in m]
    assert [m["step"] for m in rows] == [1, 2] and sum(m["tools/rounds"] for m in rows) > 0
    if how == "fsdp":
        assert "rank 1 holds (fsdp over 2)" in r.stdout
    else:  # the exported model is the base with the adapters folded in: it moved
        base, out = (load_file(d / "model.safetensors") for d in (model, tmp_path / "run/hf"))
        assert any(not torch.equal(out[k], v) for k, v in base.items() if k in out)
