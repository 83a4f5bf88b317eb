"""The import rules of ARCHITECTURE.md, checked on the code: the layers import only downwards
(utils <- settings <- data <- alignment <- the run scripts), no import circle even through imports made for type
hints only or inside functions, and no module imports another module's underscore-private names."""

from __future__ import annotations

import ast

from tests.test_repository import cycles, llm_modules

# layer -> the layers it may import (itself included); the entry points (llm/run_*.py, serve_reward.py,
# convert_gguf.py, and docs_tables.py, which reads the registries the implementations fill) may import every layer
LAYERS = {
    "llm.utils": ("llm.utils",),
    "llm.settings": ("llm.settings", "llm.utils"),
    "llm.data": ("llm.data", "llm.settings", "llm.utils"),
    "llm.alignment": ("llm.alignment", "llm.data", "llm.settings", "llm.utils"),
}


def imports(path: str, module: str) -> list[tuple[str, list[str]]]:
    """Every ``import`` in ``path`` at any depth, type-only ones included: (module named, names taken)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out.append((base, [a.name for a in node.names]))
    return out


def resolved(name: str, modules: dict[str, str]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def full_graph() -> dict[str, set[str]]:
    modules = llm_modules()
    graph = {}
    for module, path in modules.items():
        targets = set()
        for base, names in imports(path, module):
            for name in [base, *(f"{base}.{n}" for n in names)]:
                target = resolved(name, modules)
                if target and target != module:
                    targets.add(target)
        graph[module] = targets
    return graph


def layer(module: str) -> str | None:
    return next((name for name in LAYERS if module == name or module.startswith(name + ".")), None)


def test_no_import_circle_even_through_type_only_imports():
    assert cycles(full_graph()) == []


def test_layers_import_only_downwards():
    wrong = []
    for module, targets in full_graph().items():
        own = layer(module)
        if own is None:
            continue  # an entry point
        for target in sorted(targets):
            if layer(target) not in LAYERS[own]:
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_the_layer_rule_finds_an_upward_import():
    assert layer("llm.utils.paths") == "llm.utils" and "llm.alignment" not in LAYERS["llm.utils"]
    assert layer("llm.run_ppo") is None


def test_no_module_imports_another_modules_private_names():
    modules = llm_modules()
    wrong = []
    for module, path in modules.items():
        for base, names in imports(path, module):
            if resolved(base, modules) in (None, module):
                continue
            wrong += [
                f"{module}: from {base} import {n}" for n in names if n.startswith("_") and not n.startswith("__")
            ]
    assert wrong == []
