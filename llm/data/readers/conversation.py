"""Prompts and conversations from PaddleNLP ``src``/``tgt`` turns or TRL message lists, with their checks.

Prompts
    ``src`` is a string (one user turn) or a list of user turns and ``tgt`` the assistant turns
    between them: the prompt is src[0] (user), tgt[0] (assistant), src[1] (user), ... so for
    prm/pair ``src`` has exactly one turn more than ``tgt`` (``tgt: []`` or absent for a single
    turn). A TRL ``prompt`` is a string (one user turn) or a list of ``{"role", "content"}``
    messages ending with a user turn. An optional ``"system"`` string becomes a leading system
    message. Texts are kept as they are; they are only checked not to be blank.
"""

from __future__ import annotations

from typing import Any

from llm.data.readers.common import type_name
from llm.data.readers.records import ROLES, Message
from llm.data.readers.sources import RecordPlace


def paddle_turns(value: Any, field: str, where: RecordPlace) -> list[str]:
    """A PaddleNLP src/tgt value: None, a string or a list of strings."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(t, str) for t in value):
        return list(value)
    where.fail(
        field,
        f"must be a string or a list of strings, got {type_name(value)}",
        f"write {field} as a list of turn texts",
    )


def system_messages(rec: dict, where: RecordPlace) -> list[Message]:
    value = rec.get("system")
    if value is None:
        return []
    if not isinstance(value, str):
        where.fail("system", f"must be a string, got {type_name(value)}", "give the system prompt as one string")
    return [{"role": "system", "content": value}] if value.strip() else []


def history(src: list[str], tgt: list[str], where: RecordPlace) -> list[Message]:
    """src[0] (user), tgt[0] (assistant), src[1] (user), ...; requires len(src) == len(tgt) + 1."""
    if not src:
        where.fail(
            "src", "the prompt is empty (src has no turns)", "give the question as a string or a list of user turns"
        )
    for j, text in enumerate(src):
        if not text.strip():
            where.fail("src", f"turn {j} is empty: the prompt is empty", "give a non-empty text for every user turn")
    for j, text in enumerate(tgt):
        if not text.strip():
            where.fail("tgt", f"turn {j} is empty", "give a non-empty text for every earlier assistant turn")
    messages: list[Message] = []
    for j, text in enumerate(src):
        messages.append({"role": "user", "content": text})
        if j < len(tgt):
            messages.append({"role": "assistant", "content": tgt[j]})
    return messages


def paddle_prompt(rec: dict, where: RecordPlace, allow_none: bool = False) -> list[Message]:
    """Prompt for prm/pair records: src has exactly one turn more than tgt.

    ``allow_none`` (PRM): a single empty src turn with no tgt means there is no separate prompt, as in
    PaddleNLP's Math-Shepherd conversion, where the question starts the first step; the prompt is [].
    """
    src = paddle_turns(rec["src"], "src", where)
    if not src:
        where.fail(
            "src", "the prompt is empty (src has no turns)", "give the question as a string or a list of user turns"
        )
    tgt_value = rec.get("tgt")
    tgt = [] if tgt_value == "" else paddle_turns(tgt_value, "tgt", where)
    if allow_none and len(src) == 1 and not src[0].strip() and not tgt:
        if system_messages(rec, where):
            where.fail(
                "system",
                "is given but src is empty: without a prompt the text is the steps alone (the question at the "
                "start of the first step)",
                "put the question in src, or drop the system prompt",
            )
        return []
    if len(src) != len(tgt) + 1:
        where.fail(
            "tgt",
            f"src has {len(src)} turn(s) and tgt has {len(tgt)}; src must have exactly one turn more than tgt "
            "(tgt holds the assistant answers between the user turns)",
            'use "tgt": [] for a single-turn record, or give one assistant turn per earlier user turn',
        )
    return system_messages(rec, where) + history(src, tgt, where)


def message_list(value: Any, field: str, where: RecordPlace) -> list[Message]:
    if not isinstance(value, (list, tuple)) or not value:
        where.fail(
            field,
            f"must be a non-empty list of messages, got {type_name(value)}",
            'give [{"role": ..., "content": ...}]',
        )
    out: list[Message] = []
    for j, msg in enumerate(value):
        if not (isinstance(msg, dict) and isinstance(msg.get("role"), str) and isinstance(msg.get("content"), str)):
            where.fail(
                field,
                f"message {j} is not an object with string 'role' and 'content' (got {type_name(msg)})",
                'write every message as {"role": "user", "content": "..."}',
            )
        if msg["role"] not in ROLES:
            where.fail(field, f"message {j} has role {msg['role']!r}", f"use one of {', '.join(map(repr, ROLES))}")
        if not msg["content"].strip():
            where.fail(
                field, f"message {j} ({msg['role']}) has empty content", "give a non-empty text for every message"
            )
        out.append({"role": msg["role"], "content": msg["content"]})
    return out


def check_conversation(messages: list[Message], field: str, where: RecordPlace) -> None:
    for j, msg in enumerate(messages):
        if msg["role"] == "system" and j > 0:
            where.fail(field, f"message {j} is a system message after the start", "put the system message first")
    if not messages or all(m["role"] == "system" for m in messages):
        where.fail(field, "the prompt is empty (no user turn)", "give at least one user message")
    if messages[-1]["role"] != "user":
        where.fail(
            field,
            f"the prompt ends with a {messages[-1]['role']} message",
            "the prompt must end with the user turn to answer",
        )


def add_system(rec: dict, messages: list[Message], field: str, where: RecordPlace) -> list[Message]:
    system = system_messages(rec, where)
    if system and messages[0]["role"] == "system":
        where.fail("system", f"is given and '{field}' already starts with a system message", "keep only one of the two")
    return system + messages


def trl_prompt(rec: dict, where: RecordPlace) -> list[Message]:
    value = rec["prompt"]
    if isinstance(value, str):
        if not value.strip():
            where.fail("prompt", "the prompt is empty", "give the question text")
        messages = [{"role": "user", "content": value}]
    elif isinstance(value, (list, tuple)):
        messages = message_list(value, "prompt", where)
        check_conversation(messages, "prompt", where)
    else:
        where.fail(
            "prompt", f"must be a string or a list of messages, got {type_name(value)}", "give the question text"
        )
    return add_system(rec, messages, "prompt", where)
