"""Monte Carlo step labels, as pure functions over an ``estimate`` callable (no model, no torch).

``estimate(i)`` is the Monte Carlo value of the prefix made of the first ``i + 1`` steps of a solution: the
fraction of completions from that prefix whose final answer is right (MC(s) = right completions / k, OmegaPRM's
notation; Math-Shepherd's soft estimate). Each call costs one batch of completions, so the functions call it only
where they need a value, and ``known`` gives values already known for free (the last step of a solution whose own
final answer was checked: 1.0 or 0.0).

- Math-Shepherd (Wang et al. 2023, arXiv 2312.08935): every step is estimated; its hard label is ``+`` when any
  completion reaches the answer (MC > 0), its soft label the fraction itself. M estimates for M steps.
- OmegaPRM (Luo et al. 2024, arXiv 2406.06592): on a solution whose answer is wrong, a binary search for the first
  step whose prefix has MC = 0. MC(mid) = 0 puts the first error at or before ``mid`` (search left), MC(mid) > 0 after
  it (search right); steps before it are ``+``, it and every later step ``-``. About log2(M + 1) estimates.
- Consensus (Zhang et al. 2025, "The Lessons of Developing Process Reward Models in Mathematical Reasoning"): keep a
  labelled solution only where the Monte Carlo first error and a judge's first error agree.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

Estimate = Callable[[int], float]  # step index i -> MC value of the prefix steps[: i + 1], in [0, 1]

NO_ERROR = -1  # a first-error index meaning "every step is right" (ProcessBench's convention)


@dataclass(frozen=True)
class StepLabels:
    """One solution's labels: ``hard[i]`` True for ``+``; ``soft[i]`` the MC value of the prefix ending at step
    ``i`` where one was estimated or known, else None; ``estimates``: calls of ``estimate`` made (each a batch of
    completions); ``first_error``: the first ``-`` step, or ``NO_ERROR``."""

    hard: list[bool]
    soft: list[float | None]
    estimates: int

    @property
    def first_error(self) -> int:
        return next((i for i, right in enumerate(self.hard) if not right), NO_ERROR)


def _value(i: int, estimate: Estimate, known: Mapping[int, float]) -> tuple[float, int]:
    """MC value of prefix ``i`` and the estimates it cost (0 when known)."""
    if i in known:
        return known[i], 0
    value = estimate(i)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"estimate({i}) returned {value}, outside [0, 1]")
    return value, 1


def math_shepherd(n_steps: int, estimate: Estimate, known: Mapping[int, float] | None = None) -> StepLabels:
    """Math-Shepherd's estimates of every step: hard = (MC > 0), soft = MC. Each step is labelled on its own, so a
    step may be ``+`` after a ``-`` one (a completion recovered from the earlier mistake)."""
    known = known or {}
    soft, cost = [], 0
    for i in range(n_steps):
        value, spent = _value(i, estimate, known)
        soft.append(value)
        cost += spent
    return StepLabels([v > 0 for v in soft], list(soft), cost)


def first_error_search(n_steps: int, estimate: Estimate, known: Mapping[int, float] | None = None) -> StepLabels:
    """OmegaPRM's binary search for the first step whose prefix has MC = 0, assuming MC stays 0 once a prefix holds
    a wrong step: the search keeps ``lo <= first error <= hi`` (``hi == n_steps``: no error) and halves it with
    one estimate at ``mid``, so at most ceil(log2(n_steps + 1)) estimates (fewer when ``known`` answers one).
    Steps before the first error are ``+``, it and the later steps ``-``; ``soft`` holds the values looked at."""
    known = known or {}
    soft: list[float | None] = [None] * n_steps
    lo, hi, cost = 0, n_steps, 0
    while lo < hi:
        mid = (lo + hi) // 2
        value, spent = _value(mid, estimate, known)
        soft[mid], cost = value, cost + spent
        if value == 0:
            hi = mid
        else:
            lo = mid + 1
    for i, value in known.items():  # values known for free are labels too (the checked last step)
        if 0 <= i < n_steps and soft[i] is None:
            soft[i] = value
    return StepLabels([i < lo for i in range(n_steps)], soft, cost)


def agrees(labels: StepLabels, judge_first_error: int | None) -> bool:
    """Qwen's consensus filter: the judge names the same first wrong step (or ``NO_ERROR`` for none) as the Monte
    Carlo labels; a judge that gave no answer (None) never agrees."""
    return judge_first_error is not None and judge_first_error == labels.first_error
