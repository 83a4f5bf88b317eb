"""PRM-guided search as pure functions of two callables: ``expand`` (the policy) and ``score`` (the PRM).

Semantics of Hugging Face's search-and-learn (``src/sal/search/``), with budget N and beam width M:

- ``beam_search``: N generations per step. Every problem starts from N empty beams; each round the live beams
  are repeated to fill N slots (k beams, in order, again and again: the first ``N mod k`` get one slot more;
  the children are then taken in this slot order, which orders ties and the completed list), each slot samples
  one step,
  every new partial solution is scored and a finished one (EOS, the token budget, or the last round) leaves
  for the completed list; of the unfinished ones the N / M best by the aggregated step scores live on (so each
  is expanded M ways next round). The answer: the completed solution with the best score, among the first N
  completed.
- ``dvts`` (diverse verifier tree search): N / M independent subtrees per problem, each a greedy beam of
  width one: each round it samples M next steps, keeps the best-scored one, and stops when that one finishes.
  Its candidates are the M siblings of its last round (N in all); the answer is the best-scored finished one.
- ``best_of_n``: N whole solutions sampled at once, each scored; the best one is the answer.

``expand(prefixes, counts, seed, final) -> steps``: for each ``(problem, path)`` prefix, ``counts[i]`` sampled
next steps (``Step``: its text and whether the solution ends there); ``final``: the last round, where the
solution is written to its end. ``score(prefixes) -> step scores`` gives p(correct) of the steps of each path;
``aggregate`` (last, min, product, mean) turns them into the solution's score. Ties go to the earlier node.

Differences from search-and-learn: the answer of beam search is the best of at most N completed solutions,
which are not duplicated up to N when fewer finished; DVTS does not prune a subtree on ``boxed{`` (the
answer format is the answer function's business); no lookahead and no duplicate filtering.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Step:
    """One sampled step: its text and whether the solution ends with it."""

    text: str
    done: bool


Prefix = tuple[int, tuple[str, ...]]  # (problem index, the texts of the steps so far)
Expand = Callable[[list[Prefix], list[int], int, bool], list[list[Step]]]
Score = Callable[[list[Prefix]], list[list[float]]]
Aggregate = Callable[[Sequence[float]], float]


@dataclass
class Node:
    """A node of a problem's search tree: a step, its parent (-1: the empty solution), the step scores of the path
    to it, their aggregate, and whether the search kept it (a beam that lives on, the greedy choice of DVTS)."""

    id: int
    parent: int
    text: str
    done: bool
    scores: list[float]
    value: float
    kept: bool = False


@dataclass
class Tree:
    """One problem's search: every node scored, the final candidates and the chosen one (node ids)."""

    problem: int
    nodes: list[Node] = field(default_factory=list)
    candidates: list[int] = field(default_factory=list)
    chosen: int = -1

    def path(self, node: int) -> tuple[str, ...]:
        texts = []
        while node >= 0:
            texts.append(self.nodes[node].text)
            node = self.nodes[node].parent
        return tuple(reversed(texts))

    def choose(self, ids: Sequence[int]) -> int:
        """The node with the highest value among ``ids`` (the first of equals)."""
        return max(ids, key=lambda i: self.nodes[i].value)


def seed_of(seed: int, *parts: int) -> int:
    """A seed for one round of one search, from the run's seed (a positive 31-bit integer)."""
    for part in parts:
        seed = (seed * 1_000_003 + part * 7919 + 1) % (2**31 - 1)
    return seed


def _grow(
    trees: list[Tree],
    parents: list[tuple[int, int]],
    counts: list[int],
    expand: Expand,
    score: Score,
    aggregate: Aggregate,
    seed: int,
    final: bool,
) -> list[list[int]]:
    """Expand node ``parents[i] = (tree, node)`` ``counts[i]`` ways, score the children; their ids per parent."""
    prefixes = [(trees[t].problem, trees[t].path(n)) for t, n in parents]
    steps = expand(prefixes, counts, seed, final)
    children: list[tuple[int, Node]] = []
    out: list[list[int]] = []
    for (t, n), count, made in zip(parents, counts, steps, strict=True):
        if len(made) != count:
            raise ValueError(f"expand gave {len(made)} steps for a prefix asked {count}")
        ids = []
        for step in made:
            node = Node(len(trees[t].nodes), n, step.text, step.done or final, [], 0.0)
            trees[t].nodes.append(node)
            children.append((t, node))
            ids.append(node.id)
        out.append(ids)
    scores = score([(trees[t].problem, trees[t].path(node.id)) for t, node in children])
    for (_, node), s in zip(children, scores, strict=True):
        node.scores, node.value = list(s), aggregate(s)
    return out


