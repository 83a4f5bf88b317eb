"""``package.module:Name`` -> the object, and a tool's result as the text a tool message carries. Standard library
only: the tool sandbox's child process (sandbox.py) imports this and nothing heavier."""

from __future__ import annotations

import importlib
import json
from typing import Any


class SpecError(Exception):
    """``package.module:Name`` could not be imported; the text says why."""


def import_object(spec: str) -> Any:
    """The object ``spec`` names. Anything the module raises while it is imported (``SystemExit`` too) is a
    ``SpecError`` naming the spec."""
    module_name, _, name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise SpecError(f"{spec!r}: cannot import {module_name} ({err})") from None
    except BaseException as err:  # noqa: BLE001 - the module's own code failed while it was imported
        raise SpecError(f"{spec!r}: importing {module_name} raised {type(err).__name__}: {err}") from None
    try:
        return getattr(module, name)
    except AttributeError:
        raise SpecError(f"{spec!r}: {module_name} has no {name!r}") from None


def result_text(value: Any) -> str:
    """A tool's return value as a tool message: a string as is, JSON-able data as JSON, anything else ``str``."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)
