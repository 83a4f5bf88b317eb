"""PRM-guided search (llm/alignment/search/tree.py) on a scripted policy and a scripted PRM: against search-and-learn's
beam search and DVTS written out naively here (one problem at a time, its repeated list of beams), against a brute
force over the whole tree the policy can write, and hand-made trees where the choice is derived by hand."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

import pytest

from llm.alignment.rm.evaluation import AGGREGATIONS
from llm.alignment.search import tree
from llm.alignment.search.tree import Step

DEPTH = 3  # a scripted solution ends at its third step


def scripted_expand(eos_at: float = 0.0, calls: list | None = None):
    """The policy: child ``j`` of a prefix is the step ``"j"`` (the ``j``-th sample asked of it in one call); it
    ends the solution at DEPTH steps, or earlier for the paths a fixed draw picks (``eos_at``: their share)."""

    def expand(prefixes, counts, seed, final):
        if calls is not None:
            calls.append((list(prefixes), list(counts), final))
        out = []
        for (problem, path), count in zip(prefixes, counts):
            steps = []
            for j in range(count):
                child = (*path, str(j))
                early = random.Random(f"eos {problem} {child}").random() < eos_at
                steps.append(Step(str(j), len(child) >= DEPTH or early))
            out.append(steps)
        return out

    return expand


def step_score(problem: int, path: tuple[str, ...]) -> float:
    """A scripted PRM's p(correct) of the last step of ``path``: a fixed draw per problem and path."""
    return random.Random(f"score {problem} {path}").random()


def scripted_score(prefixes):
    return [[step_score(p, path[: k + 1]) for k in range(len(path))] for p, path in prefixes]


def value(problem, path, agg="last"):
    return AGGREGATIONS[agg]([step_score(problem, path[: k + 1]) for k in range(len(path))])


def ends(problem, path, eos_at):
    return len(path) >= DEPTH or random.Random(f"eos {problem} {path}").random() < eos_at


