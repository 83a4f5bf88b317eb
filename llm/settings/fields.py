"""Strict, typed filling of configuration dataclasses, shared by every script (flat and sectioned files).

A value from a config file (JSON, or YAML read as JSON-like data) must already have its field's type:
``true`` for a bool (never the string ``"false"``, which would be truthy), ``2`` for an int (never ``"2"``
or ``2.5``), a number for a float. Values from the command line are text and are parsed by the field's
type, strictly (``true``/``false`` for a bool; a number for a number). Bounds declared in a field's
metadata (``{"min": 1}``) or passed by the caller are checked too. Every problem is one ``UserError``
naming where the value came from, the field, what was given and what to write instead.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from llm.utils.errors import UserError, closest

_NONE = type(None)


class _Mismatch(Exception):
    """A value does not fit an annotation; the text says what was expected."""


def type_hints(cls: type) -> dict[str, Any]:
    """Resolved annotations of a dataclass (``from __future__ import annotations`` leaves strings)."""
    return typing.get_type_hints(cls)


def _members(annotation: Any) -> tuple[Any, ...]:
    """The alternatives of a union. ``SomeEnum | str`` (transformers' way of letting a file give the enum's
    value as text) counts as the enum alone, so a misspelt value is caught here, naming the field."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        members = typing.get_args(annotation)
        if any(isinstance(m, type) and issubclass(m, enum.Enum) for m in members):
            members = tuple(m for m in members if m is not str)
        return members
    return (annotation,)


def describe(annotation: Any) -> str:
    """What to write, in the words of a config file."""
    names = []
    for member in _members(annotation):
        origin = typing.get_origin(member)
        if member is _NONE:
            names.append("null")
        elif member is bool:
            names.append("true or false")
        elif member is int:
            names.append("a whole number")
        elif member is float:
            names.append("a number")
        elif member is str:
            names.append("a string")
        elif isinstance(member, type) and issubclass(member, enum.Enum):
            names.append("one of " + ", ".join(repr(m.value) for m in member))
        elif origin is typing.Literal:
            names.append("one of " + ", ".join(repr(a) for a in typing.get_args(member)))
        elif origin is list or member is list:
            names.append("a list")
        elif origin is dict or member is dict:
            names.append("an object {...}")
        else:
            names.append(getattr(member, "__name__", str(member)))
    return " or ".join(dict.fromkeys(names))


def _shown(value: Any) -> str:
    if isinstance(value, str):
        return f"the string {value!r}"
    return json.dumps(value) if isinstance(value, (bool, int, float, type(None))) else repr(value)


def _fit(value: Any, annotation: Any) -> Any:
    """``value`` (JSON-like data) checked against ``annotation``; raises ``_Mismatch``."""
    if annotation is Any:
        return value
    members = _members(annotation)
    if len(members) == 1 and members[0] is not annotation:
        return _fit(value, members[0])
    if len(members) > 1:
        for member in members:
            try:
                return _fit(value, member)
            except _Mismatch:
                continue
        raise _Mismatch(describe(annotation))
    origin = typing.get_origin(annotation)
    if annotation is _NONE:
        if value is None:
            return None
    elif annotation is bool:
        if isinstance(value, bool):
            return value
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise _Mismatch("a finite number")
            return float(value) if isinstance(value, int) else value
    elif annotation is str:
        if isinstance(value, str):
            return value
    elif isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        if isinstance(value, annotation):
            return value
        if isinstance(value, str) and value in {m.value for m in annotation}:
            return value
    elif origin is typing.Literal:
        if value in typing.get_args(annotation) and type(value) in {type(a) for a in typing.get_args(annotation)}:
            return value
    elif origin is list or annotation is list:
        if isinstance(value, list):
            (item,) = typing.get_args(annotation) or (Any,)
            try:
                return [_fit(v, item) for v in value]
            except _Mismatch as err:
                raise _Mismatch(f"a list, each item {err}") from None
    elif origin is dict or annotation is dict:
        if isinstance(value, dict):
            args = typing.get_args(annotation)
            return {_fit(k, args[0]): _fit(v, args[1]) for k, v in value.items()} if args else value
    elif dataclasses.is_dataclass(annotation):
        if isinstance(value, (dict, annotation)):
            return value
    else:  # a type this module does not know (e.g. an accelerate config object): passed through as given
        return value
    raise _Mismatch(describe(annotation))


def check_value(value: Any, annotation: Any, where: str) -> Any:
    """``value`` from a config file, checked against ``annotation``; ``where`` names the file and field."""
    try:
        return _fit(value, annotation)
    except _Mismatch as err:
        hint = ""
        if isinstance(value, str) and not isinstance(value, bool):
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError:
                parsed = None
            if isinstance(parsed, (bool, int, float)) and _fits(parsed, annotation):
                hint = f" (write {json.dumps(parsed)} without quotes)"
        raise UserError(f"{where} must be {err}, got {_shown(value)}{hint}") from None


def _fits(value: Any, annotation: Any) -> bool:
    try:
        _fit(value, annotation)
        return True
    except _Mismatch:
        return False