def slot_order(per_beam: list[list[int]]) -> list[int]:
    """The children of the beams in search-and-learn's order of its repeated list of beams: the first child of
    every beam, then the second of every beam that has one, ..."""
    longest = max(map(len, per_beam), default=0)
    return [ids[r] for r in range(longest) for ids in per_beam if r < len(ids)]


def beam_search(
    problems: Sequence[int],
    expand: Expand,
    score: Score,
    aggregate: Aggregate,
    budget: int,
    beam_width: int,
    max_steps: int,
    seed: int,
) -> list[Tree]:
    """Step-level beam search of every problem at once (see the module docstring)."""
    keep = budget // beam_width
    trees = [Tree(p) for p in problems]
    live: list[list[int]] = [[-1] for _ in trees]  # -1: the empty solution
    completed: list[list[int]] = [[] for _ in trees]
    for round_ in range(max_steps):
        parents, counts = [], []
        for t, beams in enumerate(live):
            k = len(beams)
            for j, node in enumerate(beams):
                parents.append((t, node))
                counts.append(budget // k + (j < budget % k))
        if not parents:
            break
        grown = _grow(trees, parents, counts, expand, score, aggregate, seed_of(seed, round_), round_ == max_steps - 1)
        per_beam: list[list[list[int]]] = [[] for _ in trees]
        for (t, _), ids in zip(parents, grown):
            per_beam[t].append(ids)
        for t, tree in enumerate(trees):
            slots = slot_order(per_beam[t])
            completed[t].extend(i for i in slots if tree.nodes[i].done)
            open_ = [i for i in slots if not tree.nodes[i].done]
            best = set(sorted(open_, key=lambda i: -tree.nodes[i].value)[:keep])  # stable: the first of equals
            live[t] = [i for i in open_ if i in best]  # in slot order
            for i in best:
                tree.nodes[i].kept = True
    for t, tree in enumerate(trees):
        tree.candidates = completed[t][:budget]
        tree.chosen = tree.choose(tree.candidates) if tree.candidates else -1
    return trees


def dvts(
    problems: Sequence[int],
    expand: Expand,
    score: Score,
    aggregate: Aggregate,
    budget: int,
    beam_width: int,
    max_steps: int,
    seed: int,
) -> list[Tree]:
    """Diverse verifier tree search of every problem at once (see the module docstring)."""
    subtrees = budget // beam_width
    trees = [Tree(p) for p in problems]
    current = [[-1] * subtrees for _ in trees]  # each subtree's last chosen node
    last: list[list[list[int]]] = [[[] for _ in range(subtrees)] for _ in trees]  # its last round's children
    live = [[True] * subtrees for _ in trees]
    for round_ in range(max_steps):
        slots = [(t, s) for t in range(len(trees)) for s in range(subtrees) if live[t][s]]
        if not slots:
            break
        parents = [(t, current[t][s]) for t, s in slots]
        final = round_ == max_steps - 1
        grown = _grow(trees, parents, [beam_width] * len(slots), expand, score, aggregate, seed_of(seed, round_), final)
        for (t, s), ids in zip(slots, grown):
            best = trees[t].choose(ids)
            trees[t].nodes[best].kept = True
            current[t][s], last[t][s] = best, ids
            live[t][s] = not trees[t].nodes[best].done
    for t, tree in enumerate(trees):
        tree.candidates = [i for ids in last[t] for i in ids]
        tree.chosen = tree.choose(tree.candidates)
    return trees


def best_of_n(
    problems: Sequence[int], expand: Expand, score: Score, aggregate: Aggregate, budget: int, seed: int
) -> list[Tree]:
    """``budget`` whole solutions per problem, each one node under the root; the best-scored is chosen."""
    trees = [Tree(p) for p in problems]
    grown = _grow(
        trees,
        [(t, -1) for t in range(len(trees))],
        [budget] * len(trees),
        expand,
        score,
        aggregate,
        seed_of(seed, 0),
        True,
    )
    for tree, ids in zip(trees, grown):
        tree.candidates = ids
        tree.chosen = tree.choose(ids)
    return trees
