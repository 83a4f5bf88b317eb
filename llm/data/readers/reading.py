"""One file's records, read and validated: the argument checks and the per-kind parser for each record."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

from llm.data.readers.common import type_name
from llm.data.readers.orm_eval import parse_orm_eval
from llm.data.readers.pairs import parse_pair
from llm.data.readers.prm import parse_prm
from llm.data.readers.problems import parse_problem
from llm.data.readers.prompts import parse_prompt
from llm.data.readers.records import FORMATS, KINDS, Record
from llm.data.readers.sft import parse_sft
from llm.data.readers.sources import RecordPlace, check_map_keys, detect_format, iter_raw, rename
from llm.settings.shared import reward_token_pair
from llm.utils.errors import UserError, closest


def iter_records(
    path: str,
    kind: str,
    *,
    reward_tokens: str | Sequence[str] = ("+", "-"),
    placeholder: str = "ки",
    map_keys: dict[str, str] | None = None,
) -> Iterator[Record]:
    """Stream the validated records of one file, in file order, in constant memory.

    Arguments, path and format are checked at once; records are read and checked as the
    iterator advances. An empty file raises when the iterator reaches its end.
    """
    kind = check_kind(kind)
    tokens = check_reward_tokens(reward_tokens)
    placeholder = check_placeholder(placeholder)
    names = check_map_keys(map_keys, kind)
    path = os.fspath(path)
    fmt = detect_format(path)
    return iter_validated(path, fmt, kind, tokens, placeholder, names)


def read_records(
    path: str,
    kind: str,
    *,
    reward_tokens: str | Sequence[str] = ("+", "-"),
    placeholder: str = "ки",
    map_keys: dict[str, str] | None = None,
) -> list[Record]:
    """Read and validate every record of one file."""
    return list(iter_records(path, kind, reward_tokens=reward_tokens, placeholder=placeholder, map_keys=map_keys))


# --------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------


def check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise UserError(
            f"unknown data kind {kind!r}; use one of {', '.join(map(repr, KINDS))} "
            f"(closest: {closest(str(kind), KINDS)})"
        )
    return kind


def check_reward_tokens(reward_tokens: str | Sequence[str]) -> tuple[str, str]:
    return reward_token_pair(reward_tokens)


def check_placeholder(placeholder: str) -> str:
    if not isinstance(placeholder, str) or not placeholder:
        raise UserError(f'placeholder {placeholder!r} is invalid: give a non-empty string, e.g. "ки"')
    return placeholder


# each data kind's record parser (its module holds the kind's schema)
PARSERS = {
    "prm": parse_prm,
    "pair": parse_pair,
    "prompt": parse_prompt,
    "sft": parse_sft,
    "orm_eval": parse_orm_eval,
    "problem": parse_problem,
}


def iter_validated(
    path: str, fmt: str, kind: str, tokens: tuple[str, str], placeholder: str, names: dict[str, str]
) -> Iterator[Record]:
    parse = PARSERS[kind]
    index = 0
    for line, obj in iter_raw(path, fmt):
        where = RecordPlace(path, index, line, names)
        if not isinstance(obj, dict):
            where.fail(
                None, f"is a JSON {type_name(obj)}, not an object", f"every record must be an object: {FORMATS[kind]}"
            )
        yield parse(rename(obj, names, where) if names else obj, where, tokens, placeholder)
        index += 1
    if index == 0:
        raise UserError(
            f"{path}: no records found (the file or data set is empty). Fix: give a file with at least one "
            f"record in the {kind!r} format: {FORMATS[kind]}"
        )
