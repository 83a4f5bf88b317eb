"""llm/run_label.py: problems labelled with a scripted completer and policy (known success probabilities), the
verifier math_exact_match, a scripted judge; resume after a stop equals an uninterrupted run; processes split the
problems without changing a label; bad input is one message naming file, record and field, with nothing of the
problem written; the tiny config runs as shipped and run_reward.py trains on its labels."""

import json
import os
import random
import subprocess
import sys
import threading
from collections import Counter

import pytest

from llm.alignment.label.completer import Completion
from llm.alignment.label.problem import Tools
from llm.alignment.label.run import label_share, run_labelling
from llm.alignment.label.store import LabelStore
from llm.alignment.label.verify import FunctionJudge, Verifier
from llm.data.readers import read_records
from llm.run_label import main as label_main
from llm.settings.label import LabelArguments
from llm.utils.errors import UserError, run_cli
from tests.helpers import ROOT, read_json, read_jsonl

TINY_CONFIG = os.path.join(ROOT, "llm", "config", "tiny", "label_argument.json")
EXACT = "llm.alignment.ppo.rewards.rule_functions:math_exact_match"


def problems_file(tmp_path, records, name="problems.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


GIVEN = ["Tom has 3 + 4 = 7 apples.", "He eats 2, so 7 - 2 = 5.", "He buys 2: 5 + 2 = 7.", "The answer is 7."]


class Scripted:
    """A completer: of the ``n`` completions of a prefix of ``j`` steps, exactly ``round(p[j] * n)`` end with the
    right answer (``answer``), the others with 0. With ``rng`` true each one is right with probability ``p[j]``
    instead, drawn from ``random.Random(seed)``, so the completions depend on the seed."""

    def __init__(self, p, answer="7", rng=False):
        self.p, self.answer, self.rng, self.prefixes = p, answer, rng, []

    def complete(self, prefixes, n, seed):
        out, draw = [], random.Random(seed)
        for prefix in prefixes:
            self.prefixes.append(len(prefix.steps))
            p = self.p[len(prefix.steps)]
            right = [draw.random() < p for _ in range(n)] if self.rng else [j < round(p * n) for j in range(n)]
            out.append([Completion(f"The answer is {self.answer if r else 0}.", True) for r in right])
        return out


class Policy:
    """Writes solutions of 3 steps: 'a', 'b', then the answer (right with probability 1/2, by the seed)."""

    def complete(self, prefixes, n, seed):
        draw = random.Random(seed)
        return [
            [Completion(f"a\nb\nThe answer is {7 if draw.random() < 0.5 else 1}.", True) for _ in range(n)]
            for _ in prefixes
        ]


def args_for(tmp_path, problems, **fields):
    fields.setdefault("verifier", EXACT)
    fields.setdefault("model_name_or_path", "scripted")  # the policy: the build gives the scripted one
    return LabelArguments(problems_path=problems, output_dir=str(tmp_path / "out"), **fields)


def build_with(completer, policy=None, judge=None):
    def build(args, problems, device):
        return Tools(completer, policy, Verifier(args.verifier), judge)

    return build


def labels_of(args):
    return read_jsonl(os.path.join(args.output_dir, "labels.jsonl"))


# --- the estimates on a scripted completer --------------------------------------------------------------------
def test_math_shepherd_labels_every_step_from_known_success_probabilities(tmp_path):
    problems = problems_file(tmp_path, [{"src": "Tom?", "tgt": "7", "responses": GIVEN}])
    # P(right) from the prefix of 1, 2, 3 steps: 3/4, 1/4, 0; the last step is the solution's own (right) answer
    completer = Scripted({1: 0.75, 2: 0.25, 3: 0.0})
    args = args_for(tmp_path, problems, num_completions=4)
    out = run_labelling(args, "test", build_with(completer))
    (rec,) = labels_of(args)
    assert rec["src"] == ["Tom?"] and rec["tgt"] == [] and rec["responses"] == GIVEN
    assert rec["labels"] == ["+", "+", "-", "+"]  # hard: any right completion; each step on its own
    assert rec["soft_labels"] == [0.75, 0.25, 0.0, 1.0]
    assert sorted(completer.prefixes) == [1, 2, 3]  # three prefixes estimated; the full solution only verified
    assert out["completions"] == 12 and out["steps"] == 4 and out["completions_per_labelled_step"] == 3.0
    assert out["estimates"] == 3 and out["positive_step_fraction"] == 0.75
    assert out["mean_soft_label"] == pytest.approx((0.75 + 0.25 + 0 + 1) / 4)
    (prm,) = read_records(os.path.join(args.output_dir, "labels.jsonl"), "prm")  # PaddleNLP's PRM format
    assert prm.labels == ["+", "+", "-", "+"] and prm.soft_labels == [0.75, 0.25, 0.0, 1.0]


def test_omegaprm_binary_search_on_a_given_wrong_solution(tmp_path):
    # 8 steps, the last answer wrong; MC > 0 for prefixes of 1-5 steps, 0 from 6 on: the first error is step 5.
    # lo=0, hi=8: mid 4 (prefix of 5: >0) lo 5; mid 6 (0) hi 6; mid 5 (0) hi 5 -> 3 estimates, not 7
    steps = [f"step {i}" for i in range(7)] + ["The answer is 3."]
    problems = problems_file(tmp_path, [{"src": "q", "tgt": "7", "responses": steps}])
    completer = Scripted({j: (0.5 if j <= 5 else 0.0) for j in range(9)})
    args = args_for(tmp_path, problems, method="omegaprm", num_completions=4)
    out = run_labelling(args, "test", build_with(completer))
    (rec,) = labels_of(args)
    assert rec["labels"] == ["+"] * 5 + ["-"] * 3
    assert rec["soft_labels"] == [None, None, None, None, 0.5, 0.0, 0.0, 0.0]
    assert completer.prefixes == [5, 7, 6] and out["estimates"] == 3 and out["completions"] == 12


def test_omegaprm_does_not_search_a_right_solution(tmp_path):
    problems = problems_file(tmp_path, [{"src": "q", "tgt": "7", "responses": GIVEN}])
    completer = Scripted({})
    args = args_for(tmp_path, problems, method="omegaprm", num_completions=4)
    out = run_labelling(args, "test", build_with(completer))
    assert labels_of(args)[0]["labels"] == ["+"] * 4 and completer.prefixes == [] and out["completions"] == 0


class Tree:
    """For OmegaPRM's tree search. The policy (the root): half its solutions right (g, g, answer 7), half wrong at
    their second step (g, x, answer 1). The completer: from a prefix holding "x" never right; else half right,
    half going wrong with an "x" step."""

    def __init__(self, root):
        self.root = root

    def complete(self, prefixes, n, seed):
        (prefix,) = prefixes
        if self.root:
            right, wrong = "g\ng\nThe answer is 7.", "g\nx\nThe answer is 1."
        elif "x" in prefix.steps:
            right = wrong = "The answer is 1."
        else:
            right, wrong = "The answer is 7.", "x\nThe answer is 1."
        return [[Completion(right if j < n // 2 else wrong, True) for j in range(n)]]


def test_omegaprm_tree_search_when_the_policy_writes(tmp_path):
    problems = problems_file(tmp_path, [{"src": "q", "tgt": "7"}])
    args = args_for(tmp_path, problems, method="omegaprm", num_completions=4, omega_max_search_count=1)
    out = run_labelling(args, "test", build_with(Tree(root=False), Tree(root=True)))
    records = labels_of(args)
    right = [r for r in records if "-" not in r["labels"]]
    assert len(right) == 2 and right[0]["responses"] == ["g", "g", "The answer is 7."]
    assert right[0]["soft_labels"] == [None, None, 1.0]
    # one search of g, x, answer 1 from the root: mid 1 (prefix g, x: MC 0), mid 0 (prefix g: MC 1/2)
    (searched,) = [r for r in records if "-" in r["labels"]]
    assert searched["responses"] == ["g", "x", "The answer is 1."]
    assert searched["labels"] == ["+", "-", "-"] and searched["soft_labels"] == [0.5, 0.0, 0.0]
    assert out["policy_solutions_generated"] == 4 and out["completions"] == 8 and out["estimates"] == 3


def test_the_policy_writes_solutions_split_at_the_separator(tmp_path):
    problems = problems_file(tmp_path, [{"prompt": "q", "answer": "7"}])
    args = args_for(tmp_path, problems, num_solutions=3, num_completions=2)
    out = run_labelling(args, "test", build_with(Scripted({1: 1.0, 2: 0.5}), Policy()))
    records = labels_of(args)
    assert [r["solution_index"] for r in records] == [0, 1, 2]
    for r in records:
        assert r["responses"][:2] == ["a", "b"] and len(r["responses"]) == 3
        right = r["responses"][2] == "The answer is 7."
        assert r["labels"] == ["+", "+", "+" if right else "-"] and r["soft_labels"] == [1.0, 0.5, float(right)]
    assert out["policy_solutions_generated"] == 3


def test_consensus_keeps_the_solutions_where_the_judge_agrees(tmp_path, monkeypatch):
    # MC labels: first '-' at step 2 (P = 0 from the prefix of 3 steps). The judge says 2, 1, no answer, 2
    problems = problems_file(tmp_path, [{"src": f"q{i}", "tgt": "7", "responses": GIVEN} for i in range(4)])
    verdicts = {"q0": 2, "q1": 1, "q2": None, "q3": 2}
    monkeypatch.setattr("tests.test_label.JUDGE", lambda q, steps, ref: verdicts[q], raising=False)
    judge = FunctionJudge("tests.test_label:JUDGE")
    args = args_for(tmp_path, problems, num_completions=2, judge="tests.test_label:JUDGE")
    completer = Scripted({1: 1.0, 2: 1.0, 3: 0.0})
    out = run_labelling(args, "test", build_with(completer, judge=judge))
    kept = labels_of(args)
    assert [r["src"] for r in kept] == [["q0"], ["q3"]]
    assert out["judged"] == 4 and out["dropped_by_consensus"] == 2 and out["judge_no_answer"] == 1
    assert out["judge_agreement"] == 0.5


# --- resume, seeds, processes ---------------------------------------------------------------------------------
class StopAfter(Scripted):
    """Scripted, with a stop (as a kill) at the ``calls``-th completion call."""

    def __init__(self, calls, **kw):
        super().__init__({1: 0.5, 2: 0.5}, rng=True, **kw)
        self.left = calls

    def complete(self, prefixes, n, seed):
        self.left -= 1
        if self.left < 0:
            raise KeyboardInterrupt("killed")
        return super().complete(prefixes, n, seed)


def five_problems(tmp_path):
    return problems_file(tmp_path, [{"src": f"q{i}", "tgt": "7"} for i in range(5)])


def test_a_stopped_run_resumes_to_the_file_of_an_uninterrupted_run(tmp_path):
    problems = five_problems(tmp_path)
    full = args_for(tmp_path / "a", problems, num_solutions=2, num_completions=8)
    run_labelling(full, "test", build_with(Scripted({1: 0.5, 2: 0.5}, rng=True), Policy()))
    expected = (tmp_path / "a" / "out" / "labels.jsonl").read_text()

    args = args_for(tmp_path / "b", problems, num_solutions=2, num_completions=8)
    with pytest.raises(KeyboardInterrupt):  # a completion call per solution, two per problem: stops in problem 3
        run_labelling(args, "test", build_with(StopAfter(6), Policy()))
    store = LabelStore(args.output_dir)
    assert sorted(store.finished()) == [0, 1, 2]
    labels_part, _ = store.files(0)
    with open(labels_part, "a", encoding="utf-8") as f:  # a kill in the middle of writing problem 3's records
        f.write(json.dumps({"problem_index": 3, "solution_index": 0, "src": ["q3"]}) + "\n" + '{"src": ["q3"], "resp')
    completer = Scripted({1: 0.5, 2: 0.5}, rng=True)
    out = run_labelling(args, "test", build_with(completer, Policy()))
    assert (tmp_path / "b" / "out" / "labels.jsonl").read_text() == expected
    assert len(completer.prefixes) == 2 * 2 * 2  # problems 3 and 4 only: 2 solutions x 2 prefixes each
    assert out["problems_labelled"] == 5 and out["records"] == 10


def test_other_settings_in_the_output_dir_are_refused_unless_overwritten(tmp_path):
    problems = five_problems(tmp_path)
    completer = Scripted({1: 0.5, 2: 0.5}, rng=True)
    build = build_with(completer, Policy())
    run_labelling(args_for(tmp_path, problems, num_solutions=2, max_problems=1), "test", build)
    with pytest.raises(UserError, match=r"other settings \(differing: seed \(42 -> 7\)\).*overwrite_output_dir"):
        run_labelling(args_for(tmp_path, problems, num_solutions=2, seed=7), "test", build)
    # max_problems says how many, not what a label is: all five resume the first one
    completer.prefixes.clear()
    assert run_labelling(args_for(tmp_path, problems, num_solutions=2), "test", build)["problems_labelled"] == 5
    assert len(completer.prefixes) == 4 * 2 * 2
    completer.prefixes.clear()
    out = run_labelling(args_for(tmp_path, problems, num_solutions=2, seed=7, overwrite_output_dir=True), "t", build)
    assert out["problems_labelled"] == 5 and len(completer.prefixes) == 5 * 2 * 2  # started afresh


def test_a_run_that_labelled_nothing_is_no_obstacle_to_other_settings(tmp_path):
    store = LabelStore(str(tmp_path))
    store.claim({"model_name_or_path": "typo"}, False)  # then the model failed to load: nothing labelled
    store.claim({"model_name_or_path": "fixed"}, False)
    assert read_json(tmp_path / "label_run.json") == {"model_name_or_path": "fixed"}
    store.append(0, 0, [], Counter(problems=1))
    with pytest.raises(UserError, match=r"model_name_or_path \(fixed -> other\)"):
        store.claim({"model_name_or_path": "other"}, False)


def test_two_processes_write_the_labels_of_one(tmp_path):
    problems = five_problems(tmp_path)
    one = args_for(tmp_path / "one", problems, num_solutions=2)
    run_labelling(one, "test", build_with(Scripted({1: 0.5, 2: 0.5}, rng=True), Policy()))
    two = args_for(tmp_path / "two", problems, num_solutions=2)
    store = LabelStore(two.output_dir)
    store.claim({}, False)
    build = build_with(Scripted({1: 0.5, 2: 0.5}, rng=True), Policy())
    todo = read_records(problems, "problem")
    assert [label_share(two, todo[r::2], r, build) for r in (0, 1)] == [3, 2]
    store.merge()
    merged = (tmp_path / "two" / "out" / "labels.jsonl").read_text()
    assert merged == (tmp_path / "one" / "out" / "labels.jsonl").read_text()


# --- bad input ------------------------------------------------------------------------------------------------
def test_a_problem_without_a_reference_stops_before_anything_is_written(tmp_path, capsys):
    problems = problems_file(tmp_path, [{"src": "q0", "tgt": "7"}, {"src": "q1"}])
    argv = [TINY_CONFIG, "--problems_path", problems, "--output_dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as stop:
        run_cli(label_main, argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "problems.jsonl: record 1" in err and "field 'tgt'" in err and "no reference answer" in err
    assert "Traceback" not in err
    assert not os.path.exists(tmp_path / "out" / "labels.jsonl") and not os.path.exists(tmp_path / "out" / "parts")


def test_a_verifier_that_raises_names_the_problem_and_writes_nothing_of_it(tmp_path, monkeypatch):
    def verify(question, solution, reference):
        if question == "q1":
            raise ZeroDivisionError("boom")
        return 1.0

    monkeypatch.setattr("tests.test_label.VERIFY", verify, raising=False)
    problems = problems_file(tmp_path, [{"src": f"q{i}", "tgt": "7", "responses": GIVEN} for i in range(3)])
    args = args_for(tmp_path, problems, verifier="tests.test_label:VERIFY", num_completions=1)
    with pytest.raises(UserError) as err:
        run_labelling(args, "test", build_with(Scripted({1: 1, 2: 1, 3: 1})))
    assert "problems.jsonl: record 1, field 'verifier'" in str(err.value) and "ZeroDivisionError: boom" in str(
        err.value
    )
    assert sorted(LabelStore(args.output_dir).finished()) == [0]
    assert [r["problem_index"] for r in read_jsonl(LabelStore(args.output_dir).files(0)[0])] == [0]


def test_a_completer_that_never_finishes_stops_at_the_timeout(tmp_path):
    release = threading.Event()

    class Stuck(Scripted):
        def complete(self, prefixes, n, seed):
            if any(p.prompt[-1]["content"] == "q1" for p in prefixes):
                release.wait(30)
            return super().complete(prefixes, n, seed)

    problems = problems_file(tmp_path, [{"src": f"q{i}", "tgt": "7", "responses": GIVEN} for i in range(3)])
    args = args_for(tmp_path, problems, completion_timeout=0.5, num_completions=1)
    try:
        with pytest.raises(UserError) as err:
            run_labelling(args, "test", build_with(Stuck({1: 1, 2: 1, 3: 1})))
    finally:
        release.set()
    assert "problems.jsonl: record 1, field 'completion_timeout'" in str(err.value)
    assert sorted(LabelStore(args.output_dir).finished()) == [0]


@pytest.mark.parametrize(
    "record, field, words",
    [
        ({"labels": ["+", "-"]}, "labels", "has 2 label(s) but 'responses' has 3 step(s)"),
        ({"soft_labels": [0.5, 1.0]}, "soft_labels", "has 2 value(s) but 'responses' has 3 step(s)"),
        ({"soft_labels": [0.5, 1.5, None]}, "soft_labels", "value 1 is 1.5, not a number in [0, 1]"),
        ({"soft_labels": [0.5, -0.25, None]}, "soft_labels", "value 1 is -0.25"),
        ({"soft_labels": [0.5, True, None]}, "soft_labels", "value 1 is True"),
    ],
)
def test_a_bad_labels_file_names_file_record_and_field(tmp_path, record, field, words):
    good = {"src": ["q"], "tgt": [], "responses": ["a", "b", "c"], "labels": ["+", "+", "-"]}
    path = problems_file(tmp_path, [good, {**good, **record}], "labels.jsonl")
    with pytest.raises(UserError) as err:
        read_records(path, "prm")
    assert f"labels.jsonl: record 1 (line 2), field '{field}'" in str(err.value) and words in str(err.value)


# --- the shipped config, and training on its labels -----------------------------------------------------------
def test_the_tiny_config_runs_as_shipped_and_run_reward_trains_on_its_labels(tmp_path):
    out = tmp_path / "labels"
    label_main([TINY_CONFIG, "--output_dir", str(out)])
    report = read_json(out / "report.json")
    with open(TINY_CONFIG, encoding="utf-8") as f:
        shipped = json.load(f)
    assert report["problems_labelled"] == shipped["max_problems"]
    records = read_records(str(out / "labels.jsonl"), "prm")
    assert records and all(len(r.soft_labels) == len(r.steps) == len(r.labels) for r in records)
    assert report["completions_per_labelled_step"] == report["completions"] / report["steps"]

    from llm.run_reward import main as reward_main

    reward_main([
        os.path.join(ROOT, "llm", "config", "tiny", "prm_argument.json"),
        "--train_dataset_path", str(out / "labels.jsonl"), "--do_eval", "false", "--max_steps", "2",
        "--soft_labels", "true", "--output_dir", str(tmp_path / "prm"), "--report_to", "none",
        "--save_strategy", "no", "--warmup_steps", "0", "--max_seq_len", "256", "--max_prompt_len", "128",
    ])  # fmt: skip
    results = read_json(tmp_path / "prm" / "all_results.json")
    assert results["train_loss"] > 0


@pytest.mark.real_model
def test_the_smollm2_config_labels_with_the_real_model(tmp_path):
    from tests.real_model import converted_dir

    out = tmp_path / "labels"
    small = ["--max_problems", "1", "--num_solutions", "1", "--num_completions", "2", "--max_new_tokens", "48"]
    small += ["--max_solution_steps", "3"]  # bounded: at most 2 estimated steps x 2 completions
    config = os.path.join(ROOT, "llm", "config", "smollm2", "label_argument.json")
    label_main([config, "--model_name_or_path", converted_dir(), "--output_dir", str(out), *small])
    report = read_json(out / "report.json")
    assert report["problems_labelled"] == 1 and report["policy_solutions_generated"] == 1
    records = read_records(str(out / "labels.jsonl"), "prm")
    for r in records:  # the steps of SmolLM2's solution, each estimated from 2 completions (the last: its answer)
        assert len(r.steps) == len(r.labels) == len(r.soft_labels)
        assert all(v in (0.0, 0.5, 1.0) for v in r.soft_labels[:-1]) and r.soft_labels[-1] in (0.0, 1.0)
    assert report["completions"] == 2 * (report["steps"] - report["solutions"])


@pytest.mark.slow
def test_torchrun_two_processes_write_the_labels_of_one(tmp_path):
    """Each rank holds a model of its own: its generate must not step in sync with the other rank (it did, and
    hung once a rank ran out of problems)."""
    label_main([TINY_CONFIG, "--output_dir", str(tmp_path / "one"), "--max_problems", "4"])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    script = os.path.join(ROOT, "llm", "run_label.py")
    argv = [TINY_CONFIG, "--output_dir", str(tmp_path / "two"), "--max_problems", "4"]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", script, *argv],
        check=False, env=env, timeout=300, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "two" / "parts")) == [
        "rank-0.done.jsonl", "rank-0.labels.jsonl", "rank-1.done.jsonl", "rank-1.labels.jsonl",
    ]  # fmt: skip
    assert (tmp_path / "two" / "labels.jsonl").read_text() == (tmp_path / "one" / "labels.jsonl").read_text()
    assert read_json(tmp_path / "two" / "report.json") == read_json(tmp_path / "one" / "report.json")


@pytest.mark.slow
def test_ray_workers_write_the_labels_of_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.path.join(ROOT, "tests"))  # the workers unpickle this module's completers
    problems = five_problems(tmp_path)
    one = args_for(tmp_path / "one", problems, num_solutions=2)
    run_labelling(one, "test", build_with(Scripted({1: 0.5, 2: 0.5}, rng=True), Policy()))
    ray = args_for(tmp_path / "ray", problems, num_solutions=2, ray_workers=2)
    out = run_labelling(ray, "test", build_with(Scripted({1: 0.5, 2: 0.5}, rng=True), Policy()))
    assert out["problems_labelled"] == 5
    assert sorted(os.listdir(tmp_path / "ray" / "out" / "parts"))[:2] == ["rank-0.done.jsonl", "rank-0.labels.jsonl"]
    assert labels_of(ray) == labels_of(one)
