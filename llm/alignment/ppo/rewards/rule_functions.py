"""Rule rewards: ``reward.rule = "module:function"``, called as ``function(prompt, response, reference)``."""

from __future__ import annotations

import logging
import re
import threading

from llm.utils.errors import UserError

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


def math_verify(prompt: str, response: str, reference: str | None) -> float:
    """1.0 when Hugging Face's math-verify (the checker of TRL's accuracy reward) finds the response's answer
    mathematically equal to the reference, else 0.0: LaTeX or plain text (``\\boxed{}`` first), so ``0.5``,
    ``1/2`` and ``\\frac{1}{2}`` agree, as do equal sets, intervals and expressions. Both sides are read with
    math-verify's default extraction (TRL's accuracy reward reads the response as LaTeX only). Needs the
    math-verify package (``pip install math-verify==0.9.0``), imported on first use. A reference math-verify
    cannot read is an error, not a zero."""
    if reference is None:
        raise ValueError("math_verify needs a reference answer (the prompt record's tgt)")
    try:
        from math_verify import parse, verify
    except ImportError:
        raise UserError("the rule math_verify needs the math-verify package: pip install math-verify==0.9.0") from None
    # math-verify bounds its parsing with signal.alarm, which only the main thread may set: elsewhere, no bound
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    if timeout is None:
        for name in ("math_verify.parser", "math_verify.grader"):  # each call would warn that it has no timeout
            logging.getLogger(name).setLevel(logging.ERROR)
    gold = parse(reference, parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"math_verify cannot read the reference answer {reference[:80]!r}; give a number or LaTeX")
    return float(verify(gold, parse(response, parsing_timeout=timeout), timeout_seconds=timeout))


def no_reward(prompt: str, response: str, reference: str | None) -> float:
    """0.0 for every response: the rule of a run whose reward is the environment's alone (``environment``)."""
    return 0.0
