"""OmegaPRM's tree search (Luo et al. 2024, arXiv 2406.06592; openr ``data/omegaPRM_v2/omegaprm.py``), pure Python
over a ``rollouts`` callable: which wrong rollout to binary-search next, and what each search labels.

A state is a solution prefix (the question alone at the root). Its Monte Carlo value MC(s) comes from k rollouts
(completions) from it. A rollout whose answer is wrong, from a state with 0 < MC(s) < 1, enters the candidate pool;
the search pops the candidate with the highest

    Q(s, r) + U(s),   Q(s, r) = alpha ** (1 - MC(s)) * beta ** (len(r) / L),   U(s) = c_puct * sqrt(sum N) / (1 + N(s))

(len(r): the rollout's words; N(s): rollouts batches made from s), binary-searches the rollout's steps for the
first one whose prefix has MC = 0 (each estimate is a new state with its own k rollouts, whose wrong ones join the
pool), and re-scores the pool entries of the popped state. It stops after ``max_search_count`` searches, when
``rollout_budget`` rollouts are spent, or when the pool is empty. openr's defaults: alpha 0.5, beta 0.9, L 500,
k 16, c_puct 0.125.

Labelled solutions out: each searched rollout, as its state's steps followed by its own steps (the first error
found and every later step ``-``, earlier steps ``+``), and each right rollout of the root (every step ``+``).
``soft`` holds the MC value of every prefix that is a state on the path (None elsewhere). Unlike openr, the last
step of a wrong rollout is known to be wrong (its answer was checked) and is not estimated again.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from llm.alignment.label.mc import StepLabels, first_error_search


@dataclass(frozen=True)
class Rollout:
    """One completion from a state, split into steps, and whether its final answer is right."""

    steps: list[str]
    correct: bool


Rollouts = Callable[[list[str], int], list[Rollout]]  # (prefix steps, k) -> k rollouts from that prefix


@dataclass(frozen=True)
class OmegaSettings:
    k: int = 16  # rollouts per Monte Carlo estimate
    alpha: float = 0.5
    beta: float = 0.9
    length_scale: float = 500.0  # L
    c_puct: float = 0.125
    max_search_count: int = 20  # N: binary searches
    rollout_budget: int = 200


@dataclass(eq=False)
class State:
    steps: list[str]  # the prefix from the question
    parent: State | None
    mc: float = 0.0
    visits: int = 0  # N(s)
    wrong: list[Rollout] = field(default_factory=list)


@dataclass(frozen=True)
class Searched:
    """A labelled solution the search produced."""

    steps: list[str]
    labels: StepLabels


class OmegaSearch:
    """One problem's search; ``run()`` returns the labelled solutions and ``rollouts_made`` counts the cost."""

    def __init__(self, rollouts: Rollouts, settings: OmegaSettings) -> None:
        self.rollouts, self.s = rollouts, settings
        self.states: list[State] = []
        self.pool: list[tuple[float, int, State, int]] = []  # (-score, tie, state, index into state.wrong)
        self.latest: dict[tuple[int, int], int] = {}  # (state id, rollout index) -> tie of its live pool entry
        self.tie = itertools.count()
        self.rollouts_made = 0
        self.estimates = 0

    # --- the Monte Carlo estimate of a state ----------------------------------------------------------------
    def estimate(self, state: State) -> list[Rollout]:
        batch = self.rollouts(state.steps, self.s.k)
        self.rollouts_made += len(batch)
        self.estimates += 1
        state.visits += 1
        state.mc = sum(r.correct for r in batch) / max(len(batch), 1)
        self.states.append(state)
        if 0 < state.mc < 1:  # an all-right or all-wrong state has nothing to search
            for r in batch:
                if not r.correct and r.steps:  # an empty rollout has no step to search
                    state.wrong.append(r)
                    self.push(state, len(state.wrong) - 1)
        return batch

    def score(self, state: State, rollout: Rollout) -> float:
        q = self.s.alpha ** (1 - state.mc) * self.s.beta ** (len(" ".join(rollout.steps).split()) / self.s.length_scale)
        total = sum(s.visits for s in self.states) or 1
        return q + self.s.c_puct * math.sqrt(total) / (1 + state.visits)

    def push(self, state: State, index: int) -> None:
        tie = next(self.tie)
        self.latest[id(state), index] = tie
        heapq.heappush(self.pool, (-self.score(state, state.wrong[index]), tie, state, index))

    def pop(self) -> tuple[State, Rollout] | None:
        while self.pool:
            _, tie, state, index = heapq.heappop(self.pool)
            if self.latest.get((id(state), index)) == tie:  # else an entry re-scored since
                del self.latest[id(state), index]
                return state, state.wrong[index]
        return None

    # --- the search -------------------------------------------------------------------------------------
    def run(self) -> list[Searched]:
        root = State([], None)
        out = [
            Searched(r.steps, StepLabels([True] * len(r.steps), [None] * (len(r.steps) - 1) + [1.0], 0))
            for r in self.estimate(root)
            if r.correct and r.steps
        ]
        searches = 0
        while searches < self.s.max_search_count and self.rollouts_made < self.s.rollout_budget:
            picked = self.pop()
            if picked is None:
                break
            state, rollout = picked
            out.append(self.search(state, rollout))
            for index in range(len(state.wrong)):  # maintenance: U(s) changed with N
                if (id(state), index) in self.latest:
                    self.push(state, index)
            searches += 1
        return out

    def search(self, state: State, rollout: Rollout) -> Searched:
        """Binary search of ``rollout`` (wrong) from ``state``: every estimate is a new state of its own."""
        base = len(state.steps)
        made: dict[int, State] = {}

        def estimate(i: int) -> float:
            parent = max((made[j] for j in made if j < i), key=lambda s: len(s.steps), default=state)
            child = State(state.steps + rollout.steps[: i + 1], parent)
            self.estimate(child)
            made[i] = child
            return child.mc

        found = first_error_search(len(rollout.steps), estimate, {len(rollout.steps) - 1: 0.0})
        soft: list[float | None] = [None] * base + found.soft
        node: State | None = state
        while node is not None and node.steps:  # the MC values of the states on the path to ``state``
            soft[len(node.steps) - 1] = node.mc
            node = node.parent
        labels = StepLabels([True] * base + found.hard, soft, found.estimates)
        return Searched(state.steps + rollout.steps, labels)
