"""Tool calls in the model family's own format (issue 40): Hermes `<tool_call>` blocks, Llama
3.x bare JSON calls, Mistral's `[TOOL_CALLS]`; the format told from the chat template, the
tokenizer's reading of it, and the tool messages rendered through short imitations of Llama
3.1's and Mistral's templates. Whatever the model writes is read within bounds and never
raises."""

import json
import time

import pytest
from conftest import CHATML, tiny

from mini_grpo.conversation import continuation
from mini_grpo.engines.turns import ToolSetup, Turns
from mini_grpo.envs import ToolEnv
from mini_grpo.tokenizer import CharTokenizer, HFTokenizer
from mini_grpo.tool_calls import CALL_FORMATS, MAX_CALLS, ToolCall, call_format, parse_tool_calls
from mini_grpo.tools import calculator, resolve_tools, run_call, tool_schemas

# Llama 3.1's tool handling, in short: the tool list and its prompt in the first user
# message, a tool's result as an `ipython` message (its content as JSON)
LLAMA31 = (
    "{{- bos_token }}{%- if tools is not defined %}{%- set tools = none %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools is not none %}{{- 'Environment: ipython\\n' }}{%- endif %}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' or message.role == 'ipython' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content | tojson"
    " + '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' }}"
    "{%- if loop.first and tools is not none %}"
    "{{- 'Given the following functions, please respond with a JSON for a function call '"
    " + 'with its proper arguments that best answers the given prompt.\\n\\n' }}"
    "{%- for t in tools %}{{- t | tojson(indent=4) + '\\n\\n' }}{%- endfor %}{%- endif %}"
    "{{- message.content | trim + '<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}")

# what Mistral's templates check: user and assistant alternate, a message with tool_calls
# (and a tool message) apart
ALTERNATE = (
    "{%- set ns = namespace(index=0) %}{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "{%- if (message.role == 'user') != (ns.index % 2 == 0) %}"
    "{{- raise_exception('conversation roles must alternate user/assistant/user/assistant') }}"
    "{%- endif %}{%- set ns.index = ns.index + 1 %}{%- endif %}{%- endfor %}")
ID_CHECK = ("{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!')"
            " }}")
# Mistral v3 (7B-Instruct-v0.3): calls as a JSON list with ids, results by call id
MISTRAL_V3 = (
    ALTERNATE + "{%- if tools is not defined %}{%- set tools = none %}{%- endif %}"
    "{{- bos_token }}{%- for message in messages %}{%- if message.role == 'user' %}"
    "{%- if tools is not none and loop.first %}"
    "{{- '[AVAILABLE_TOOLS] ' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{{- '[INST] ' + message.content + '[/INST]' }}"
    "{%- elif message.tool_calls %}{{- '[TOOL_CALLS] [' }}{%- for c in message.tool_calls %}"
    "{%- if c.id | length != 9 %}" + ID_CHECK + "{%- endif %}"
    "{{- (c.function | tojson)[:-1] + ', \"id\": \"' + c.id + '\"}' }}"
    "{{- ', ' if not loop.last else ']' + eos_token }}{%- endfor %}"
    "{%- elif message.role == 'assistant' %}{{- ' ' + message.content | trim + eos_token }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if message.tool_call_id is not defined or message.tool_call_id | length != 9 %}"
    + ID_CHECK + "{%- endif %}"
    "{{- '[TOOL_RESULTS] {\"content\": ' + message.content | string + ', \"call_id\": \"'"
    " + message.tool_call_id + '\"}[/TOOL_RESULTS]' }}{%- endif %}{%- endfor %}")
