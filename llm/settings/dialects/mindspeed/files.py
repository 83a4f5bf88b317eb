"""MindSpeed files read as hydra reads them: the YAML loader (OmegaConf's numbers, no dates, no key given
twice), the layout test, and the ``defaults`` list's model files (``model/<name>.yaml`` beside the file)."""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any

import yaml

from llm.utils.errors import UserError

if TYPE_CHECKING:
    from llm.settings.dialects.mindspeed.rule_types import Translation


class _Loader(yaml.SafeLoader):
    """YAML as OmegaConf (hydra) reads it: ``1e-7`` is a number (YAML 1.1 wants ``1.0e-7``), dates stay
    text; a key given twice in one mapping is an error (it would silently override)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key, _ in node.value:
                if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                    if key.value in seen:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"key {key.value!r} is given twice", key.start_mark
                        )
                    seen.add(key.value)
        return super().construct_mapping(node, deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.VERBOSE,
    ),
    list("-+0123456789."),
)
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in _Loader.yaml_implicit_resolvers.items()
}


def load_yaml(text: str, path: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UserError(f"{path}: not valid YAML ({getattr(err, 'problem', None) or err}{at})") from None


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
