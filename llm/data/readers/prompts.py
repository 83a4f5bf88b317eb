"""PPO prompts (``kind="prompt"``) with an optional reference answer.

Schema (``kind``)
    ``"prompt"``: ``{"src", "tgt"}`` or ``{"prompt", "reference" | "answer" | "tgt"}`` (first one
    present wins; a number is turned into a string). For ``src`` with n turns, ``tgt`` may hold
    n-1 turns (history only, no reference) or n turns (history, then the reference answer);
    a ``reference``/``answer`` field is used when ``tgt`` gives none.
"""

from __future__ import annotations

from typing import Any

from llm.data.readers.common import is_present, pick_format, type_name
from llm.data.readers.conversation import history, paddle_turns, system_messages, trl_prompt
from llm.data.readers.records import PromptRecord
from llm.data.readers.sources import RecordPlace


def _reference(value: Any, field: str, where: RecordPlace) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        where.fail(field, f"must be a string (the reference answer), got {type_name(value)}", "give the answer text")
    if not value.strip():
        where.fail(field, "the reference answer is empty", f"give the answer, or remove '{field}' (or set it to null)")
    return value


def parse_prompt(rec: dict, where: RecordPlace, tokens: tuple[str, str], placeholder: str) -> PromptRecord:
    fmt = pick_format(rec, where, "prompt", ("src",), ("prompt",))
    extra = next((k for k in ("reference", "answer") if is_present(rec, k)), None)
    if fmt == "trl":
        messages = trl_prompt(rec, where)
        field = extra or ("tgt" if is_present(rec, "tgt") else None)
        if field is not None and isinstance(rec[field], (list, tuple)):
            where.fail(field, "must be a string (the reference answer), got list", "give the answer text")
        reference = _reference(rec[field], field, where) if field else None
        return PromptRecord(messages, reference, where.path, where.index, dict(rec))

    src = paddle_turns(rec["src"], "src", where)
    tgt = paddle_turns(rec.get("tgt"), "tgt", where)
    reference = None
    if len(tgt) == len(src) and src:
        reference = _reference(tgt[-1], "tgt", where)
        tgt = tgt[:-1]
    elif len(tgt) != len(src) - 1 and src:
        where.fail(
            "tgt",
            f"src has {len(src)} turn(s) and tgt has {len(tgt)}; tgt must hold the {len(src) - 1} earlier "
            "assistant turn(s), optionally followed by the reference answer",
            "give len(src) - 1 history turns, or len(src) turns whose last one is the reference",
        )
    if reference is None and extra:
        reference = _reference(rec[extra], extra, where)
    messages = system_messages(rec, where) + history(src, tgt, where)
    return PromptRecord(messages, reference, where.path, where.index, dict(rec))