# Mistral since 2025 (Small 3.2, Ministral 3): [TOOL_CALLS]name[ARGS]{...}, results plain
MISTRAL_2025 = (
    ALTERNATE + "{{- bos_token }}{%- if tools is defined and tools %}"
    "{{- '[AVAILABLE_TOOLS]' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}"
    "{{- '[INST]' + message.content + '[/INST]' }}"
    "{%- elif message.role == 'assistant' %}{{- message.content }}"
    "{%- for c in message.tool_calls or [] %}"
    "{{- '[TOOL_CALLS]' + c.function.name + '[ARGS]' + c.function.arguments | tojson }}"
    "{%- endfor %}{{- eos_token }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '[TOOL_RESULTS]' + message.content | string + '[/TOOL_RESULTS]' }}"
    "{%- endif %}{%- endfor %}")
QWEN_SNIPPET = ("{%- if tools %}{{- '<tools>' + tools | tojson + '</tools> For each function "
                "call, return <tool_call></tool_call>' }}{%- endif %}" + CHATML)

LLAMA_TOKENS = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
                "<|python_tag|>", "<|eom_id|>"]
MISTRAL_TOKENS = ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                  "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[ARGS]",
                  "[CALL_ID]"]
CHATML_TOKENS = ["<|endoftext|>", "<|im_end|>", "<|im_start|>"]

CALC = {"name": "calculator", "arguments": {"expression": "431 * 254"}}
ADD = {"name": "calculator", "arguments": {"expression": "2+2"}}


def written(fmt: str, calls: list[dict]) -> str:
    """A reply with `calls`, as the family writes it."""
    if fmt == "hermes":
        return "Let me compute. " + " ".join(
            f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls)
    if fmt == "llama3":
        return "<|python_tag|>" + "; ".join(
            json.dumps({"name": c["name"], "parameters": c["arguments"]}) for c in calls)
    return "[TOOL_CALLS][" + ", ".join(json.dumps(c) for c in calls) + "]"


# ---- reading calls

@pytest.mark.parametrize("fmt", CALL_FORMATS)
def test_each_format_reads_one_call_several_and_arguments_as_a_string(fmt):
    assert parse_tool_calls(written(fmt, [CALC]), fmt) == [ToolCall(
        "calculator", {"expression": "431 * 254"})]
    assert parse_tool_calls(written(fmt, [CALC, ADD, CALC]), fmt) == [
        ToolCall("calculator", {"expression": e}) for e in ("431 * 254", "2+2", "431 * 254")]
    as_string = {"name": "calculator", "arguments": json.dumps({"expression": "2+2"})}
    assert parse_tool_calls(written(fmt, [as_string]), fmt) == [
        ToolCall("calculator", {"expression": "2+2"})]
    bad = {"name": "calculator", "arguments": 3}
    assert parse_tool_calls(written(fmt, [bad]), fmt)[0].error == \
        "arguments must be a JSON object"


@pytest.mark.parametrize("fmt", CALL_FORMATS)
@pytest.mark.parametrize("prose", [
    "", "The answer is 109474.", "I would write {\"name\": \"calculator\", \"parameters\": {}}.",
    "Use JSON: " + json.dumps(CALC), "[1, 2, 3] and {\"a\": 1}", "<|python_tag|> done"])
def test_prose_is_no_call_in_any_format(fmt, prose):
    assert parse_tool_calls(prose, fmt) == []


def test_llama3_calls_are_the_whole_reply_with_parameters_or_arguments():
    both = ('\n {"name": "calculator", "parameters": {"expression": "1+1"}}\n'
            '{"name": "lookup", "arguments": {"city": "Oslo"}};{"name": "x"}')
    assert parse_tool_calls(both, "llama3") == [
        ToolCall("calculator", {"expression": "1+1"}), ToolCall("lookup", {"city": "Oslo"}),
        ToolCall("x", {})]
    # text after the calls is left; an unreadable call ends them (the rest is not told
    # from prose)
    assert parse_tool_calls(json.dumps(ADD) + " Then I add.", "llama3") == [
        ToolCall("calculator", {"expression": "2+2"})]
    calls = parse_tool_calls('{"name": "a"}; {"name": oops}; {"name": "b"}', "llama3")
    assert calls == [ToolCall("a", {}), ToolCall("", {}, "cannot read the call: not valid JSON")]
    assert parse_tool_calls('{"nme": "a"}', "llama3")[0].error == \
        'a call is {"name": "...", "parameters": {...}}'


