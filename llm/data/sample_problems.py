"""The arithmetic word problems behind the bundled sample data, and their right and wrong solutions.

``llm.data.make_sample_data`` (and ``make_sft_data``) draw problems from ``TEMPLATES`` and render them with
``render_problem`` / ``solve`` / ``solve_prm``; the error kinds and their mix are described in that module's
docstring. Standard library only, every draw from the ``random.Random`` passed in.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

PLACEHOLDER = "ки"  # PRM step placeholder; must never occur inside a step's own text
MAX_VALUE = 99  # every shown number stays in [0, MAX_VALUE]
# Error mix of the wrong solutions in the pair files.
P_ANSWER_ERROR = 0.15  # final answer does not repeat the last result
P_CARRY_ERROR = 0.3  # of errors at a step whose left operand is an earlier result
# Error mix of the PRM files (see the module docstring): kind -> weight.
PRM_ERROR_MIX = {"echo": 0.75, "result": 0.1, "carry": 0.05, "answer": 0.1}


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


# --- problem templates: each returns a Problem; values are checked later by render_problem ---------


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
TEMPLATES: list[Callable[[random.Random], Problem]] = [
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


def render_problem(problem: Problem, error: Error | None, prm: bool = False) -> tuple[list[str], list[str], int] | None:
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


def solve(rng: random.Random, problem: Problem, wrong: bool) -> tuple[list[str], list[str], int, Error | None] | None:
    """Render a correct solution or one with a random visible error; None if the problem's
    numbers do not work out (the caller draws a new problem)."""
    correct = render_problem(problem, None)
    if correct is None:
        return None
    if not wrong:
        return (*correct, None)
    for _ in range(20):
        error = _random_error(rng, problem)
        out = render_problem(problem, error)
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


def solve_prm(rng: random.Random, problem: Problem) -> tuple[list[str], list[str], int, Error]:
    """A PRM solution with one visible error drawn by ``_random_prm_error`` (a final answer
    off by one if 20 draws do not work out: +1 or -1 always stays in range)."""
    tries = [_random_prm_error(rng, problem) for _ in range(20)]
    for error in tries + [Error("answer", len(problem.steps), d) for d in (1, -1)]:
        out = render_problem(problem, error, prm=True)
        if out is not None:
            return (*out, error)
    raise AssertionError("unreachable")


def draw_problem(rng: random.Random, seen: set[str], wrong: bool) -> tuple[Problem, tuple] | None:
    problem = rng.choice(TEMPLATES)(rng)
    if problem.question in seen:
        return None
    solved = solve(rng, problem, wrong)
    if solved is None:
        return None
    return problem, solved


def follow_up(rng: random.Random, previous: int) -> Problem:
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