def parse_text(text: str, annotation: Any, where: str) -> Any:
    """A command-line value (text) parsed by the field's type, strictly."""
    members = [m for m in _members(annotation) if m is not _NONE]
    # only "null" is null: "none" is a value of its own for some fields (report_to none)
    if text == "null" and len(members) < len(_members(annotation)):
        return None
    if bool in members and text.lower() in ("true", "false"):
        return text.lower() == "true"
    for member in members:
        if member in (int, float):
            try:
                number = int(text) if member is int else float(text)
            except ValueError:
                continue
            return check_value(number, member, where)
    structured = [m for m in members if typing.get_origin(m) in (list, dict) or m in (list, dict)]
    if structured and text[:1] in "[{":
        try:
            return check_value(json.loads(text), annotation, where)
        except json.JSONDecodeError as err:
            raise UserError(f"{where}: not valid JSON ({err.msg})") from None
    if any(typing.get_origin(m) is list or m is list for m in members) and str not in members:
        return check_value([t.strip() for t in text.split(",") if t.strip()], annotation, where)
    if str in members or any(isinstance(m, type) and issubclass(m, enum.Enum) for m in members):
        return check_value(text, annotation, where)
    if any(typing.get_origin(m) is typing.Literal for m in members):
        return check_value(text, annotation, where)
    raise UserError(f"{where} must be {describe(annotation)}, got {text!r}")


def command_line_pairs(cli: list[str], bare: Callable[[str], str | None]) -> Iterator[tuple[str, str]]:
    """``--name value`` / ``--name=value`` tokens as ``(name, text)``. A flag followed by nothing or by another
    flag takes ``bare(name)`` (``"true"`` for a boolean; None: it needs a value)."""
    i = 0
    while i < len(cli):
        token = cli[i]
        if not token.startswith("--") or len(token) == 2:
            raise UserError(f"command line: expected --field value, got {token!r}")
        name, eq, text = token[2:].partition("=")
        if not eq:
            following = cli[i + 1] if i + 1 < len(cli) else None
            if following is None or (following.startswith("--") and len(following) > 2):
                text = bare(name)
                if text is None:
                    raise UserError(f"command line: --{name} needs a value")
            else:
                text, i = following, i + 1
        yield name, text
        i += 1


def check_bounds(name: str, value: Any, bounds: Mapping[str, float], where: str) -> None:
    """``bounds``: field name -> smallest allowed value (sizes 1, rates 0, ...)."""
    low = bounds.get(name)
    if low is None or value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if value < low:
        what = "a positive number" if low > 0 else "a number >= 0" if low == 0 else f">= {low}"
        raise UserError(f"{where} must be {what}, got {value}")


def help_field(default: Any, text: str | None = None, low: float | None = None) -> Any:
    """A dataclass field with its help text and lower bound (read back by ``field_bounds``): the one helper the
    settings schemas declare their fields with."""
    metadata: dict[str, Any] = {}
    if text:
        metadata["help"] = text
    if low is not None:
        metadata["min"] = low
    return dataclasses.field(default=default, metadata=metadata)


def field_bounds(cls: type) -> dict[str, float]:
    """Lower bounds declared as ``metadata={"min": ...}`` on the fields of ``cls``."""
    return {f.name: f.metadata["min"] for f in dataclasses.fields(cls) if "min" in f.metadata}


def init_fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def build(
    cls: type,
    values: Mapping[str, Any],
    where: str,
    bounds: Mapping[str, float] | None = None,
    section: str | None = None,
) -> Any:
    """An instance of dataclass ``cls`` from ``values`` (already routed to it), each value type-checked.

    Nested dataclass fields are built recursively from objects. Unknown keys stop with the closest valid
    names. ``where`` names the file; ``section`` the section of a sectioned config (messages then name
    ``section.field``). Errors from the class's own validation (``__post_init__``) are prefixed with ``where``
    (a section's own ``UserError`` names its fields itself).
    """
    head = f"{where}: {section}" if section else where
    if not isinstance(values, Mapping):
        if section:
            raise UserError(f"{head} must be an object of field: value pairs, got {values!r}")
        raise UserError(f"{where}: must be an object of field: value pairs, got {_shown(values)}")
    fields = init_fields(cls)
    hints = type_hints(cls)
    limits = {**field_bounds(cls), **(bounds or {})}
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            raise UserError(f"{head}: unknown key {key!r}; closest valid names: {closest(str(key), fields)}")
        annotation = hints[key]
        sub = next((m for m in _members(annotation) if dataclasses.is_dataclass(m)), None)
        if sub is not None and section and dataclasses.is_dataclass(annotation):
            value = build(sub, value, where, section=f"{section}.{key}")
        elif sub is not None and isinstance(value, Mapping):
            value = build(sub, value, f"{where}.{key}")
        else:
            at = f"{where}: {section}.{key}" if section else f"{where}: field {key!r}"
            value = check_value(value, annotation, at)
            check_bounds(key, value, limits, at)
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except UserError as err:
        if section:
            raise
        raise UserError(f"{where}: {err}") from None
    except (ValueError, TypeError) as err:
        raise UserError(f"{head}: {err}") from None