def test_mistral_reads_the_v3_list_and_the_2025_form_after_any_prose():
    text = ('Sure. [TOOL_CALLS]calculator[ARGS]{"expression": "1+1"}'
            '[TOOL_CALLS]lookup[CALL_ID]a1b2c3d4e[ARGS] {"city": "[TOOL_CALLS]x[ARGS]{}"}')
    assert parse_tool_calls(text, "mistral") == [
        ToolCall("calculator", {"expression": "1+1"}),
        ToolCall("lookup", {"city": "[TOOL_CALLS]x[ARGS]{}"})]  # a marker in a string: data
    v3 = ('[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "1+1"}, '
          '"id": "a1b2c3d4e"}]')
    assert parse_tool_calls(v3, "mistral") == [ToolCall("calculator", {"expression": "1+1"})]
    assert parse_tool_calls("[TOOL_CALLS] []", "mistral") == []
    for text, needle in (("[TOOL_CALLS] I will not", "a call is [TOOL_CALLS]["),
                         ("[TOOL_CALLS] [1]", "a call is [TOOL_CALLS]["),
                         ('[TOOL_CALLS] [{"name": "a"} {"name": "b"}]', "not valid JSON"),
                         ('[TOOL_CALLS] [{"name": "a"}', "not valid JSON"),
                         ('[TOOL_CALLS]calc[ARGS]{"x": 1', "not valid JSON")):
        calls = parse_tool_calls(text, "mistral")
        assert needle in calls[-1].error and not calls[-1].name, text


def hostile(fmt: str) -> dict[str, str]:
    """What a model may write at its worst, in format `fmt`."""
    if fmt == "hermes":
        wrap, sep = (lambda body: f"<tool_call>{body}</tool_call>"), ""
    elif fmt == "llama3":
        wrap, sep = (lambda body: body), "; "
    else:
        wrap, sep = (lambda body: f"[TOOL_CALLS][{body}]"), ""
    return {"huge": wrap('{"name": "calculator", "arguments": {"expression": "' +
                         "1+" * 5_000_000 + '1"}}'),
            "deep": wrap('{"name": "x", "arguments": ' + "[" * 10_000 + "]" * 10_000 + "}"),
            "deep_objects": wrap('{"name": "x", "arguments": ' + '{"a":' * 10_000 + "1" +
                                 "}" * 10_001),
            "many": sep.join([wrap(json.dumps(ADD))] * 10_000),
            "unknown": wrap('{"name": "shell", "arguments": {"cmd": "rm -rf /"}}'),
            # runs of spaces where a reader might try each split of them (Mistral's named
            # form, an optional id between two runs: 16,000 spaces took 5 s, quadratic)
            "spaces": "[TOOL_CALLS]calc[CALL_ID]" + " " * 200_000 + "x" if fmt == "mistral"
            else wrap('{"name":' + " " * 200_000 + "x")}


@pytest.mark.parametrize("fmt", CALL_FORMATS)
def test_hostile_replies_are_bounded_and_never_raise(fmt):
    t0 = time.process_time()
    texts = hostile(fmt)
    huge = parse_tool_calls(texts["huge"], fmt)
    assert huge == [ToolCall("", {}, "call longer than 65536 bytes")]
    for name in ("deep", "deep_objects"):
        calls = parse_tool_calls(texts[name], fmt)
        assert len(calls) == 1 and "nested deeper than 32 levels" in calls[0].error, name
    many = parse_tool_calls(texts["many"], fmt)
    assert many[:MAX_CALLS] == [ToolCall("calculator", {"expression": "2+2"})] * MAX_CALLS
    assert many[MAX_CALLS:] == [ToolCall(
        "", {}, f"{10_000 - MAX_CALLS} more calls left out: at most {MAX_CALLS} a turn")]
    unknown = parse_tool_calls(texts["unknown"], fmt)
    assert unknown == [ToolCall("shell", {"cmd": "rm -rf /"})]  # a name: run_call refuses it
    assert run_call({"calculator": calculator}, unknown[0]) == \
        "error: unknown tool 'shell' (tools: calculator)"
    spaces = parse_tool_calls(texts["spaces"], fmt)
    assert len(spaces) == 1 and spaces[0].error and not spaces[0].name
    assert time.process_time() - t0 < 20  # a bound for a hang, not a timing


