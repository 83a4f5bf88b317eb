"""MindSpeed files: the layout test and the ``defaults`` list's model files (``model/<name>.yaml`` beside the file),
read with the YAML loader every config file uses (``llm.settings.yaml_files``)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from llm.settings.yaml_files import load_yaml
from llm.utils.errors import UserError

if TYPE_CHECKING:
    from llm.settings.dialects.mindspeed.rule_types import Translation


def is_mindspeed_layout(raw: dict) -> bool:
    return "actor_rollout_ref" in raw or isinstance(raw.get("defaults"), list)


def model_files(t: Translation, defaults: Any, directory: str) -> dict[str, tuple[str, dict]]:
    """hydra's defaults list: ``{model: [name, ...]}`` entries load ``model/<name>.yaml`` beside the file;
    each holds ``{name: {Megatron arguments}}``."""
    if defaults is None:
        return {}
    if not isinstance(defaults, list):
        raise t.fail("defaults", "must be a list like [{model: [llama32-1b]}] (hydra's defaults list)")
    models: dict[str, tuple[str, dict]] = {}
    for entry in defaults:
        if entry == "_self_":
            continue
        if not isinstance(entry, dict) or set(entry) != {"model"}:
            raise t.fail("defaults", f"{entry!r}: only the model group is read ({{model: [name, ...]}})")
        names = entry["model"] if isinstance(entry["model"], list) else [entry["model"]]
        for name in names:
            if not isinstance(name, str):
                raise t.fail("defaults", f"model {name!r}: give the model file's name (model/<name>.yaml)")
            rel = os.path.join("model", f"{name}.yaml")
            file = os.path.join(directory, rel)
            if not os.path.isfile(file):
                raise t.fail("defaults", f"model {name!r}: no file {file}")
            with open(file, encoding="utf-8") as f:
                content = load_yaml(f.read(), file)
            if not isinstance(content, dict) or not all(isinstance(v, dict) for v in content.values()):
                raise UserError(f"{file}: must hold {{model name: {{Megatron arguments}}}}, like {{{name}: {{...}}}}")
            models.update({key: (f"{rel}: {key}", value) for key, value in content.items()})
    return models
