"""YAML as hydra (OmegaConf) reads it, for every YAML config file: ``1e-7`` is a number (YAML 1.1 wants
``1.0e-7``), dates stay text, a key given twice in one mapping is an error (it would silently override)."""

from __future__ import annotations

import re
from typing import Any

import yaml

from llm.utils.errors import UserError


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
