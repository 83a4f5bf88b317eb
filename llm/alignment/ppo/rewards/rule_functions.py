"""Rule rewards: ``reward.rule = "module:function"``, called as ``function(prompt, response, reference)``."""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> str | None:
    """The last number in ``text`` ("The answer is 22." -> "22"), normalised ("22.0" -> "22")."""
    found = _NUMBER.findall(text.replace(",", ""))
    if not found:
        return None
    value = float(found[-1])
    return str(int(value)) if value.is_integer() else str(value)


def math_exact_match(prompt: str, response: str, reference: str | None) -> float:
    """1.0 when the last number of the response equals the reference answer, else 0.0."""
    if reference is None:
        raise ValueError("math_exact_match needs a reference answer (the prompt record's tgt)")
    expected = last_number(reference)
    return float(expected is not None and last_number(response) == expected)


def digit_fraction(prompt: str, response: str, reference: str | None) -> float:
    """Toy shaping reward: the fraction of response characters that are digits. The tiny CPU demo
    uses it because a randomly initialised policy never produces a correct answer to learn from."""
    text = response.strip()
    return sum(ch.isdigit() for ch in text) / len(text) if text else 0.0
