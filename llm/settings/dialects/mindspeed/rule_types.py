"""The state of one translation: MindSpeed's sections and roles, a name as the user gave it (``Given``), a
table entry (``Rule``), and ``Translation``, the output in this project's layout with its log lines."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llm.settings import fields
from llm.settings.ppo import SECTIONS
from llm.utils.errors import UserError

MINDSPEED_SECTIONS = (
    "defaults",
    "training",
    "actor_rollout_ref",
    "critic",
    "reward",
    "algorithm",
    "resource_pool",
    "data",
)
ROLE_PLACES = {
    "actor_rollout": "actor_rollout_ref.actor_rollout",
    "ref": "actor_rollout_ref.ref",
    "critic": "critic",
    "reward": "reward",
}
TRAINED = ("actor_rollout", "critic")
ALL = tuple(ROLE_PLACES)
ACTOR = ("actor_rollout",)


@dataclass
class Given:
    name: str
    value: Any
    where: str  # where the user wrote it: "training.lr", "critic.lr", "model/llama32-1b.yaml: bf16"
    own: bool  # in the role's own section (not merged in from training or a model file)


@dataclass(frozen=True)
class Rule:
    roles: tuple[str, ...]  # the roles that read it in MindSpeed's PPO
    apply: Callable[[Translation, str, Given], None]
    source: str  # where MindSpeed-LLM / Megatron reads it (the justification of the mapping)


class Translation:
    """One MindSpeed file into this project's layout (``out``), with lines for the log (``notes``)."""

    def __init__(self, path: str, notes: list[str]) -> None:
        self.path, self.notes, self.sections = path, notes, SECTIONS
        self.out: dict[str, dict] = {name: {} for name in SECTIONS}
        self.origin: dict[tuple[str, str], str] = {}
        self.merged: dict[str, dict[str, Given]] = {}
        self.models: dict[str, str] = {}  # role -> the Hugging Face directory of its ``load``
        self.ranks: dict[str, int] = {}  # role -> processes (MindSpeed's per-rank batch sizes scale by it)
        self.kernels: set[str] = set()

    def fail(self, where: str, message: str) -> UserError:
        return UserError(f"{self.path}: {where}: {message}")

    def note(self, where: str, message: str) -> None:
        line = f"{where}: {message}"
        if line not in self.notes:
            self.notes.append(line)

    def typed(self, g: Given, annotation: Any) -> Any:
        return fields.check_value(g.value, annotation, f"{self.path}: {g.where}")

    def set(self, section: str, name: str, value: Any, where: str) -> None:
        """Our ``section.name`` from ``where``; type-checked against the field, a second different value stops."""
        cls = self.sections[section]
        value = fields.check_value(value, fields.type_hints(cls)[name], f"{self.path}: {where}")
        fields.check_bounds(name, value, fields.field_bounds(cls), f"{self.path}: {where}")
        if (section, name) in self.origin and self.out[section][name] != value:
            first = self.origin[section, name]
            raise self.fail(
                where, f"{value!r} contradicts {first} ({self.out[section][name]!r}): both set {section}.{name}"
            )
        self.out[section][name], self.origin[section, name] = value, where

    def default(self, section: str, name: str, value: Any, why: str) -> None:
        if (section, name) not in self.origin:
            self.out[section][name], self.origin[section, name] = value, why
            self.note(f"{section}.{name}", f"{value!r} ({why})")

    def given(self, role: str, name: str) -> Given | None:
        return self.merged.get(role, {}).get(name)
