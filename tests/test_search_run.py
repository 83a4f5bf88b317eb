"""PRM-guided search end to end: the policy's steps cut at the marker (a scripted engine), ``run_search.py`` on the
tiny config as shipped (its outputs agree with themselves and with the answer function), and bad input: one
message naming the field and the fix, exit 2."""

from __future__ import annotations

import json

import pytest

from llm.alignment.ppo.rewards.rule_functions import last_number
from llm.alignment.rm.evaluation import AGGREGATIONS
from llm.alignment.search.policy import PRMScore, StepPolicy
from llm.alignment.search.tree import Step
from llm.run_search import main
from llm.settings.search import AGGREGATIONS as SETTING_AGGREGATIONS
from llm.utils.errors import run_cli
from tests.helpers import ROOT, read_json, read_jsonl, tokenizer

CONFIG = f"{ROOT}/llm/config/tiny/search_argument.json"


class ScriptedEngine:
    """``generate`` with the engines' contract, answering each request with the next scripted text's ids."""

    def __init__(self, tok, texts):
        self.tok, self.texts, self.calls = tok, list(texts), []

    def __call__(self, prompt_ids, *, num_samples, max_new_tokens, seed, stop):
        self.calls.append({"prompts": prompt_ids, "max_new_tokens": max_new_tokens, "stop": stop})
        out = []
        for _ in prompt_ids:
            text = self.texts.pop(0)
            ids = self.tok(text.replace("<eos>", ""), add_special_tokens=False)["input_ids"]
            out.append(ids + [self.tok.eos_token_id] * text.endswith("<eos>"))
        return out


def policy(texts, **kw):
    tok = tokenizer()
    engine = ScriptedEngine(tok, texts)
    settings = {"max_step_tokens": 6, "max_new_tokens": 40, "batch_size": 2, **kw}
    return StepPolicy(engine, tok, [tok("Q?\n")["input_ids"]], "\n", **settings), engine, tok


def test_a_step_ends_at_its_marker_at_eos_or_at_the_caps():
    p, engine, tok = policy(["x = 1\ny = 2", "The answer is 3.<eos>", "a b c d e f"])
    steps = p.expand([(0, ())], [3], seed=1, final=False)
    # cut right after the marker (the engine ran past it); EOS ends the solution; 6 tokens without the marker:
    # a step all the same, counted as capped
    assert steps == [[Step("x = 1\n", False), Step("The answer is 3.", True), Step("a b c d e f", False)]]
    assert (p.counts.steps, p.counts.capped) == (3, 1)
    assert [c["stop"] for c in engine.calls] == ["\n", "\n"] and engine.calls[0]["max_new_tokens"] == 6
    assert [len(c["prompts"]) for c in engine.calls] == [2, 1]  # batch_size 2
    # a prefix continues from the problem's prompt ids and the tokens of the steps so far
    engine.texts.append("z\n")
    p.expand([(0, ("x = 1\n", "y = 2\n"))], [1], seed=1, final=False)
    solution = tok("x = 1\ny = 2\n", add_special_tokens=False)["input_ids"]
    assert engine.calls[-1]["prompts"] == [tok("Q?\n")["input_ids"] + solution]


def test_the_last_round_and_the_solution_budget_end_the_solution():
    p, engine, _ = policy(["w = 1\nv = 2", "u = 9"], max_new_tokens=12)
    path = ("x = 1\n",)  # 5 tokens: 7 left of max_new_tokens
    assert p.expand([(0, path)], [1], seed=0, final=True) == [[Step("w = 1\nv = 2", True)]]
    assert engine.calls[-1]["stop"] is None and engine.calls[-1]["max_new_tokens"] == 7
    # not final: min(max_step_tokens 6, 7 left); 3 tokens without the marker, below both caps: not done, not capped
    assert p.expand([(0, path)], [1], seed=0, final=False) == [[Step("u = 9", False)]]
    assert engine.calls[-1]["max_new_tokens"] == 6 and p.counts.capped == 0


def test_the_prm_reads_each_node_split_at_the_marker():
    class Recorder:
        def score_steps(self, problems, steps):
            self.seen = (problems, steps)
            return [[0.5] * len(s) for s in steps]

    scorer = Recorder()
    score = PRMScore(scorer, ["Q1?\n", "Q2?\n"], "\n")
    score([(1, ("a = 1\n", " cut at the cap", "b = 2\nThe answer is 2.")), (0, ("\n",))])
    assert scorer.seen == (["Q2?\n", "Q1?\n"], [["a = 1", "cut at the cap", "b = 2", "The answer is 2."], ["(empty)"]])


def test_the_settings_aggregations_are_the_evaluations():
    assert set(SETTING_AGGREGATIONS) == set(AGGREGATIONS)


def run(tmp_path, *overrides):
    out = tmp_path / "out"
    metrics = main([CONFIG, "--search.output_dir", str(out), *overrides])
    return metrics, read_jsonl(out / "search_results.jsonl"), read_json(out / "search_metrics.json")


