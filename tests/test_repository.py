"""Whole-repository checks: no import cycles in llm/, no oversized files, library code that imports neither tests
nor the sample-data generator, and the tokenizer assets agreeing with the sample generator."""

from __future__ import annotations

import ast
import os

from tests.helpers import ROOT

LLM = os.path.join(ROOT, "llm")
MAX_LINES = 500
# Files allowed over MAX_LINES, each with its reason (out of the PPO layout's scope; they have their own issues).
LONG_FILES: dict[str, str] = {}
# Modules of llm/ that may import llm.data.make_sample_data: generators building on its problems.
SAMPLE_GENERATOR = "llm.data.make_sample_data"
SAMPLE_PROBLEMS = "llm.data.sample_problems"  # the generators' word problems (split out of make_sample_data)
GENERATOR_USERS = {"llm.data.make_sft_data": "the SFT sample generator draws the same arithmetic problems"}


def llm_modules() -> dict[str, str]:
    out = {}
    for directory, _, files in os.walk(LLM):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[module.removesuffix(".__init__")] = path
    return out


def imported_names(path: str, module: str) -> set[str]:
    """Every module an ``import`` in ``path`` names, at any depth (in functions too), except under
    ``if TYPE_CHECKING:`` (type hints only, never run)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    hidden = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the llm modules it imports (a name resolves to the longest module it starts with)."""
    modules = llm_modules()
    graph = {}
    for module, path in modules.items():
        targets = set()
        for name in imported_names(path, module):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_llm_has_no_import_cycles():
    """Not even through imports inside functions (they only hide a cycle from the loader)."""
    graph = import_graph()
    assert "llm.alignment.ppo.build" in graph and "llm.alignment.ppo.ray_roles" in graph["llm.alignment.ppo.build"]
    assert cycles(graph) == []


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_llm_file_is_over_500_lines_but_the_listed_ones():
    sizes = {}
    for path in llm_modules().values():
        with open(path, encoding="utf-8") as f:
            sizes[os.path.relpath(path, ROOT).replace(os.sep, "/")] = sum(1 for _ in f)
    over = {p: n for p, n in sizes.items() if n > MAX_LINES and p not in LONG_FILES}
    assert over == {}, f"over {MAX_LINES} lines: {over}; split them by job, or list one in LONG_FILES with why"
    assert set(LONG_FILES) <= set(sizes)  # a listed file that went away: drop it from the list


def test_llm_imports_neither_tests_nor_the_sample_generator():
    graph = import_graph()
    for module, path in llm_modules().items():
        names = imported_names(path, module)
        assert not any(n == "tests" or n.startswith("tests.") for n in names), module
        if module != SAMPLE_GENERATOR and module not in GENERATOR_USERS:
            assert SAMPLE_GENERATOR not in graph[module], f"{module} imports the sample-data generator"
            assert SAMPLE_PROBLEMS not in graph[module], f"{module} imports the sample problems"
    assert "llm.utils.tokenizer_assets" in graph


def test_the_tokenizer_assets_agree_with_the_sample_generator():
    from llm.data import make_sample_data
    from llm.utils import tokenizer_assets

    assert tokenizer_assets.SAMPLE_DIR == make_sample_data.SAMPLE_DIR
    assert tokenizer_assets.PLACEHOLDER == make_sample_data.PLACEHOLDER
