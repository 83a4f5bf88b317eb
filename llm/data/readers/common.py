"""Field checks every kind shares: value type names, presence, which format a record uses, required fields."""

from __future__ import annotations

from typing import Any

from llm.data.readers.records import FORMATS
from llm.data.readers.sources import RecordPlace


def type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def is_present(rec: dict, key: str) -> bool:
    return rec.get(key) is not None


_FORMAT_NAMES = {"paddle": "PaddleNLP", "trl": "TRL", "shepherd": "Math-Shepherd", "processbench": "ProcessBench"}


def pick_format(
    rec: dict,
    where: RecordPlace,
    kind: str,
    paddle: tuple[str, ...],
    trl: tuple[str, ...],
    shepherd: tuple[str, ...] = (),
    processbench: tuple[str, ...] = (),
) -> str:
    """'paddle', 'trl', 'shepherd' or 'processbench' by the marker fields present."""
    found = {
        fmt: [k for k in markers if is_present(rec, k)]
        for fmt, markers in (("paddle", paddle), ("trl", trl), ("shepherd", shepherd), ("processbench", processbench))
    }
    found = {fmt: keys for fmt, keys in found.items() if keys}
    if len(found) > 1:
        mixed = " with ".join(f"{_FORMAT_NAMES[fmt]} fields ({', '.join(keys)})" for fmt, keys in found.items())
        where.fail(None, f"mixes {mixed}", f"use one format per record: {FORMATS[kind]}")
    if not found:
        keys = ", ".join(repr(k) for k in rec) or "none"
        where.fail(
            None,
            f"missing required fields (the record has: {keys})",
            f"a {kind!r} record must use one of the accepted formats: {FORMATS[kind]}",
        )
    return next(iter(found))


def require(rec: dict, where: RecordPlace, kind: str, fields: tuple[str, ...], fmt_name: str) -> None:
    missing = [k for k in fields if not is_present(rec, k)]
    if missing:
        names = ", ".join(repr(k) for k in missing)
        where.fail(
            missing[0],
            f"missing required field(s) {names} for the {fmt_name} format",
            f"add {names}; accepted formats: {FORMATS[kind]}",
        )