# ---- the format, from the chat template

@pytest.mark.parametrize("template, fmt", [
    (LLAMA31, "llama3"), (MISTRAL_V3, "mistral"), (MISTRAL_2025, "mistral"),
    (QWEN_SNIPPET, "hermes"), (CHATML, "hermes"), (None, "hermes"), ("", "hermes"),
    ("{{ '<|python_tag|>' }}", "llama3"), ("{% if m.role == 'ipython' %}{% endif %}", "llama3")],
    ids=["llama31", "mistral_v3", "mistral_2025", "qwen", "chatml", "none", "empty",
         "python_tag", "ipython"])
def test_the_format_is_told_from_the_template(template, fmt):
    assert call_format(template) == fmt


def tokenizer(template: str, specials: list[str], tools: bool = True) -> HFTokenizer:
    """A tiny byte-level BPE with the family's special tokens (the first is BOS, the second
    EOS), configured with the calculator (or no tools)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator([json.dumps(CALC), "What is 431 * 254?"], trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = HFTokenizer(tk, {"bos_token": specials[0], "eos_token": specials[1]}, template)
    tok.configure_chat("auto", "", tool_schemas(["calculator"]) if tools else [])
    return tok


@pytest.mark.parametrize("template, specials, fmt", [
    (LLAMA31, LLAMA_TOKENS, "llama3"), (MISTRAL_V3, MISTRAL_TOKENS, "mistral"),
    (MISTRAL_2025, MISTRAL_TOKENS, "mistral"), (CHATML, CHATML_TOKENS, "hermes")],
    ids=["llama31", "mistral_v3", "mistral_2025", "chatml"])
def test_the_tokenizer_reads_calls_in_its_template_s_format(template, specials, fmt):
    tok = tokenizer(template, specials)
    assert tok.tools_in_template == (template is not CHATML)  # ChatML: TOOLS_PROMPT, Hermes
    assert tok.call_format == fmt
    assert tokenizer(template, specials, tools=False).call_format == "hermes"
    assert CharTokenizer("abc").call_format == "hermes"


def test_a_template_that_takes_no_tool_answer_is_refused_at_set_up():
    """Tools on a template whose roles are system, user and assistant only (Gemma's): the
    run was refused at the model's first call, minutes in; now at set-up. Each family's
    template takes the answer."""
    from mini_grpo.chat_template import ChatTemplateError
    from mini_grpo.conversation import check_tool_answer

    for template, specials in [(LLAMA31, LLAMA_TOKENS), (MISTRAL_V3, MISTRAL_TOKENS),
                               (MISTRAL_2025, MISTRAL_TOKENS), (CHATML, CHATML_TOKENS)]:
        check_tool_answer(tokenizer(template, specials))
    strict = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] "
              "%}{{ raise_exception('Conversation roles must be user/assistant') }}{% endif %}"
              "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
              "{% endif %}")
    with pytest.raises(ChatTemplateError, match="tools: a tool's answer cannot follow the "
                       "model's turn: .*Conversation roles must be user/assistant"):
        check_tool_answer(tokenizer(strict, CHATML_TOKENS))


def test_the_decoded_reply_keeps_the_special_tokens_calls_are_written_with():
    reply = '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "2+2"}}]'
    tok = tokenizer(MISTRAL_2025, MISTRAL_TOKENS)
    ids = tok.encode(reply) + [tok.eos_id]
    assert tok.encode("[TOOL_CALLS]") == [MISTRAL_TOKENS.index("[TOOL_CALLS]")]  # special
    assert tok.decode(ids) == reply
    assert tok.decode(tok.encode("[INST]a[ARGS]b[TOOL_CALLS]")) == "a[ARGS]b[TOOL_CALLS]"
    untooled = tokenizer(MISTRAL_2025, MISTRAL_TOKENS, tools=False)
    assert untooled.decode(ids) == reply[len("[TOOL_CALLS]"):]  # as before: specials dropped


# ---- the tool loop in each format: calls answered, rendered by the template

@pytest.mark.parametrize("template, specials, reply, result", [
    (LLAMA31, LLAMA_TOKENS, '<|python_tag|>{"name": "calculator", "parameters": '
     '{"expression": "2+2"}}', '<|start_header_id|>ipython<|end_header_id|>\n\n"4"<|eot_id|>'),
    (MISTRAL_V3, MISTRAL_TOKENS, '[TOOL_CALLS] [{"name": "calculator", "arguments": '
     '{"expression": "2+2"}}]', '[TOOL_RESULTS] {"content": 4, "call_id": "00000000{k}"}'
     '[/TOOL_RESULTS]'),
    (MISTRAL_2025, MISTRAL_TOKENS, '[TOOL_CALLS]calculator[ARGS]{"expression": "2+2"}',
     "[TOOL_RESULTS]4[/TOOL_RESULTS]"),
    (CHATML, CHATML_TOKENS, '<tool_call>{"name": "calculator", "arguments": '
     '{"expression": "2+2"}}</tool_call>', "<|im_start|>tool\n4<|im_end|>")],
    ids=["llama31", "mistral_v3", "mistral_2025", "chatml"])
def test_turns_answer_each_format_s_calls_through_its_template(template, specials, reply,
                                                               result):
    """Two rounds of a call through Turns (the tool loop ToolSetup.of builds, in the
    tokenizer's format), then an answer: each call is run, its result rendered as the
    template renders a tool message (Mistral's want call ids: conversation.py gives them)."""
    tok = tokenizer(template, specials)
    setup = ToolSetup.of(tiny(tools=json.dumps(["calculator"])))
    assert setup.tool_loop
    turns = Turns(setup, tok, ["What is 2+2?"])
    for k in (2, 4):  # the tool message's place in the conversation: Mistral v3's call id
        nxt = turns.end_turn([0], [tok.encode(reply) + [tok.eos_id]])
        answer = tok.tk.decode(nxt[0], skip_special_tokens=False)
        assert result.replace("{k}", str(k)) in answer, answer
        assert turns.conversations()[0][-1] == {"role": "tool", "name": "calculator",
                                                "content": "4"}
    assert turns.end_turn([0], [tok.encode("It is 4.") + [tok.eos_id]]) == [None]
    assert turns.counts[0].tolist() == [2, 0, 2, 0, 0]  # calls, failed, rounds, capped, broken


def test_a_mistral_tool_message_keeps_its_own_call_id_and_an_error_gets_one():
    tok = tokenizer(MISTRAL_V3, MISTRAL_TOKENS)
    history = tok.messages_of("What is 2+2?") + [{"role": "assistant", "content": "call"}]
    tools = [{"role": "tool", "content": "4", "tool_call_id": "a1b2c3d4e"},
             {"role": "tool", "content": "error: no answer"}]  # as Turns writes a timeout
    text = tok.tk.decode(continuation(tok, history, tools, tok.eos_id),
                         skip_special_tokens=False)
    assert '"call_id": "a1b2c3d4e"' in text and '"call_id": "000000003"' in text


def test_tool_env_reads_its_format_and_refuses_an_unknown_one():
    tools = resolve_tools(["calculator"])
    step = ToolEnv(tools, call_format="llama3").step(written("llama3", [ADD]))
    assert step.messages == [{"role": "tool", "name": "calculator", "content": "4"}]
    assert ToolEnv(tools).step(written("llama3", [ADD])).done  # Hermes: no call in it
    with pytest.raises(ValueError, match="call_format 'json': one of hermes, llama3, mistral"):
        ToolEnv(tools, call_format="json")
