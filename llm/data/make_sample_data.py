"""Deterministic generator of the small bundled data sets in ``llm/data/sample/``.

Run from the repository root::

    python -m llm.data.make_sample_data [--out-dir DIR]

Everything comes from arithmetic word problems made here (standard library only, fixed
seeds), so the files are byte-identical on every run and every machine. Numbers stay small
(question operands 1-9, every result 0-99) so that a 2-layer transformer trained for a few
CPU minutes can learn to spot a wrong step.

A solution is a list of steps; each computational step shows one equation ``a op b = c``
and the last step is ``The answer is c.``. A wrong solution carries exactly one error and
then follows the wrong value honestly, which gives Math-Shepherd style labels: a step is
``+`` only if it and every earlier step are right, so the first wrong step and every later
step are ``-``. Error kinds:

- ``echo``: the result just repeats the number before ``=`` (``3 * 4 = 4``; PRM files only);
- ``result``: the equation's result is off by 1-3 (``3 * 4 = 13``);
- ``carry``: an earlier result is copied wrongly into the equation (the operand matches no
  number of the question and no earlier result), the arithmetic itself is right;
- ``answer``: the final answer does not repeat the last result.

The pair files draw ``result`` (at any step), ``carry`` and ``answer`` errors. The PRM files
use their own mix, ``PRM_ERROR_MIX``, chosen so that the tiny CPU demo model visibly learns
in minutes: mostly ``echo`` errors, at any step whose second operand is a (one-digit) number
of the question, so spotting one compares two digits a fixed three tokens apart, which a
2-layer model learns quickly (multiplication tables and comparisons across steps take it far
longer); and some ``result``, ``carry`` (both in the last equation) and ``answer`` errors,
which it mostly does not learn to detect in that time.

Files (formats in docs REFERENCE section 2): ``prm_train.jsonl`` / ``prm_dev.jsonl``
(PRM steps and labels), ``pairs_train.jsonl`` / ``pairs_dev.jsonl`` (chosen / rejected full
solutions for outcome reward models, ~10% multi-turn), ``prompts.jsonl`` (PPO prompts with
the reference answer) and ``README.md`` with the counts and label statistics.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

SAMPLE_DIR = Path(__file__).resolve().parent / "sample"
SEED = 20240611
PLACEHOLDER = "ки"  # PRM step placeholder; must never occur inside a step's own text

N_PRM_TRAIN = 6000
N_PRM_DEV = 300
N_PAIRS_TRAIN = 800
N_PAIRS_DEV = 200
N_PROMPTS = 300
N_PROCESSBENCH = 120  # the first prm_dev records in ProcessBench's format
N_BON_GROUPS, N_BON_PER_GROUP = 24, 8  # best-of-N: problems x sampled solutions
P_WRONG = 0.5  # share of PRM solutions that carry an error
P_MULTI_TURN = 0.1  # share of pair records with a two-turn history
MAX_VALUE = 99  # every shown number stays in [0, MAX_VALUE]
# Error mix of the wrong solutions in the pair files.
P_ANSWER_ERROR = 0.15  # final answer does not repeat the last result
P_CARRY_ERROR = 0.3  # of errors at a step whose left operand is an earlier result
# Error mix of the PRM files (see the module docstring): kind -> weight.
PRM_ERROR_MIX = {"echo": 0.75, "result": 0.1, "carry": 0.05, "answer": 0.1}
# prm_train: the first records are drawn before the pair files (which skip their questions), the
# rest after every other file, so that a larger PRM set leaves the pair and prompt files unchanged.
N_PRM_TRAIN_FIRST = 1500


class Ref(NamedTuple):
    """An operand that is the (shown) result of an earlier step."""

    step: int


Operand = int | Ref


@dataclass(frozen=True)
class Step:
    """One computational step. ``text`` has ``{a}``, ``{b}`` and ``{c}`` placeholders that the
    renderer fills with ``{a} op {b} = {c}``-style numbers; see ``_EQ``."""

    text: str
    op: str
    left: Operand
    right: Operand


@dataclass(frozen=True)
class Problem:
    question: str
    steps: tuple[Step, ...]


class Error(NamedTuple):
    """One injected error: ``kind`` is "echo", "result", "carry" or "answer"; ``step`` the
    index of the first wrong step; ``delta`` the offset of the wrong number ("result", "carry",
    "answer"); ``side`` the operand a "carry" error miscopies (0 left, 1 right)."""

    kind: str
    step: int
    delta: int
    side: int = 0


_EQ = "{a} {op} {b} = {c}"
_OPS: dict[str, Callable[[int, int], int | None]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a // b if b and a % b == 0 else None,
}

_MALE = ["Tony", "Sam", "Ben", "Max", "Leo", "Noah", "Jack", "Omar"]
_FEMALE = ["Mia", "Lily", "Ann", "Zoe", "Emma", "Ella", "Ruby", "Nina"]
_BY_KG = [
    "cheese",
    "beef",
    "rice",
    "fish",
    "flour",
    "sugar",
    "tea",
    "coffee",
    "butter",
    "salt",
    "pasta",
    "honey",
]
_THINGS = [
    "pens",
    "books",
    "apples",
    "stickers",
    "marbles",
    "cards",
    "shells",
    "balls",
    "candies",
    "eggs",
    "toys",
]
_VEHICLES = ["car", "bus", "train", "boat", "truck", "bike"]
_FLOWERS = ["roses", "tulips", "daisies", "lilies"]


def _d(rng: random.Random) -> int:
    return rng.randint(1, 9)


def _person(rng: random.Random) -> tuple[str, str, str]:
    """Name, subject pronoun, possessive pronoun."""
    name = rng.choice(_MALE + _FEMALE)
    return (name, "he", "his") if name in _MALE else (name, "she", "her")


def _cap(s: str) -> str:
    return s[0].upper() + s[1:]


# --- problem templates: each returns a Problem; values are checked later by _render ---------


def _shop_one(rng: random.Random) -> Problem:
    name, he, _ = _person(rng)
    a, b, thing = _d(rng), _d(rng), rng.choice(_THINGS)
    q = f"{name} buys {a} {thing} at {b} dollars each. How much does {he} pay?"
    return Problem(q, (Step(f"The {thing} cost {_EQ} dollars.", "*", a, b),))


def _shop_two(rng: random.Random, coupon: bool = False) -> Problem:
    name, he, _ = _person(rng)
    x, y = rng.sample(_BY_KG, 2)
    a, b, c, d = (_d(rng) for _ in range(4))
    q = f"{name} buys {a} kg of {x} at {b} dollars per kg and {c} kg of {y} at {d} dollars per kg."
    steps = [
        Step(f"{_cap(x)} costs {_EQ} dollars.", "*", a, b),
        Step(f"{_cap(y)} costs {_EQ} dollars.", "*", c, d),
        Step(f"In total {he} pays {_EQ} dollars.", "+", Ref(0), Ref(1)),
    ]
    if coupon:
        e = _d(rng)
        q += f" {_cap(he)} uses a coupon worth {e} dollars."
        steps.append(Step(f"With the coupon {he} pays {_EQ} dollars.", "-", Ref(2), e))
    return Problem(q + f" How much does {he} pay?", tuple(steps))


def _gain_lose(rng: random.Random) -> Problem:
    name, he, _ = _person(rng)
    a, b, c, thing = _d(rng), _d(rng), _d(rng), rng.choice(_THINGS)
    q = (
        f"{name} has {a} {thing}. {_cap(he)} gets {b} more and then gives away {c}. "
        f"How many {thing} does {he} have now?"
    )
    return Problem(
        q,
        (
            Step(f"After getting more, {he} has {_EQ} {thing}.", "+", a, b),
            Step(f"After giving some away, {he} has {_EQ} {thing}.", "-", Ref(0), c),
        ),
    )


def _boxes_take(rng: random.Random) -> Problem:
    name, _, _ = _person(rng)
    a, b, c, thing = _d(rng), _d(rng), _d(rng), rng.choice(_THINGS)
    q = f"There are {a} boxes with {b} {thing} in each box. {name} takes {c} {thing}. How many {thing} are left?"
    return Problem(
        q,
        (
            Step(f"The boxes hold {_EQ} {thing}.", "*", a, b),
            Step(f"After {name} takes some, {_EQ} {thing} are left.", "-", Ref(0), c),
        ),
    )


def _share(rng: random.Random) -> Problem:
    name, he, _ = _person(rng)
    a, b, c, thing = _d(rng), _d(rng), rng.randint(2, 9), rng.choice(_THINGS)
    q = (
        f"{name} has {a} bags with {b} {thing} in each bag. {_cap(he)} shares them equally "
        f"among {c} friends. How many {thing} does each friend get?"
    )
    return Problem(
        q,
        (
            Step(f"There are {_EQ} {thing}.", "*", a, b),
            Step(f"Each friend gets {_EQ} {thing}.", "/", Ref(0), c),
        ),
    )


def _travel(rng: random.Random) -> Problem:
    a, b, c, d, v = _d(rng), _d(rng), _d(rng), _d(rng), rng.choice(_VEHICLES)
    q = (
        f"A {v} travels for {a} hours at {b} km per hour and then for {c} hours at {d} km "
        f"per hour. How far does it travel?"
    )
    return Problem(
        q,
        (
            Step(f"First it travels {_EQ} km.", "*", a, b),
            Step(f"Then it travels {_EQ} km.", "*", c, d),
            Step(f"In total it travels {_EQ} km.", "+", Ref(0), Ref(1)),
        ),
    )


def _baker(rng: random.Random) -> Problem:
    a, b, c = _d(rng), _d(rng), _d(rng)
    q = f"A baker bakes {a} trays with {b} cookies on each tray. She sells {c} trays. How many cookies are left?"
    return Problem(
        q,
        (
            Step(f"The baker bakes {_EQ} cookies.", "*", a, b),
            Step(f"She sells {_EQ} cookies.", "*", c, b),
            Step(f"So {_EQ} cookies are left.", "-", Ref(0), Ref(1)),
        ),
    )


def _savings(rng: random.Random) -> Problem:
    name, he, his = _person(rng)
    a, b, c, d = (_d(rng) for _ in range(4))
    q = (
        f"{name} saves {a} dollars a week for {b} weeks. Then {he} spends {c} dollars and "
        f"gets {d} dollars from {his} aunt. How much money does {he} have?"
    )
    return Problem(
        q,
        (
            Step(f"{_cap(he)} saves {_EQ} dollars.", "*", a, b),
            Step(f"After spending, {he} has {_EQ} dollars.", "-", Ref(0), c),
            Step(f"After the gift, {he} has {_EQ} dollars.", "+", Ref(1), d),
        ),
    )


def _garden(rng: random.Random) -> Problem:
    x, y = rng.sample(_FLOWERS, 2)
    a, b, c, d, e = (_d(rng) for _ in range(5))
    q = f"A garden has {a} rows of {b} {x} and {c} rows of {d} {y}. {e} flowers are picked. How many flowers are left?"
    return Problem(
        q,
        (
            Step(f"There are {_EQ} {x}.", "*", a, b),
            Step(f"There are {_EQ} {y}.", "*", c, d),
            Step(f"There are {_EQ} flowers in all.", "+", Ref(0), Ref(1)),
            Step(f"After picking, {_EQ} flowers are left.", "-", Ref(2), e),
        ),
    )


# Solution lengths (with the answer step): 2, 3, 3, 3, 4, 4, 4, 4, 5, 5.
_TEMPLATES: list[Callable[[random.Random], Problem]] = [
    _shop_one,
    _gain_lose,
    _boxes_take,
    _share,
    _shop_two,
    _travel,
    _baker,
    _savings,
    lambda rng: _shop_two(rng, coupon=True),
    _garden,
]

SEED_PROBLEM = Problem(
    "Tony buys 3 kg of cheese at 4 dollars per kg and 2 kg of beef at 5 dollars per kg. How much does he pay?",
    (
        Step("Cheese costs {a} * {b} = {c} dollars.", "*", 3, 4),
        Step("Beef costs {a} * {b} = {c} dollars.", "*", 2, 5),
        Step("In total he pays {a} + {b} = {c} dollars.", "+", Ref(0), Ref(1)),
    ),
)
SEED_ERROR = Error("result", 2, 1)  # "12 + 10 = 23": labels + + - -


def _render(problem: Problem, error: Error | None, prm: bool = False) -> tuple[list[str], list[str], int] | None:
    """Steps, labels and the shown final answer; None if a number leaves [0, MAX_VALUE], a
    division is not exact, or the error would not be visible in the text (``prm``: or a
    "result" error would read as an "echo")."""
    shown: list[int] = []
    texts: list[str] = []
    for i, step in enumerate(problem.steps):
        ab = [shown[x.step] if isinstance(x, Ref) else x for x in (step.left, step.right)]
        if error and error.kind == "carry" and error.step == i:
            if not isinstance((step.left, step.right)[error.side], Ref):
                return None
            ab[error.side] += error.delta
            # The wrong copy must be visibly wrong: no question number, no earlier result.
            if ab[error.side] in _numbers(problem.question) or ab[error.side] in shown:
                return None
        a, b = ab
        c = _OPS[step.op](a, b)
        if c is None:
            return None
        if error and error.kind == "result" and error.step == i:
            c += error.delta
            if prm and c == b:
                return None
        if error and error.kind == "echo" and error.step == i:
            if b == c:  # repeating the operand would be the right result (1 * 4 = 4)
                return None
            c = b
        if not all(0 <= v <= MAX_VALUE for v in (a, b, c)):
            return None
        shown.append(c)
        texts.append(step.text.format(a=a, b=b, c=c, op=step.op))
    answer = shown[-1]
    if error and error.kind == "answer":
        answer += error.delta
        if not 0 <= answer <= MAX_VALUE:
            return None
    texts.append(f"The answer is {answer}.")
    first_bad = error.step if error else len(texts)
    labels = ["+" if i < first_bad else "-" for i in range(len(texts))]
    assert not any(PLACEHOLDER in t for t in texts)
    return texts, labels, answer


def _numbers(text: str) -> set[int]:
    return {int(x) for x in re.findall(r"\d+", text)}


def _random_error(rng: random.Random, problem: Problem) -> Error:
    delta = rng.choice([-3, -2, -1, 1, 2, 3])
    if rng.random() < P_ANSWER_ERROR:
        return Error("answer", len(problem.steps), delta)
    step = rng.randrange(len(problem.steps))
    can_carry = isinstance(problem.steps[step].left, Ref) and problem.steps[step].op != "/"
    kind = "carry" if can_carry and rng.random() < P_CARRY_ERROR else "result"
    return Error(kind, step, delta)


def _solve(rng: random.Random, problem: Problem, wrong: bool) -> tuple[list[str], list[str], int, Error | None] | None:
    """Render a correct solution or one with a random visible error; None if the problem's
    numbers do not work out (the caller draws a new problem)."""
    correct = _render(problem, None)
    if correct is None:
        return None
    if not wrong:
        return (*correct, None)
    for _ in range(20):
        error = _random_error(rng, problem)
        out = _render(problem, error)
        if out is not None:
            return (*out, error)
    return None


def _random_prm_error(rng: random.Random, problem: Problem) -> Error:
    """An error for a PRM solution, its kind drawn by ``PRM_ERROR_MIX``: ``echo`` at any step
    whose second operand is a question number, ``result`` and ``carry`` in the last equation,
    ``answer`` at the answer."""
    kinds, weights = zip(*PRM_ERROR_MIX.items())
    kind = rng.choices(kinds, weights)[0]
    delta = rng.choice([-3, -2, -1, 1, 2, 3])
    last = len(problem.steps) - 1
    operands = (problem.steps[last].left, problem.steps[last].right)
    carried = [side for side, x in enumerate(operands) if isinstance(x, Ref)]
    if kind == "echo":  # at a step whose second operand is a number of the question
        return Error("echo", rng.choice([i for i, st in enumerate(problem.steps) if not isinstance(st.right, Ref)]), 0)
    if kind == "answer":
        return Error("answer", len(problem.steps), delta)
    if kind == "carry" and carried:
        return Error("carry", last, delta, rng.choice(carried))
    return Error("result", last, delta)


def _solve_prm(rng: random.Random, problem: Problem) -> tuple[list[str], list[str], int, Error]:
    """A PRM solution with one visible error drawn by ``_random_prm_error`` (a final answer
    off by one if 20 draws do not work out: +1 or -1 always stays in range)."""
    tries = [_random_prm_error(rng, problem) for _ in range(20)]
    for error in tries + [Error("answer", len(problem.steps), d) for d in (1, -1)]:
        out = _render(problem, error, prm=True)
        if out is not None:
            return (*out, error)
    raise AssertionError("unreachable")


def _draw(rng: random.Random, seen: set[str], wrong: bool) -> tuple[Problem, tuple] | None:
    problem = rng.choice(_TEMPLATES)(rng)
    if problem.question in seen:
        return None
    solved = _solve(rng, problem, wrong)
    if solved is None:
        return None
    return problem, solved


# --- the files -------------------------------------------------------------------------------


def make_prm(
    rng: random.Random, errors_rng: random.Random, n: int, seen: set[str], with_seed: bool
) -> tuple[list[dict], Counter]:
    records, kinds = [], Counter()
    if with_seed:
        steps, labels, _ = _render(SEED_PROBLEM, SEED_ERROR)
        records.append(
            {
                "src": [SEED_PROBLEM.question],
                "tgt": [],
                "responses": steps,
                "labels": labels,
            }
        )
        seen.add(SEED_PROBLEM.question)
        kinds[SEED_ERROR.kind] += 1
    while len(records) < n:
        # ``rng`` draws the questions exactly as the pair files were first made against (an
        # error of the pair mix included); ``errors_rng`` draws the PRM error.
        drawn = _draw(rng, seen, wrong=rng.random() < P_WRONG)
        if drawn is None:
            continue
        problem, (steps, labels, _, error) = drawn
        if error is not None:  # an error of the pair mix: replaced by one of the PRM mix
            steps, labels, _, error = _solve_prm(errors_rng, problem)
        seen.add(problem.question)
        kinds[error.kind if error else "none"] += 1
        records.append({"src": [problem.question], "tgt": [], "responses": steps, "labels": labels})
    return records, kinds


def make_processbench(prm_records: list[dict], n: int) -> list[dict]:
    """``prm_records`` in ProcessBench's format: ``label`` is the index of the first ``-`` step (-1 when
    there is none); the subset, in the ``id`` (``short-3``), is ``short`` for at most three steps and ``long``
    above; two made-up generator names alternate."""
    out = []
    for i, rec in enumerate(prm_records[:n]):
        label = next((j for j, lab in enumerate(rec["labels"]) if lab == "-"), -1)
        subset = "short" if len(rec["responses"]) <= 3 else "long"
        out.append(
            {
                "id": f"{subset}-{i}",
                "generator": ("sampler-a", "sampler-b")[i % 2],
                "problem": rec["src"][0],
                "steps": rec["responses"],
                "final_answer_correct": label == -1,
                "label": label,
            }
        )
    return out


def make_best_of_n(rng: random.Random, groups: int, per_group: int, seen: set[str]) -> list[dict]:
    """``groups`` problems with ``per_group`` sampled solutions each, every one right or wrong at random
    (an error of the PRM mix), as unlabelled PaddleNLP PRM records with ``group``, ``answer`` (the shown
    final answer) and ``correct`` (that answer equals the right one)."""
    out: list[dict] = []
    while len(out) < groups * per_group:
        problem = rng.choice(_TEMPLATES)(rng)
        right = _render(problem, None)
        if problem.question in seen or right is None:
            continue
        group = []
        for _ in range(per_group * 20):
            # wrong ones with an error of the PRM mix, the kind the tiny demo PRM learns to spot
            steps, _, answer = _solve_prm(rng, problem)[:3] if rng.random() < 0.5 else right
            group.append({"responses": steps, "answer": str(answer), "correct": answer == right[2]})
            if len(group) == per_group:
                break
        if len(group) < per_group:
            continue
        seen.add(problem.question)
        k = len(out) // per_group
        out += [{"src": [problem.question], "tgt": [], "group": f"problem-{k}", **c} for c in group]
    return out


def _follow_up(rng: random.Random, previous: int) -> Problem:
    """A second turn that builds on the first answer, e.g. "Now add 4 to your answer."."""
    e = _d(rng)
    if rng.random() < 0.5:
        return Problem(
            f"Now add {e} to your answer. What do you get?",
            (Step(f"Adding gives {_EQ}.", "+", previous, e),),
        )
    return Problem(
        f"Now take {e} away from your answer. What is left?",
        (Step(f"Taking away gives {_EQ}.", "-", previous, e),),
    )


def make_pairs(rng: random.Random, n: int, seen: set[str]) -> list[dict]:
    records = []
    while len(records) < n:
        drawn = _draw(rng, seen, wrong=False)
        if drawn is None:
            continue
        problem, (good, _, answer, _) = drawn
        src, tgt = [problem.question], []
        if rng.random() < P_MULTI_TURN:
            second = _follow_up(rng, answer)
            solved = _solve(rng, second, wrong=False)
            if solved is None:
                continue
            src, tgt = [problem.question, second.question], ["\n".join(good)]
            problem, good = second, solved[0]
        bad = _solve(rng, problem, wrong=True)
        if bad is None:
            continue
        seen.add(src[0])
        chosen_first = rng.random() < 0.5
        response = ["\n".join(good), "\n".join(bad[0])]
        records.append(
            {
                "src": src,
                "tgt": tgt,
                "response": response if chosen_first else response[::-1],
                "sort": [1, 0] if chosen_first else [0, 1],
            }
        )
    return records


def make_prompts(rng: random.Random, n: int, seen: set[str]) -> list[dict]:
    records = []
    while len(records) < n:
        drawn = _draw(rng, seen, wrong=False)
        if drawn is None:
            continue
        problem, (_, _, answer, _) = drawn
        seen.add(problem.question)
        records.append({"src": problem.question, "tgt": str(answer)})
    return records


def _label_stats(records: list[dict]) -> tuple[int, float]:
    labels = [lab for r in records for lab in r["labels"]]
    return len(labels), labels.count("-") / len(labels)


def _readme(files: dict[str, list[dict]], kinds: dict[str, Counter]) -> str:
    n_steps = {name: _label_stats(files[name]) for name in ("prm_train", "prm_dev")}
    dev_minus = n_steps["prm_dev"][1]
    majority = "-" if dev_minus > 0.5 else "+"
    lengths = Counter(len(r["responses"]) for r in files["prm_train"])
    multi = {name: sum(len(r["src"]) > 1 for r in files[name]) for name in ("pairs_train", "pairs_dev")}
    lines = [
        "# Sample data",
        "",
        "Small arithmetic word-problem data sets for tests, smoke runs and tiny CPU training.",
        "Generated by `python -m llm.data.make_sample_data` (standard library only, fixed seed",
        f"{SEED}; byte-identical on every run). Do not edit by hand: change the generator and",
        "re-run it, then re-run `python -m llm.utils.tokenizer_assets` for the tiny tokenizer.",
        "",
        "Question operands are 1-9 and every shown number is 0-99. A solution is 2-5 steps:",
        "equations such as `Cheese costs 3 * 4 = 12 dollars.` and a last step",
        "`The answer is 22.`. A wrong solution has one error and then follows the wrong value:",
        "`echo` (the result just repeats the number before `=`: `3 * 4 = 4`), `result` (a result",
        "off by 1-3), `carry` (an earlier result copied wrongly) or `answer` (a final answer that",
        "does not repeat the last result). Dev questions never occur in any train file.",
        "",
        "| file | records | format |",
        "|---|---|---|",
        f"| `prm_train.jsonl` | {len(files['prm_train'])} | PRM: `{{src: [q], tgt: [], responses: [steps], labels: [+/-]}}` |",
        f"| `prm_dev.jsonl` | {len(files['prm_dev'])} | same, disjoint questions |",
        f"| `pairs_train.jsonl` | {len(files['pairs_train'])} ({multi['pairs_train']} two-turn) | ORM/DPO pairs: `{{src, tgt, response: [r0, r1], sort: [s0, s1]}}` |",
        f"| `pairs_dev.jsonl` | {len(files['pairs_dev'])} ({multi['pairs_dev']} two-turn) | same, disjoint questions |",
        f"| `prompts.jsonl` | {len(files['prompts'])} | PPO prompts: `{{src: q, tgt: answer}}` |",
        (
            f"| `processbench_dev.jsonl` | {len(files['processbench_dev'])} | the first `prm_dev` records in ProcessBench's "
            "format: `{id: short-3 / long-7, generator, problem, steps, label: first wrong step or -1, "
            "final_answer_correct}` |"
        ),
        (
            f"| `bon_dev.jsonl` | {len(files['bon_dev'])} ({N_BON_GROUPS} problems x {N_BON_PER_GROUP}) | best-of-N "
            "candidates, unlabelled PRM records with `group`, `answer`, `correct` |"
        ),
        "",
        "PRM labels: a step is `+` if its arithmetic is right and every earlier step was right;",
        "the first wrong step and every later step are `-`. Record 0 of `prm_train.jsonl` is the",
        "seed example (Tony, cheese and beef; labels `+ + - -`). About half of the PRM solutions",
        "carry an error, mostly `echo` errors (at any step), the others `result` and `carry`",
        "errors in the last equation and `answer` errors: spotting an echo is a comparison of two",
        "nearby numbers, which the tiny CPU demo model (`llm/config/tiny/prm_argument.json`)",
        "learns in minutes; multiplication tables and comparisons across steps take it far longer.",
        f"Error kinds in `prm_train`: {_fmt_counter(kinds['prm_train'])};",
        f"in `prm_dev`: {_fmt_counter(kinds['prm_dev'])}.",
        "(The wrong solutions of the pair files have `result` errors at any step, `carry` and",
        "`answer` errors.)",
        "",
        "| file | steps | fraction of `-` steps |",
        "|---|---|---|",
        *(f"| `{name}.jsonl` | {n} | {frac:.3f} |" for name, (n, frac) in n_steps.items()),
        "",
        f"Majority-class baseline on `prm_dev` (always `{majority}`): step accuracy "
        + f"{max(dev_minus, 1 - dev_minus):.3f},",
        f"solution accuracy (every step of a solution right) {_all_same(files['prm_dev'], majority):.3f}.",
        f"Steps per solution in `prm_train`: {_fmt_counter(lengths)}.",
        "",
        "Pairs: the higher `sort` marks the correct full solution (steps joined with a newline);",
        "which index is chosen is random. Two-turn records hold `src[0], tgt[0], src[1]` in",
        "order, and the responses answer `src[1]`, a follow-up on the first answer.",
        "",
    ]
    return "\n".join(lines)


def _all_same(records: list[dict], label: str) -> float:
    """Share of the solutions whose every step is labelled ``label``."""
    return sum(all(lab == label for lab in r["labels"]) for r in records) / len(records)


def _fmt_counter(counter: Counter) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(counter.items()))


def generate(out_dir: Path) -> dict[str, list[dict]]:
    """Write all sample files into ``out_dir``; return the records by file stem."""
    train_seen: set[str] = set()
    kinds: dict[str, Counter] = {}
    files: dict[str, list[dict]] = {}
    # One random stream per file, so changing one file's count leaves the others unchanged
    # (string seeds hash with SHA-512: stable across runs and Python versions).
    files["prm_train"], kinds["prm_train"] = make_prm(
        random.Random(f"{SEED}-prm_train"),
        random.Random(f"{SEED}-prm_train-errors"),
        N_PRM_TRAIN_FIRST,
        train_seen,
        with_seed=True,
    )
    files["pairs_train"] = make_pairs(random.Random(f"{SEED}-pairs_train"), N_PAIRS_TRAIN, train_seen)
    files["prompts"] = make_prompts(random.Random(f"{SEED}-prompts"), N_PROMPTS, train_seen)
    # Dev questions must not occur in any train file; dev files dedupe among themselves too.
    dev_seen = set(train_seen)
    files["prm_dev"], kinds["prm_dev"] = make_prm(
        random.Random(f"{SEED}-prm_dev"),
        random.Random(f"{SEED}-prm_dev-errors"),
        N_PRM_DEV,
        dev_seen,
        with_seed=False,
    )
    files["pairs_dev"] = make_pairs(random.Random(f"{SEED}-pairs_dev"), N_PAIRS_DEV, dev_seen)
    # The rest of prm_train: questions of no file above (dev_seen holds them all).
    more, more_kinds = make_prm(
        random.Random(f"{SEED}-prm_train-more"),
        random.Random(f"{SEED}-prm_train-more-errors"),
        N_PRM_TRAIN - N_PRM_TRAIN_FIRST,
        dev_seen,
        with_seed=False,
    )
    files["prm_train"] += more
    kinds["prm_train"] += more_kinds
    # Evaluation-only files (issue: PRM evaluation): ProcessBench's format, and best-of-N candidate groups.
    files["processbench_dev"] = make_processbench(files["prm_dev"], N_PROCESSBENCH)
    files["bon_dev"] = make_best_of_n(random.Random(f"{SEED}-bon_dev"), N_BON_GROUPS, N_BON_PER_GROUP, dev_seen)

    out_dir.mkdir(parents=True, exist_ok=True)
    for name, records in files.items():
        with open(out_dir / f"{name}.jsonl", "w", encoding="utf-8", newline="\n") as f:
            f.writelines(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records)
    (out_dir / "README.md").write_text(_readme(files, kinds), encoding="utf-8", newline="\n")
    return files


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=SAMPLE_DIR, help="where to write the files")
    args = parser.parse_args(argv)
    files = generate(args.out_dir)
    for name, records in files.items():
        print(f"{args.out_dir / name}.jsonl: {len(records)} records")


if __name__ == "__main__":
    main()