def test_the_tiny_config_runs_as_shipped_and_its_outputs_agree(tmp_path):
    metrics, results, saved = run(tmp_path)
    assert metrics == saved and saved["problems"] == 4 == len(results)
    with open(CONFIG, encoding="utf-8") as f:
        search = json.load(f)["search"]
    n_of = {m: search["budgets"] for m in search["methods"]}
    keys = {f"{m}@{n}" for m, ns in n_of.items() for n in ns}
    keys |= {f"{k}@{n}" for k in ("weighted_vote", "majority_vote", "pass") for n in search["budgets"]}
    assert keys <= set(saved)
    references = [r["tgt"] for r in read_jsonl(f"{ROOT}/llm/data/sample/prompts.jsonl")][:4]
    for key in sorted(k for k in keys if k.split("@")[0] in n_of):
        n = key.split("@")[1]
        for line, reference in zip(results, references):
            r = line["results"][key]
            nodes = {node["id"]: node for node in r["tree"]}
            chosen = max(r["candidates"], key=lambda i: nodes[i]["score"])  # the first of equal scores
            path, node = [], chosen
            while node >= 0:
                path.append(nodes[node]["step"])
                node = nodes[node]["parent"]
            assert r["solution"] == "".join(reversed(path)) and r["score"] == r["scores"][-1]  # aggregation last
            assert r["answer"] == last_number(r["solution"]) and r["correct"] == (r["answer"] == reference)
            assert len(r["candidates"]) <= int(n) and all(0 < s < 1 for s in r["scores"])
        assert saved[key] == sum(line["results"][key]["correct"] for line in results) / 4
    assert saved["steps"] > saved["steps_capped"] > 0  # the random policy rarely writes a newline


def parity(text: str) -> str:
    """A test answer: the parity of the solution's length (the random policy gets about half of them right)."""
    return str(len(text) % 2)


def test_accuracy_against_n_is_each_methods_share_of_right_answers(tmp_path, capsys):
    # the answer function reads the reference too: "x" -> "1", "xx" -> "0"
    problems = tmp_path / "parity.jsonl"
    problems.write_text(
        "".join(json.dumps({"src": f"Problem {i}?", "tgt": "x" * (1 + i % 2)}) + "\n" for i in range(6))
    )
    metrics, results, _ = run(
        tmp_path,
        "--data.problems_path", str(problems),
        "--data.max_problems", "6",
        "--search.answer", "tests.test_search_run:parity",
        "--search.step_marker", "@@@",  # never written: every step ends at the step cap
    )  # fmt: skip
    log = capsys.readouterr().err  # the run's own handler writes the log to stderr
    for key in ("beam_search@4", "dvts@4", "best_of_n@4", "beam_search@2", "best_of_n@2"):
        right = [parity(r["results"][key]["solution"]) == str(1 - r["index"] % 2) for r in results]
        assert [r["results"][key]["correct"] for r in results] == right
        assert metrics[key] == sum(right) / 6
    assert 0 < metrics["pass@4"] and metrics["best_of_n@4"] <= metrics["pass@4"] >= metrics["majority_vote@4"]
    assert metrics["pass@2"] <= metrics["pass@4"]  # the first 2 of the same 4 solutions
    assert "search.step_marker '@@@' did not occur" in log and "(a step cap)" in log
    assert metrics["steps_capped"] > 0


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (
            ["--search.budgets", "[2]", "--search.beam_width", "4"],
            "search.budgets: 2 is smaller than search.beam_width 4",
        ),
        (["--search.budgets", "[6]", "--search.beam_width", "4"], "use 4 or 8"),
        (
            ["--prm.kind", "no_such_kind"],
            "prm.kind must be one of discriminative, orm, generative, implicit, got 'no_such_kind'",
        ),
        (["--search.methods", '["beam"]'], "each of search.methods must be one of beam_search, dvts, best_of_n"),
        (["--policy.model_name_or_path", "null"], "policy.model_name_or_path is required"),
        (["--search.answer", "no_such_module:f"], "search.answer 'no_such_module:f': cannot import"),
        (["--search.aggregation", "prod"], "search.aggregation must be one of last, min, product, mean"),
    ],
)
def test_bad_settings_stop_with_one_message_and_exit_2(tmp_path, capsys, overrides, needle):
    with pytest.raises(SystemExit) as info:
        run_cli(main, [CONFIG, "--search.output_dir", str(tmp_path / "out"), *overrides])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_every_search_config_in_tree_parses():
    import glob

    from llm.settings.load import parse_search_config

    files = sorted(glob.glob(f"{ROOT}/llm/config/*/search*_argument.json"))
    assert len(files) >= 2, files
    for path in files:
        c = parse_search_config([path])
        assert c.policy.model_name_or_path and c.prm.model_name_or_path and c.data.problems_path, path
        assert all(n % c.search.beam_width == 0 for n in c.search.budgets), path
