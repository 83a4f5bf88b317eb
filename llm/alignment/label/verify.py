"""Checking solutions: the verifier (a rule reward, ``module:function``) and the judges of the consensus filter.

The verifier is any of PPO's rule rewards (``llm.alignment.ppo.rewards.rule_functions``: ``math_exact_match``,
``math_verify``, or a function of the user's), called as ``function(question, solution, reference) -> float``; a
score of 0.5 or more reaches the answer. A judge names the first wrong step of a solution: a function
``function(question, steps, reference) -> int | None``, or a model asked ProcessBench's critique prompt (Zheng et al.
2024, the judge of Qwen's consensus filter) whose ``\\boxed{index}`` is read.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable
from typing import Any

from llm.alignment.label.completer import Completer, Prefix
from llm.utils.errors import UserError

REACHES = 0.5  # a verifier score at or above it counts as a right final answer

# ProcessBench's critique template (Qwen/ProcessBench, code/run_eval.py), the judge prompt of Qwen's consensus
CRITIQUE_TEMPLATE = (
    "The following is a math problem and a solution (split into paragraphs, enclosed with tags and indexed from 0):"
    "\n\n[Math Problem]\n\n{problem}\n\n[Solution]\n\n{tagged_response}\n\n"
    "Your task is to review and critique the solution paragraph by paragraph. Once you identify an error in a "
    "paragraph, return the index of the paragraph where the earliest error occurs. Otherwise, return the index of -1 "
    '(which typically denotes "not found").\n\nPlease put your final answer (i.e., the index) in \\boxed{{}}.'
)
_BOXED = re.compile(r"\\boxed\{\s*(-?\d+)\s*\}")


def load_function(spec: str, field: str) -> Callable[..., Any]:
    """The function ``module:function`` names (imported in this process: code the user trusts)."""
    module_name, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise UserError(f"{field} {spec!r}: cannot import ({err}); use 'package.module:function'") from None
    except BaseException as err:  # noqa: BLE001 - the module's own code failed while it was imported
        raise UserError(f"{field} {spec!r}: importing {module_name} raised {type(err).__name__}: {err}") from None
    if not callable(fn):
        raise UserError(f"{field} {spec!r}: {name} is not a function")
    return fn


class Verifier:
    def __init__(self, spec: str) -> None:
        self.spec, self.fn = spec, load_function(spec, "verifier")

    def __call__(self, question: str, solution: str, reference: str, where: str) -> bool:
        """Whether ``solution`` reaches ``reference``; anything the function raises, or a score that is not a
        finite number, stops the run naming ``where`` (the problem's file and record)."""
        try:
            value = self.fn(question, solution, reference)
        except BaseException as err:  # noqa: BLE001 - user code: SystemExit and KeyboardInterrupt included
            raise UserError(
                f"{where}, field 'verifier': {self.spec} raised {type(err).__name__}: {err} (solution "
                f"{solution[-80:]!r}); nothing of this problem was written. Fix: fix the function, or choose another "
                "verifier"
            ) from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UserError(
                f"{where}, field 'verifier': {self.spec} returned {value!r}, not a finite number. Fix: return a "
                "score (1.0 right, 0.0 wrong)"
            )
        return value >= REACHES


def _checked_index(value: Any, n_steps: int, spec: str, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not -1 <= value < n_steps:
        raise UserError(
            f"{where}, field 'judge': {spec} returned {value!r}; a judge returns the index of the first wrong step "
            f"(0 to {n_steps - 1}), -1 for none, or None for no answer"
        )
    return value


class FunctionJudge:
    def __init__(self, spec: str) -> None:
        self.spec, self.fn = spec, load_function(spec, "judge")

    def __call__(self, question: str, steps: list[str], reference: str, where: str, seed: int) -> int | None:
        try:
            value = self.fn(question, steps, reference)
        except BaseException as err:  # noqa: BLE001 - user code
            raise UserError(f"{where}, field 'judge': {self.spec} raised {type(err).__name__}: {err}") from None
        return _checked_index(value, len(steps), self.spec, where)


def critique_prompt(question: str, steps: list[str]) -> str:
    tagged = "\n\n".join(f"<paragraph_{i}>\n{step}\n</paragraph_{i}>" for i, step in enumerate(steps))
    return CRITIQUE_TEMPLATE.format(problem=question, tagged_response=tagged)


def read_verdict(text: str, n_steps: int) -> int | None:
    """The judge's last ``\\boxed{index}``; None when there is none or it names no step."""
    found = _BOXED.findall(text)
    if not found:
        return None
    index = int(found[-1])
    return index if -1 <= index < n_steps else None


class ModelJudge:
    """A judge model asked ``critique_prompt`` once per solution; its ``Completer`` decodes greedily."""

    def __init__(self, completer: Completer) -> None:
        self.completer = completer

    def __call__(self, question: str, steps: list[str], reference: str, where: str, seed: int) -> int | None:
        prompt = [{"role": "user", "content": critique_prompt(question, steps)}]
        (critique,) = self.completer.complete([Prefix(prompt, [])], 1, seed)[0]
        return read_verdict(critique.text, len(steps))
