"""The layout of the code, checked: no import cycles in llm/, no oversized files, library code that imports
neither tests nor the sample-data generator; the reward registry that both the config check and the builder
read; and the one-pass decoding behind PRM dense rewards, against the decode-every-prefix it replaced."""

from __future__ import annotations

import ast
import os
import random
from typing import ClassVar

import pytest
import torch
from transformers import AutoTokenizer

from llm.alignment.ppo import rewards
from llm.alignment.ppo.build import build_role
from llm.alignment.ppo.records import RewardOutput, Samples
from llm.alignment.ppo.rewards import REWARDS, RewardFunction, char_to_token_end, decoded_lengths, register_reward
from llm.run_ppo import main
from llm.settings.load import parse_ppo_config
from llm.utils.errors import UserError
from tests.helpers import ROOT, tokenizer
from tests.test_ppo_run import config, history
from tests.test_prm_tokenizers import mistral_dir, qwen_dir  # noqa: F401 - fixtures: the real tokenizers, offline

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


# --- the reward registry --------------------------------------------------------------------------------
def test_an_unregistered_reward_type_is_refused_with_the_valid_ones(tmp_path):
    assert {"orm", "prm", "rule", "http"} <= set(REWARDS)
    valid = ", ".join(sorted(REWARDS))
    with pytest.raises(UserError, match=rf"reward.type must be one of {valid}, got 'orn' \(closest: 'orm'"):
        parse_ppo_config([config(tmp_path, reward={"type": "orn"})])
    with pytest.raises(UserError, match=r"reward.type='http' needs reward.url"):
        parse_ppo_config([config(tmp_path, reward={"type": "http"})])
    with pytest.raises(UserError, match=r"reward.type='prm' needs reward.model_name_or_path"):
        parse_ppo_config([config(tmp_path, reward={"type": "prm"})])


def test_every_registered_reward_type_builds_and_scores():
    for name, kind in REWARDS.items():
        assert kind.name == name and issubclass(kind.cls, RewardFunction)
        for method in ("from_config", "score"):
            assert getattr(kind.cls, method) is not getattr(RewardFunction, method), (name, method)


class ToyLength(RewardFunction):
    """A toy reward type: ``scale`` x the response's length in characters (``reward.timeout`` as the scale,
    to show a type reading its settings from the reward section)."""

    calls: ClassVar[list[int]] = []

    def __init__(self, scale: float) -> None:
        self.scale = scale

    @classmethod
    def from_config(cls, c, place) -> ToyLength:
        return cls(c.reward.timeout)

    def score(self, samples: Samples) -> RewardOutput:
        ToyLength.calls.append(len(samples))
        return RewardOutput(torch.tensor([self.scale * len(r) for r in samples.responses]))


@pytest.fixture
def toy_reward():
    register_reward("toy_length")(ToyLength)
    ToyLength.calls = []
    try:
        yield
    finally:
        del REWARDS["toy_length"]


def test_a_registered_toy_reward_type_runs_through_build_and_a_run(tmp_path, toy_reward):
    c = parse_ppo_config([config(tmp_path, reward={"type": "toy_length", "timeout": 0.5})])
    reward = build_role(c, "reward")
    assert isinstance(reward, ToyLength) and reward.scale == 0.5
    n = 3
    s = Samples([[1, 5]] * n, [[9]] * n, ["q"] * n, ["ab", "", "abcd"], [None] * n, torch.ones(n, dtype=bool))
    assert reward.score(s).scores.tolist() == [1.0, 0.0, 2.0]
    # It has no model: the model settings of a reward are refused, naming the types that have one.
    with pytest.raises(UserError, match=r"reward.dtype applies to a reward model \(type orm or prm\)"):
        parse_ppo_config([config(tmp_path, reward={"type": "toy_length", "dtype": "bfloat16"})])
    # A whole run with it (the critic starts from the actor: the toy has no value head).
    out, ToyLength.calls = tmp_path / "out", []
    main([config(tmp_path, reward={"type": "toy_length", "timeout": 0.5}, training={"max_steps": 1})])
    assert len(ToyLength.calls) == 1 and len(history(out)) == 1  # one step: one batch scored
    assert history(out)[0]["score"] >= 0
    assert "toy_length" not in rewards.model_types()


# --- one-pass decoding for PRM dense rewards ----------------------------------------------------------
def old_char_to_token_end(tokenizer, response_ids: list[int], char_end: int) -> int:
    """The function it replaced: decodes every prefix again for each step."""
    for k in range(len(response_ids)):
        if len(tokenizer.decode(response_ids[: k + 1], skip_special_tokens=True)) >= char_end:
            return k
    return len(response_ids) - 1


TEXTS = [
    "Cheese costs 3 * 4 = 12 dollars.\nThe answer is 12.",
    "Step 1: Janet’s ducks lay 16 eggs.  \nStep 2: 16 - 3 = <<16-3=13>>13 ки\n\nThe answer is: 18",
    "价格是 3 × 4 = 12 元。\n答案是 12。",
    "Émile paid €12.50 🙂 for it , isn't it ?\n  So 12 .",
    " leading space\nand  double  spaces \n",
]


def check_same(tok, ids: list[int]) -> None:
    prefix = [len(tok.decode(ids[: k + 1], skip_special_tokens=True)) for k in range(len(ids))]
    assert decoded_lengths(tok, ids) == prefix, tok.convert_ids_to_tokens(ids)
    lengths = decoded_lengths(tok, ids)
    for char_end in range((prefix[-1] if prefix else 0) + 2):
        assert char_to_token_end(tok, ids, char_end) == old_char_to_token_end(tok, ids, char_end)
        assert char_to_token_end(tok, ids, char_end, lengths) == old_char_to_token_end(tok, ids, char_end)


@pytest.mark.parametrize("which", ["tiny", "qwen", "mistral"])
def test_one_pass_token_ends_equal_decoding_every_prefix(which, request):
    tok = tokenizer() if which == "tiny" else AutoTokenizer.from_pretrained(request.getfixturevalue(f"{which}_dir"))
    specials = [t for t in (tok.eos_token_id, tok.bos_token_id) if t is not None]
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        check_same(tok, ids)
        check_same(tok, ids + specials[:1])  # a response that ended with EOS
        check_same(tok, ids[:3] + specials + ids[3:])  # special tokens inside (skipped when decoding)
    # Sampled responses: any ids, so byte-level tokens that hold part of a character (decoded as U+FFFD).
    rng = random.Random(0)
    vocab = len(tok)
    for _ in range(6):
        check_same(tok, [rng.randrange(vocab) for _ in range(rng.randint(1, 40))])
    for text in TEXTS[2:4]:  # multi-byte characters cut into their bytes, where the tokenizer has byte tokens
        ids = [i for ch in text for i in tok(ch, add_special_tokens=False)["input_ids"]]
        check_same(tok, ids)