# --- the oracles: search-and-learn's loops, one problem at a time -----------------------------------------------
def naive_beam_search(problem, n, m, max_steps, eos_at, agg):
    """sal's _beam_search: active beams extended to n by repetition, one sample each, completed ones set aside,
    the top n // m of the others kept (in their list order); the answer the best of the first n completed."""
    active, completed, written = [()], [], []
    for i in range(max_steps):
        extended = (active * (n // len(active) + 1))[:n]
        copies, new = Counter(), []
        for beam in extended:
            new.append((*beam, str(copies[beam])))
            copies[beam] += 1
        written += new
        final = i == max_steps - 1
        completed += [b for b in new if final or ends(problem, b, eos_at)]
        open_ = [b for b in new if not (final or ends(problem, b, eos_at))]
        if not open_:
            break
        top = sorted(open_, key=lambda b: -value(problem, b, agg))[: n // m]
        active = [b for b in open_ if b in top]
    completed = completed[:n]
    return max(completed, key=lambda b: value(problem, b, agg)), completed, written


def naive_dvts(problem, n, m, max_steps, eos_at, agg):
    """sal's _dvts: n // m beams, each expanded m ways a round and following its best child until that one ends;
    the candidates are the m children of each beam's last round."""
    beams = [{"path": (), "live": True, "last": []} for _ in range(n // m)]
    for i in range(max_steps):
        for beam in (b for b in beams if b["live"]):
            children = [(*beam["path"], str(j)) for j in range(m)]
            best = max(children, key=lambda c: value(problem, c, agg))
            beam.update(path=best, last=children, live=not (i == max_steps - 1 or ends(problem, best, eos_at)))
    candidates = [c for b in beams for c in b["last"]]
    return max(candidates, key=lambda c: value(problem, c, agg)), candidates


def path_of(t: tree.Tree, node: int) -> tuple[str, ...]:
    return t.path(node)


@pytest.mark.parametrize("agg", ["last", "min", "product"])
@pytest.mark.parametrize("n, m, max_steps, eos_at", [(4, 2, 5, 0.0), (8, 2, 5, 0.5), (6, 3, 2, 0.2), (4, 4, 4, 0.4)])
def test_beam_search_is_search_and_learns_beam_search(n, m, max_steps, eos_at, agg):
    problems = list(range(8))  # searched together; the oracle searches each alone
    trees = tree.beam_search(
        problems, scripted_expand(eos_at), scripted_score, AGGREGATIONS[agg], n, m, max_steps, seed=1
    )
    for t in trees:
        chosen, completed, written = naive_beam_search(t.problem, n, m, max_steps, eos_at, agg)
        assert [path_of(t, i) for i in t.candidates] == completed
        assert sorted(path_of(t, node.id) for node in t.nodes) == sorted(written)  # the same tree
        assert path_of(t, t.chosen) == chosen
        assert t.nodes[t.chosen].value == pytest.approx(value(t.problem, chosen, agg))
        # the tree records every scored node; beams kept per round are at most n // m
        by_depth = Counter(len(path_of(t, node.id)) for node in t.nodes if node.kept)
        assert all(k <= n // m for k in by_depth.values())


@pytest.mark.parametrize("agg", ["last", "min"])
@pytest.mark.parametrize("n, m, max_steps, eos_at", [(4, 2, 5, 0.0), (6, 3, 5, 0.3), (4, 4, 2, 0.0)])
def test_dvts_is_search_and_learns_dvts(n, m, max_steps, eos_at, agg):
    trees = tree.dvts([0, 1], scripted_expand(eos_at), scripted_score, AGGREGATIONS[agg], n, m, max_steps, seed=1)
    for t in trees:
        chosen, candidates = naive_dvts(t.problem, n, m, max_steps, eos_at, agg)
        assert [path_of(t, i) for i in t.candidates] == candidates
        # the answer: the best finished candidate (here every candidate of the last round is finished, and a
        # subtree that stopped earlier stopped on a finished best child)
        finished = [c for c in candidates if ends(t.problem, c, eos_at) or len(c) == max_steps]
        assert path_of(t, t.chosen) == max(finished, key=lambda c: value(t.problem, c, agg))
        if finished == candidates:  # search-and-learn's answer: the best of every candidate
            assert path_of(t, t.chosen) == chosen


def test_with_a_perfect_verifier_the_searches_find_the_brute_force_best_solution():
    """The PRM scores a prefix by the best final score reachable from it (brute force over the tree the policy can
    write: n children at the root, m below, as the searches ask): any beam or subtree then follows the best path."""
    n, m = 4, 2
    leaves = [(str(a), str(b), str(c)) for a in range(n) for b, c in itertools.product(range(m), repeat=2)]
    final = {leaf: random.Random(f"leaf {leaf}").random() for leaf in leaves}
    best_leaf = max(leaves, key=final.get)

    def perfect(prefixes):
        return [[max(v for leaf, v in final.items() if leaf[: k + 1] == path[: k + 1]) for k in range(len(path))]
                for _, path in prefixes]  # fmt: skip

    beam = tree.beam_search([0], scripted_expand(), perfect, AGGREGATIONS["last"], n, m, 10, seed=0)[0]
    assert path_of(beam, beam.chosen) == best_leaf
    assert beam.nodes[beam.chosen].value == max(final.values())
    # DVTS's subtrees each start from the root with m children: the brute force over that smaller tree
    small = [leaf for leaf in leaves if int(leaf[0]) < m]
    dvts = tree.dvts([0], scripted_expand(), perfect, AGGREGATIONS["last"], n, m, 10, seed=0)[0]
    assert path_of(dvts, dvts.chosen) == max(small, key=final.get)


def trap_expand(prefixes, counts, seed, final):
    """Two steps: the first a, b, c or d (the j-th sample), the second a1, a2 under a, b1, b2 under b."""
    return [[Step("abcd"[j] if not path else f"{path[0]}{j + 1}", bool(path)) for j in range(c)]
            for (_, path), c in zip(prefixes, counts)]  # fmt: skip


TRAP = {("a",): 0.9, ("b",): 0.6, ("c",): 0.1, ("d",): 0.05}
TRAP.update({("a", "a1"): 0.3, ("a", "a2"): 0.2, ("b", "b1"): 0.8, ("b", "b2"): 0.1})


def trap_score(prefixes):
    return [[TRAP[path[: k + 1]] for k in range(len(path))] for _, path in prefixes]


def test_a_greedy_beam_falls_into_the_trap_a_wider_one_escapes():
    """By hand: step a (0.9) beats b (0.6), but a's best finish a1 scores 0.3 and b's b1 0.8. One beam
    (n = m = 2) keeps a and answers a1; two beams (n = 4, m = 2) keep a and b and answer b1, the brute-force
    best by the last step's score. By the minimum of the steps, a1 (min 0.3) still loses to b1 (min 0.6)."""
    last = AGGREGATIONS["last"]
    narrow = tree.beam_search([0], trap_expand, trap_score, last, 2, 2, 3, seed=0)[0]
    assert path_of(narrow, narrow.chosen) == ("a", "a1")
    wide = tree.beam_search([0], trap_expand, trap_score, last, 4, 2, 3, seed=0)[0]
    assert path_of(wide, wide.chosen) == ("b", "b1") and wide.nodes[wide.chosen].value == 0.8
    brute = max((p for p in TRAP if len(p) == 2), key=TRAP.get)
    assert path_of(wide, wide.chosen) == brute
    # wide: the root sampled 4 ways (a, b, c, d), a and b kept (n // m = 2), each expanded twice
    assert [path_of(wide, i) for i in wide.candidates] == [("a", "a1"), ("b", "b1"), ("a", "a2"), ("b", "b2")]
    assert sum(n.kept for n in wide.nodes) == 2
    by_min = tree.beam_search([0], trap_expand, trap_score, AGGREGATIONS["min"], 4, 2, 3, seed=0)[0]
    assert by_min.nodes[by_min.chosen].value == pytest.approx(0.6)
    prod = tree.beam_search([0], trap_expand, trap_score, AGGREGATIONS["product"], 4, 2, 3, seed=0)[0]
    assert path_of(prod, prod.chosen) == ("b", "b1") and prod.nodes[prod.chosen].value == pytest.approx(0.48)


def test_the_last_round_writes_to_the_end_and_best_of_n_samples_whole_solutions():
    calls = []
    tree.beam_search([0, 1], scripted_expand(calls=calls), scripted_score, AGGREGATIONS["last"], 4, 2, 2, seed=5)
    assert [final for _, _, final in calls] == [False, True]
    assert calls[0][1] == [4, 4] and calls[1][1] == [2, 2, 2, 2]  # the root n ways; then n // m beams m ways each
    calls.clear()
    trees = tree.best_of_n([0, 1], scripted_expand(calls=calls), scripted_score, AGGREGATIONS["last"], 8, seed=5)
    assert len(calls) == 1 and calls[0][1] == [8, 8] and calls[0][2] is True
    for t in trees:
        assert len(t.candidates) == 8 and all(t.nodes[i].done for i in t.candidates)
        assert t.nodes[t.chosen].value == max(t.nodes[i].value for i in t.candidates)


def test_round_seeds_differ_and_repeat():
    seeds = [tree.seed_of(42, r) for r in range(5)]
    assert len(set(seeds)) == 5 and seeds == [tree.seed_of(42, r) for r in range(5)]
    assert all(0 < s < 2**31 for s in seeds) and not math.isnan(seeds[0])
