"""Preference pairs (``kind="pair"``): PaddleNLP ``response``/``sort`` or TRL ``chosen``/``rejected``.

Schema (``kind``)
    ``"pair"``: PaddleNLP ``{"src", "tgt", "response": [r0, r1], "sort": [s0, s1]}`` (higher sort
    = chosen) or TRL ``{"prompt", "chosen", "rejected"}``. In TRL form ``chosen``/``rejected`` may
    be strings or message lists; of a message list the last message (role assistant) is the
    answer. Without ``prompt`` (TRL "implicit prompt"), chosen and rejected must be full
    conversations that share every message before the last; that shared part is the prompt.
"""

from __future__ import annotations

import math
from typing import Any

from llm.data.readers.common import is_present, pick_format, require, type_name
from llm.data.readers.conversation import add_system, check_conversation, message_list, paddle_prompt, trl_prompt
from llm.data.readers.records import FORMATS, PairRecord
from llm.data.readers.sources import RecordPlace


def _answer_text(value: Any, field: str, where: RecordPlace) -> str:
    if isinstance(value, str):
        text = value
    elif isinstance(value, (list, tuple)):
        messages = message_list(value, field, where)
        if messages[-1]["role"] != "assistant":
            where.fail(field, f"the last message has role {messages[-1]['role']!r}", "end it with the assistant answer")
        text = messages[-1]["content"]
    else:
        where.fail(field, f"must be a string or a list of messages, got {type_name(value)}", "give the answer text")
    if not text.strip():
        where.fail(field, "the answer is empty", "give a non-empty answer")
    return text


def parse_pair(rec: dict, where: RecordPlace, tokens: tuple[str, str], placeholder: str) -> PairRecord:
    fmt = pick_format(rec, where, "pair", ("src", "response", "sort"), ("prompt", "chosen", "rejected"))
    if fmt == "paddle":
        require(rec, where, "pair", ("src", "response", "sort"), "PaddleNLP pair")
        prompt = paddle_prompt(rec, where)
        response, sort = rec["response"], rec["sort"]
        if not (
            isinstance(response, (list, tuple)) and len(response) == 2 and all(isinstance(r, str) for r in response)
        ):
            got = f"a list of {len(response)}" if isinstance(response, (list, tuple)) else type_name(response)
            where.fail(
                "response",
                f"must be a list of exactly two strings, got {got}",
                'give "response": [r0, r1] with "sort": [s0, s1]',
            )
        for j, text in enumerate(response):
            if not text.strip():
                where.fail("response", f"response {j} is empty", "give two non-empty responses")
        if not (
            isinstance(sort, (list, tuple))
            and len(sort) == 2
            and all(isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) for s in sort)
        ):
            where.fail(
                "sort", f"must be a list of two numbers, got {sort!r}", "give the scores of response[0] and response[1]"
            )
        if sort[0] == sort[1]:
            where.fail(
                "sort",
                f"both responses have the same sort value {sort[0]!r}, so neither is chosen",
                "give the better response the higher value, or drop the record from the file",
            )
        best = 0 if sort[0] > sort[1] else 1
        return PairRecord(prompt, response[best], response[1 - best], where.path, where.index)

    require(rec, where, "pair", ("chosen", "rejected"), "TRL preference")
    if is_present(rec, "prompt"):
        prompt = trl_prompt(rec, where)
    else:  # implicit prompt: both are conversations sharing everything before the last message
        chosen_value, rejected_value = rec["chosen"], rec["rejected"]
        if not (isinstance(chosen_value, (list, tuple)) and isinstance(rejected_value, (list, tuple))):
            where.fail(
                "prompt",
                "missing required field 'prompt' (chosen/rejected are not conversations it could be taken from)",
                f"add 'prompt'; accepted formats: {FORMATS['pair']}",
            )
        chosen_msgs = message_list(chosen_value, "chosen", where)
        rejected_msgs = message_list(rejected_value, "rejected", where)
        if chosen_msgs[:-1] != rejected_msgs[:-1]:
            where.fail(
                "rejected",
                "without 'prompt', chosen and rejected must share every message before the last one",
                "give the conversation before the answers as 'prompt'",
            )
        prompt = chosen_msgs[:-1]
        check_conversation(prompt, "chosen", where)
        prompt = add_system(rec, prompt, "chosen", where)
    chosen = _answer_text(rec["chosen"], "chosen", where)
    rejected = _answer_text(rec["rejected"], "rejected", where)
    return PairRecord(prompt, chosen, rejected, where.path, where.index)
