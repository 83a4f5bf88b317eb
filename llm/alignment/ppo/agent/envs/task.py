"""Reading the task record an environment's ``reset`` receives (the prompt record: ``src``, ``tgt``, other fields)."""

from __future__ import annotations

from llm.utils.errors import UserError


def task_text(task: dict, field: str) -> str:
    """The task record's ``field`` as text (a number is turned into a string; for a list of turns, the last)."""
    value = task.get(field) if isinstance(task, dict) else None
    if isinstance(value, list) and value:
        value = value[-1]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise UserError(
            f"the task record {str(task)[:120]} has no '{field}' text; give each prompt record a non-empty '{field}'"
        )
    return value
