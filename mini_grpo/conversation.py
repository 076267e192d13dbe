"""A conversation as tokens, the way a multi-turn rollout holds it: the model's turns as it
sampled them, and between them what answered (tools' results, an environment's messages) as
the chat template renders it. The turn loop (engines/turns.py) and SFT on demonstrations
(data.sft_batch) both build their rows here, so what SFT trains on is what rollouts hold.
For Mistral's templates (call_format "mistral") the tool messages get the call ids those
templates require (_mistral_ids).

    ids = continuation(tok, history, [{"role": "tool", "content": "56088"}], eos_id)
    ids, own = encode_conversation(tok, prompt, [assistant, tool, assistant])
"""

from __future__ import annotations

from .chat_template import ChatTemplateError
from .tokenizer import HFTokenizer

_MARK = "\x00mini-grpo reply\x00"  # stands for a reply, to find where the template closes it


def continuation(tok: HFTokenizer, conversation: list[dict], appended: list[dict],
                 ended_with: int | None) -> list[int]:
    """The ids that follow the model's turn, the last message of `conversation` (which
    ended with token `ended_with`, one of eos_ids), when the messages `appended` (tools'
    results, an environment's answer) come next and the model speaks again: the rest of
    the turn's closing as the template writes it, the appended messages, and the
    generation prompt. The model's own tokens are kept as it sampled them; only these are
    encoded. The model's messages are rendered as a short stand-in: what follows them
    does not depend on what they say, and a turn of any length renders in bounded time."""
    turn = [{**m, "content": _MARK} if m.get("role") == "assistant" else m
            for m in conversation]
    if tok.call_format == "mistral":
        turn, appended = _mistral_ids(turn, appended)
    before = tok.render(turn, False)
    after = tok.render(turn + appended, True)
    if not after.startswith(before) or _MARK not in before:
        raise ChatTemplateError(
            f"{tok.template.where}: the chat template renders the conversation before "
            f"a tool's message differently once the message follows it: it cannot be "
            f"continued token by token")
    closing = before[before.rfind(_MARK) + len(_MARK):]
    said = tok.tk.id_to_token(ended_with) if ended_with is not None else None
    if said and closing.startswith(said):  # the model wrote that much of the closing
        closing = closing[len(said):]
    return tok.encode(closing + after[len(before):])


def check_tool_answer(tok: HFTokenizer) -> None:
    """A tool's answer after a model's turn, rendered as a rollout's first one will be: a
    chat template that refuses it (one with no `tool` role, as Gemma's) is a
    ChatTemplateError at set-up, not at the model's first call, minutes into the run."""
    try:
        continuation(tok, [*tok.messages_of("?"), {"role": "assistant", "content": "?"}],
                     [{"role": "tool", "name": "tool", "content": "1"}], None)
    except ChatTemplateError as e:
        raise ChatTemplateError(f"tools: a tool's answer cannot follow the model's turn: {e}") \
            from None


def _mistral_ids(turn: list[dict], appended: list[dict]) -> tuple[list[dict], list[dict]]:
    """`turn` and `appended` as Mistral's templates take them: each tool message with a
    `tool_call_id` of 9 letters or digits (its own, or its place in the conversation), and
    each of the model's earlier messages that tools answered naming those calls in
    `tool_calls`, since the templates count a model's message without them in the
    user/assistant alternation they check. The calls' arguments are not known here and do not
    matter: only what follows the model's last message is kept."""
    messages = [dict(m) for m in turn + appended]
    for k, m in enumerate(messages):
        given = m.get("tool_call_id")
        if m.get("role") == "tool" and not (isinstance(given, str) and len(given) == 9 and
                                            given.isascii() and given.isalnum()):
            m["tool_call_id"] = f"{k:09d}"
    for k, m in enumerate(messages[:len(turn) - 1]):
        j = k + 1
        while j < len(turn) and messages[j].get("role") == "tool":
            j += 1
        if m.get("role") == "assistant" and j > k + 1:
            m["tool_calls"] = [{"id": a["tool_call_id"], "type": "function", "function": {
                "name": str(a.get("name", "")), "arguments": {}}} for a in messages[k + 1:j]]
    return messages[:len(turn)], messages[len(turn):]


def encode_conversation(tok: HFTokenizer, prompt: str | list[dict],
                        conversation: list[dict]) -> tuple[list[int], list[bool]]:
    """A multi-turn demonstration as a rollout would hold it: the prompt's ids, then each
    of the model's messages (`assistant`) as its text and EOS, and whatever answers it
    (tool results, an environment's messages) as `continuation` renders it; with a flag
    per id after the prompt: the model's own (trained on) or not."""
    if not conversation or conversation[0].get("role") != "assistant" or \
            conversation[-1].get("role") != "assistant":
        raise ValueError("conversation: must open and end with the model's (assistant) "
                         "message")
    history, ids = tok.messages_of(prompt), tok.encode_prompt(prompt)
    own: list[bool] = []
    i = 0
    while i < len(conversation):
        m = conversation[i]
        if m.get("role") == "assistant":
            part = tok.encode(str(m.get("content", ""))) + [tok.eos_id]
            history.append(m)
            i += 1
        else:
            j = i
            while j < len(conversation) and conversation[j].get("role") != "assistant":
                j += 1
            part = continuation(tok, history, conversation[i:j], tok.eos_id)
            history += conversation[i:j]
            i = j
        ids += part
        own += [m.get("role") == "assistant"] * len(part)
    return ids, own
