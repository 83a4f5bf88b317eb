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


# --- one owner per loop: the trainer's attributes are set by the trainer only ----------------------------------------
def trainer_writes(source: str, name: str = "<code>") -> list[str]:
    """Where code outside the trainer's own class sets, deletes or reads a private attribute of a trainer it was
    handed: a parameter named ``trainer``, a name bound to it, or ``self.<x>`` where an object stored it
    (``self.x = trainer``); ``setattr(trainer, ...)`` too. Each as ``name:line: code``."""
    tree = ast.parse(source, name)

    def pairs(node):  # (target, value) of an assignment, tuples unpacked: a, b = x, y
        for t in node.targets:
            if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple) and len(t.elts) == len(node.value.elts):
                yield from zip(t.elts, node.value.elts)
            else:
                yield t, node.value

    assigned = [p for node in ast.walk(tree) if isinstance(node, ast.Assign) for p in pairs(node)]
    stored = {  # self.<attr> = trainer, anywhere in the module
        t.attr
        for t, v in assigned
        if isinstance(v, ast.Name) and v.id == "trainer"
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }

    def is_trainer(node, names: set[str]) -> bool:
        if isinstance(node, ast.Name):
            return node.id in names
        return (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and (node.attr in stored)
        )

    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        names = {a.arg for a in fn.args.args + fn.args.kwonlyargs if a.arg == "trainer"}
        for node in ast.walk(fn):  # aliases: t = trainer, t = self.trainer
            if isinstance(node, ast.Assign):
                names |= {t.id for t, v in pairs(node) if isinstance(t, ast.Name) and is_trainer(v, names)}
        for node in ast.walk(fn):
            targets = []
            if isinstance(node, ast.Assign | ast.Delete):
                targets = node.targets
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            bad = [
                t for t in targets for t in ast.walk(t) if isinstance(t, ast.Attribute) and is_trainer(t.value, names)
            ]
            if isinstance(node, ast.Attribute) and is_trainer(node.value, names) and node.attr.startswith("_"):
                bad.append(node)
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr" and node.args:
                bad += [node] if is_trainer(node.args[0], names) else []
            found += [f"{name}:{b.lineno}: {ast.unparse(node)}" for b in bad]
    return sorted(set(found))


def test_no_module_sets_the_trainers_attributes():
    """STYLE's one owner per loop: a component handed the trainer (a rollout source, DAPO, a loop helper) returns
    values; it never sets the trainer's attributes nor calls its private methods."""
    wrong = []
    for module, path in llm_modules().items():
        with open(path, encoding="utf-8") as f:
            wrong += trainer_writes(f.read(), module)
    assert wrong == []


def test_the_owner_rule_finds_a_write():
    code = """
class Helper:
    def __init__(self, trainer):
        self.trainer, self.c = trainer, trainer.c
        trainer.rollout_copy = None

    def skip(self):
        t = self.trainer
        t.step += 1
        self.trainer._open_writer()

def loop(trainer):
    trainer._open_writer()
    setattr(trainer, "writer", None)
    return trainer.step, trainer.log_history
"""
    found = trainer_writes(code)
    assert sorted(int(line.split(":")[1]) for line in found) == [5, 9, 10, 13, 14], found
