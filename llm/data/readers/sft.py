"""SFT conversations (``kind="sft"``): PaddleNLP ``src``/``tgt`` or TRL conversational ``messages``.

Schema (``kind``)
    ``"sft"``: PaddleNLP ``{"src", "tgt"}`` with as many ``tgt`` turns as ``src`` turns (each user
    turn followed by its answer; a single turn may be two strings) or TRL conversational
    ``{"messages": [{"role", "content"}...]}``: an optional leading system message, then a user
    turn first and an assistant turn last. Every assistant turn is an answer to train on.
"""

from __future__ import annotations

from llm.data.readers.common import pick_format, require
from llm.data.readers.conversation import add_system, history, message_list, paddle_turns, system_messages
from llm.data.readers.records import SFTRecord
from llm.data.readers.sources import RecordPlace


def parse_sft(rec: dict, where: RecordPlace, tokens: tuple[str, str], placeholder: str) -> SFTRecord:
    fmt = pick_format(rec, where, "sft", ("src", "tgt"), ("messages",))
    if fmt == "paddle":
        require(rec, where, "sft", ("src", "tgt"), "PaddleNLP SFT")
        src, tgt = paddle_turns(rec["src"], "src", where), paddle_turns(rec["tgt"], "tgt", where)
        if len(src) != len(tgt) or not src:
            where.fail(
                "tgt",
                f"src has {len(src)} turn(s) and tgt has {len(tgt)}; for SFT every user turn needs its answer "
                "(src[0], tgt[0], src[1], tgt[1], ...; the answers are what the model learns)",
                "give exactly one tgt turn per src turn",
            )
        for j, text in enumerate(tgt):
            if not text.strip():
                where.fail("tgt", f"turn {j} is empty", "give a non-empty answer for every user turn")
        messages = system_messages(rec, where) + history(src, tgt[:-1], where)
        return SFTRecord(messages + [{"role": "assistant", "content": tgt[-1]}], where.path, where.index)

    messages = add_system(rec, message_list(rec["messages"], "messages", where), "messages", where)
    for j, msg in enumerate(messages):
        if msg["role"] == "system" and j > 0:
            where.fail("messages", f"message {j} is a system message after the start", "put the system message first")
    turns = [m for m in messages if m["role"] != "system"]
    if not turns or turns[0]["role"] != "user":
        where.fail(
            "messages",
            "the conversation does not start with a user message" if turns else "there is no user message",
            "start with the user turn (after an optional system message)",
        )
    if turns[-1]["role"] != "assistant":
        where.fail(
            "messages",
            f"the conversation ends with a {turns[-1]['role']} message, which nothing answers",
            "end the conversation with the assistant answer to train on, or drop the last message",
        )
    return SFTRecord(messages, where.path, where.index)
