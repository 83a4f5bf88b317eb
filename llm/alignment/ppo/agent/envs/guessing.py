"""The guessing game, a stateful multi-turn task: the environment holds a secret integer in ``[low, high]``; the
model guesses, hears "higher" or "lower", and guesses again until it is right or its guesses run out. Prompt
records: ``llm/data/make_guessing.py``."""

from __future__ import annotations

import random
import re

from llm.alignment.ppo.agent.envs.task import task_text
from llm.utils.errors import UserError

_INTEGER = re.compile(r"(?<![\w.])-?\d+(?![\d.]*\d)")  # not part of a word or a decimal; "1-100": 1, 100


def last_integer(text: str) -> int | None:
    """The last integer written in ``text`` ("I guess 40, no, 42." -> 42; "-7" -> -7); a decimal such as 4.5 is no
    integer (None when there is none)."""
    found = _INTEGER.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


def _int_field(task: dict, field: str, default: int | None) -> int | None:
    value = task.get(field, default)
    if value is None:
        return None
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"the task record {str(task)[:120]}: '{field}' must be an integer, got {value!r}")
    return value


class GuessingGame:
    """The task record: ``src`` (the first user message: the rules and the range), ``low`` and ``high`` (the
    range, inclusive; else the ``low`` / ``high`` given here; none: no range check), and the secret: ``secret``,
    else ``tgt``, else drawn from the range with ``random.Random(seed)`` for the record's ``seed``.

    A step reads the model's guess as the last integer of its reply (``last_integer``). Right: reward
    ``turn_discount ** (guesses - 1)`` (1.0 for a first-guess hit; ``turn_discount`` < 1 pays fewer guesses more)
    and the episode is done. Wrong: reward 0 and the feedback ``"<guess> is too low: the number is higher. Guess
    again (k guesses left)."`` (or too high, "lower"); a reply without an integer or outside the range counts as
    a guess and is told so. After ``max_guesses`` guesses the episode is done (reward 0), with no message."""

    def __init__(
        self, max_guesses: int = 7, turn_discount: float = 1.0, low: int | None = None, high: int | None = None
    ) -> None:
        if max_guesses < 1 or not 0 < turn_discount <= 1 or (low is not None and high is not None and low > high):
            raise UserError(
                f"GuessingGame(max_guesses={max_guesses}, turn_discount={turn_discount}, low={low}, high={high}): "
                "max_guesses must be >= 1, turn_discount in (0, 1], low <= high"
            )
        self.max_guesses, self.turn_discount, self.default_range = max_guesses, float(turn_discount), (low, high)
        self.secret: int | None = None
        self.guesses = 0

    def reset(self, task: dict) -> str:
        message = task_text(task, "src")
        low = _int_field(task, "low", self.default_range[0])
        high = _int_field(task, "high", self.default_range[1])
        secret = _int_field(task, "secret", None)
        if secret is None and task.get("tgt") is not None:
            secret = _int_field(task, "tgt", None)
        if secret is None:
            seed = _int_field(task, "seed", None)
            if seed is None:
                raise UserError(
                    f"the task record {str(task)[:120]} has no secret: give it 'secret', 'tgt' or a 'seed' to draw it"
                )
            if low is None or high is None:
                raise UserError(
                    f"the task record {str(task)[:120]}: drawing the secret from 'seed' needs 'low' and 'high'"
                )
            secret = random.Random(seed).randint(low, high)
        if low is not None and high is not None and not low <= secret <= high:
            raise UserError(f"the task record {str(task)[:120]}: the secret {secret} is outside [{low}, {high}]")
        self.low, self.high, self.secret, self.guesses = low, high, secret, 0
        return message

    def step(self, action: str) -> tuple[str | None, float, bool]:
        if self.secret is None:
            raise RuntimeError("GuessingGame.step before reset")
        self.guesses += 1
        guess = last_integer(action)
        if guess == self.secret:
            return None, self.turn_discount ** (self.guesses - 1), True
        if self.guesses >= self.max_guesses:
            return None, 0.0, True
        left = self.max_guesses - self.guesses
        again = f"Guess again ({left} guess{'es' if left > 1 else ''} left)."
        ranged = self.low is not None and self.high is not None
        if guess is None:
            within = f" from {self.low} to {self.high}" if ranged else ""
            return f"I found no number in your reply: answer with one integer{within}. {again}", 0.0, False
        if ranged and not self.low <= guess <= self.high:
            return f"{guess} is outside the range: the number is from {self.low} to {self.high}. {again}", 0.0, False
        if guess < self.secret:
            return f"{guess} is too low: the number is higher. {again}", 0.0, False
        return f"{guess} is too high: the number is lower. {again}", 0.0, False
