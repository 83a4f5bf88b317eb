"""Command-line overrides, one syntax for every script: ``--field value`` / ``--field=value`` and
``--section.field value`` (``--actor_rollout.learning_rate 1e-6``, ``--algorithm.kl_ctrl.kl_coef 0.1``).

Each value is text parsed by its field's type, strictly (``llm.settings.fields.parse_text``); a boolean
flag given alone (``--do_train``) means true. A flat script's fields are top-level names; a sectioned
config's bare ``--field`` names a field of its default section (PPO: ``training``). A dialect's names
(PaddleNLP's ``--max_length``) are accepted as in files, their text read as JSON when it reads as JSON, and
translated by the caller with the file's own keys.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Mapping
from typing import Any

from llm.settings import fields
from llm.utils.errors import UserError, closest


@dataclasses.dataclass
class Schema:
    """What a script's config holds: ``flat`` top-level field -> annotation (flat scripts), ``sections``
    section -> dataclass and ``default_section`` (sectioned configs), ``dialect`` names taken as they come."""

    flat: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    sections: Mapping[str, type] = dataclasses.field(default_factory=dict)
    default_section: str | None = None
    dialect: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def _dialect_text(text: str) -> Any:
    """A command-line value of a dialect's name: JSON when it reads as JSON (``512``, ``false``), else the text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _admits_bool(annotation: Any) -> bool:
    return annotation is bool or bool in typing.get_args(annotation)


def _section_field(schema: Schema, name: str) -> tuple[list[str], type, str]:
    """``section[.sub...].field`` (or a bare field of the default section) -> (section path, dataclass, field)."""
    section, _, key = name.rpartition(".")
    section = section or schema.default_section
    top, *subs = section.split(".")
    if top not in schema.sections:
        raise UserError(f"command line: unknown section {section!r}; closest: {closest(section, schema.sections)}")
    cls = schema.sections[top]
    for sub in subs:
        hint = fields.type_hints(cls).get(sub)
        if not dataclasses.is_dataclass(hint):
            raise UserError(f"command line: {section!r} is not a section")
        cls = hint
    if key not in fields.init_fields(cls):
        valid = list(fields.init_fields(cls))
        raise UserError(f"command line: {section} has no field {key!r}; closest valid names: {closest(key, valid)}")
    return [top, *subs], cls, key


def _annotation(schema: Schema, name: str) -> Any:
    """The annotation of ``name``; ``Any`` for a dialect's name."""
    if name in schema.flat:
        return schema.flat[name]
    if name in schema.dialect:
        return Any
    if not schema.sections:
        raise UserError(f"command line: unknown option --{name}; closest valid names: {closest(name, schema.flat)}")
    _, cls, key = _section_field(schema, name)
    return fields.type_hints(cls)[key]


def parse_overrides(cli: list[str], schema: Schema) -> dict[str, Any]:
    """The overrides in ``cli`` as a config object of the script's layout: ``{field: value}`` for a flat script,
    ``{section: {field: value}}`` for a sectioned one, each value typed by its field."""

    def bare(name: str) -> str | None:
        return "true" if _admits_bool(_annotation(schema, name)) else None

    out: dict[str, Any] = {}
    for name, text in fields.command_line_pairs(cli, bare):
        annotation = _annotation(schema, name)
        where = f"command line: --{name}"
        value = _dialect_text(text) if annotation is Any else fields.parse_text(text, annotation, where)
        if name in schema.flat or name in schema.dialect:
            out[name] = value
            continue
        path, _, key = _section_field(schema, name)
        target = out
        for part in path:
            target = target.setdefault(part, {})
        target[key] = value
    return out


def merge(config: dict, overrides: Mapping[str, Any]) -> dict:
    """``config`` with ``overrides`` laid over it, section by section (a section given in the file as something
    other than an object is left for the typed filling to refuse)."""
    out = dict(config)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(dict(out[key]), value)
        else:
            out[key] = value
    return out
