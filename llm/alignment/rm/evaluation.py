"""The two ways the field evaluates reward models, as pure functions of per-step scores.

ProcessBench (Zheng et al. 2024, Qwen): each solution is labelled with the index of its earliest wrong
step, or -1 when every step is right. A scalar PRM predicts the first step whose p(correct) is *below*
the threshold (a score exactly at the threshold counts as correct), or -1::

    acc_error   = share of erroneous solutions (label >= 0) whose predicted first error == label
    acc_correct = share of correct solutions (label == -1) predicted -1
    f1          = 2 acc_error acc_correct / (acc_error + acc_correct)      (0 when both are 0)

reported over all solutions, per subset and per generator, plus the mean F1 over subsets (the paper's
"average"); ``best_threshold`` finds the threshold that maximises F1 on one subset (ProcessBench tunes
it on GSM8K), searched over every distinct step score (the predictions only change there).

Best-of-N verification (Math-Shepherd, Wang et al. 2024): a candidate's score aggregates its step scores
(``min``, ``product``, ``last``, ``mean``; an ORM's single score is ``score``). For each problem's group of
candidates, drawn in a fixed seeded order, the first N compete:

    best_of_n       the highest-scoring candidate's answer is right (ties: the earliest drawn)
    weighted_vote   argmax over answers a of the summed scores of the candidates answering a
                    (ties: the answer drawn first)
    majority_vote   the most frequent answer (ties: the one drawn first)
    pass_at_n       any of the N is right

each as the share of groups, for N = 1, 2, 4, ... up to the smallest group's size (and that size).

An ORM (``orm_best_of_n_metrics``) gives one score per candidate, a logit (the sequence-classification
head's output, trained by -log sigmoid(s_chosen - s_rejected)), not a probability: ``bon@N`` takes the
highest logit (ranking is the same under any increasing transform); ``weighted_vote@N`` sums
``sigmoid(logit)`` per answer, as the verifier literature sums p(correct) (Math-Shepherd, Uesato et al. 2022):
summed raw logits would let more candidates with a negative score *lower* their answer's weight.
``majority_vote@N`` and ``pass@N`` do not use scores and equal the PRM's on the same candidates.
"""

from __future__ import annotations

import math
import random
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from llm.utils.errors import UserError

AGGREGATIONS: dict[str, Callable[[Sequence[float]], float]] = {
    "min": min,
    "product": math.prod,
    "last": lambda s: s[-1],
    "mean": lambda s: sum(s) / len(s),
}


# --- ProcessBench ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Solution:
    """One ProcessBench solution: its step scores p(correct), the label (earliest wrong step or -1), where from."""

    scores: Sequence[float]
    label: int
    subset: str | None = None
    generator: str | None = None


def first_error(scores: Sequence[float], threshold: float) -> int:
    """Index of the first step scored below ``threshold``, or -1."""
    return next((i for i, s in enumerate(scores) if s < threshold), -1)


def f1(acc_error: float, acc_correct: float) -> float:
    total = acc_error + acc_correct
    return 2 * acc_error * acc_correct / total if total else 0.0


def processbench_scores(solutions: Sequence[Solution], threshold: float) -> dict[str, float]:
    """``acc_error``, ``acc_correct``, ``f1`` and the counts; an absent class gives nan for its accuracy."""
    errors = [first_error(s.scores, threshold) == s.label for s in solutions if s.label >= 0]
    corrects = [first_error(s.scores, threshold) == -1 for s in solutions if s.label < 0]
    acc_error = sum(errors) / len(errors) if errors else math.nan
    acc_correct = sum(corrects) / len(corrects) if corrects else math.nan
    both = errors and corrects
    return {
        "acc_error": acc_error,
        "acc_correct": acc_correct,
        "f1": f1(acc_error, acc_correct) if both else math.nan,
        "erroneous": float(len(errors)),
        "correct": float(len(corrects)),
    }


def metric_name(text: str) -> str:
    """A subset or generator name as part of a metric key: lower case, runs of other characters as ``_``."""
    return re.sub(r"[^0-9a-z]+", "_", text.lower()).strip("_") or "unnamed"


def processbench_metrics(solutions: Sequence[Solution], threshold: float) -> dict[str, float]:
    """``processbench_{acc_error,acc_correct,f1}`` over all solutions, the same per subset
    (``processbench_<subset>_f1``) and per generator (``processbench_generator_<name>_f1``), and
    ``processbench_mean_f1``, the mean of the subsets' F1 (the paper's average), when there are subsets."""
    out = {f"processbench_{k}": v for k, v in processbench_scores(solutions, threshold).items()}
    out["processbench_threshold"] = threshold
    for key, prefix in (("subset", "processbench_"), ("generator", "processbench_generator_")):
        groups: dict[str, list[Solution]] = defaultdict(list)
        for s in solutions:
            name = getattr(s, key)
            if name is not None:
                groups[metric_name(name)].append(s)
        for name in sorted(groups):
            for k, v in processbench_scores(groups[name], threshold).items():
                out[f"{prefix}{name}_{k}"] = v
        if key == "subset" and groups:
            f1s = [out[f"processbench_{name}_f1"] for name in sorted(groups)]
            out["processbench_mean_f1"] = sum(f1s) / len(f1s)
    return out


def best_threshold(solutions: Sequence[Solution]) -> tuple[float, float]:
    """The threshold with the highest F1 on ``solutions`` and that F1. Candidates: every distinct step score
    (a step is flagged below it) and one above them all; among equal F1s the lowest threshold wins."""
    candidates = sorted({s for sol in solutions for s in sol.scores})
    candidates.append(math.nextafter(candidates[-1], math.inf) if candidates else 0.5)
    best = (candidates[0], -1.0)
    for t in candidates:
        score = processbench_scores(solutions, t)["f1"]
        score = -1.0 if math.isnan(score) else score
        if score > best[1]:
            best = (t, score)
    return best


# --- best-of-N ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    """One sampled solution of a problem: its step scores (one score for an ORM), final answer, correctness."""

    scores: Sequence[float]
    answer: str
    correct: bool


def sizes(smallest_group: int) -> list[int]:
    """N = 1, 2, 4, ... up to the smallest group's size, and that size itself."""
    out, n = [], 1
    while n <= smallest_group:
        out.append(n)
        n *= 2
    if smallest_group and out[-1] != smallest_group:
        out.append(smallest_group)
    return out


def drawn_order(groups: dict[str, list[Candidate]], seed: int | None) -> dict[str, list[Candidate]]:
    """Each group's candidates in a fixed order drawn with ``seed`` (the same for every aggregation and N);
    ``None``: the order given."""
    if seed is None:
        return dict(groups)
    rng = random.Random(seed)
    out = {}
    for key in sorted(groups):
        order = list(range(len(groups[key])))
        rng.shuffle(order)
        out[key] = [groups[key][i] for i in order]
    return out


def _majority(cands: Sequence[Candidate]) -> Candidate:
    counts: dict[str, int] = defaultdict(int)
    for c in cands:
        counts[c.answer] += 1
    top = max(counts.values())
    return next(c for c in cands if counts[c.answer] == top)  # ties: the answer drawn first


def _weighted(cands: Sequence[Candidate], score: Callable[[Candidate], float]) -> Candidate:
    sums: dict[str, float] = defaultdict(float)
    for c in cands:
        sums[c.answer] += score(c)
    top = max(sums.values())
    return next(c for c in cands if sums[c.answer] == top)


def sigmoid(x: float) -> float:
    """``1 / (1 + exp(-x))`` without overflow for any finite ``x`` (an ORM logit -> a weight in (0, 1))."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


Scorer = tuple[Callable[[Candidate], float], Callable[[Candidate], float]]  # (rank for best-of-N, vote weight)


def _best_of_n(
    groups: dict[str, list[Candidate]], scorers: dict[str, Scorer], seed: int | None, ns: Sequence[int] | None = None
) -> dict[str, float]:
    """``bon<suffix>@N``, ``weighted_vote<suffix>@N`` per scorer, ``majority_vote@N``, ``pass@N``; at each N of
    ``ns`` (default ``sizes`` of the smallest group)."""
    if not groups:
        return {}
    ordered = drawn_order(groups, seed)
    out: dict[str, float] = {"bon_groups": float(len(groups))}
    smallest = min(len(g) for g in ordered.values())
    if ns is not None and any(n > smallest for n in ns):
        raise ValueError(f"best-of-N at N = {max(ns)} over groups of {smallest} candidates")
    for n in ns if ns is not None else sizes(smallest):
        firsts = [g[:n] for g in ordered.values()]
        out[f"majority_vote@{n}"] = sum(_majority(c).correct for c in firsts) / len(firsts)
        out[f"pass@{n}"] = sum(any(x.correct for x in c) for c in firsts) / len(firsts)
        for suffix, (rank, weight) in scorers.items():
            best = [max(c, key=rank) for c in firsts]  # max keeps the first of equal scores
            out[f"bon{suffix}@{n}"] = sum(b.correct for b in best) / len(best)
            out[f"weighted_vote{suffix}@{n}"] = sum(_weighted(c, weight).correct for c in firsts) / len(firsts)
    return out


def best_of_n_metrics(
    groups: dict[str, list[Candidate]], aggregations: Sequence[str], seed: int | None, ns: Sequence[int] | None = None
) -> dict[str, float]:
    """``bon_<agg>@N``, ``weighted_vote_<agg>@N``, ``majority_vote@N``, ``pass@N`` as shares of groups (a PRM:
    the aggregated step scores p(correct) rank and weigh the candidates), at each N of ``ns`` (default: 1, 2, 4,
    ... up to the smallest group)."""
    scorers: dict[str, Scorer] = {}
    for agg in aggregations:
        fn = AGGREGATIONS.get(agg, lambda s: s[-1])  # "score": an ORM's one score

        def score(c: Candidate, fn=fn) -> float:
            return fn(c.scores)

        scorers[f"_{agg}"] = (score, score)
    return _best_of_n(groups, scorers, seed, ns)


def orm_score(c: Candidate) -> float:
    """An ORM candidate's one score (its logit)."""
    if len(c.scores) != 1:
        raise ValueError(f"an ORM candidate has exactly one score, got {len(c.scores)}")
    return c.scores[0]


def orm_best_of_n_metrics(groups: dict[str, list[Candidate]], seed: int | None) -> dict[str, float]:
    """An ORM's best-of-N, each candidate with its one score (a logit): ``bon@N`` (highest logit),
    ``weighted_vote@N`` (argmax over answers of the summed ``sigmoid(logit)``), ``majority_vote@N`` and
    ``pass@N`` (the same as ``best_of_n_metrics`` gives on the same groups), as shares of groups."""
    return _best_of_n(groups, {"": (orm_score, lambda c: sigmoid(orm_score(c)))}, seed)


# --- both, from any step scorer's scores --------------------------------------------------------------------
def best_threshold_metrics(solutions: Sequence[Solution], subset: str) -> dict[str, float]:
    """The threshold with the best ProcessBench F1 on ``subset``, that F1, and every metric at it."""
    tuned = [s for s in solutions if s.subset is not None and metric_name(s.subset) == metric_name(subset)]
    if not tuned:
        found = sorted({s.subset for s in solutions if s.subset is not None})
        raise UserError(
            f"prm_threshold_subset={subset!r}: no ProcessBench record of that subset in the eval data "
            f"(subsets: {', '.join(found) or 'none'})"
        )
    best, best_f1 = best_threshold(tuned)
    metrics = {"processbench_best_threshold": best, f"processbench_{metric_name(subset)}_best_f1": best_f1}
    at_best = processbench_metrics(solutions, best)
    metrics.update({f"{k}_at_best_threshold": v for k, v in at_best.items() if k != "processbench_threshold"})
    return metrics


def step_score_metrics(
    scores: Sequence[Sequence[float]],
    records: Sequence,
    threshold: float,
    threshold_subset: str | None,
    aggregations: Sequence[str],
    seed: int | None,
) -> dict[str, float]:
    """ProcessBench over the records with a first-error label (``processbench_metrics``; with ``threshold_subset``
    also at the threshold best on that subset) and best-of-N over those with a correct flag (``best_of_n_metrics``),
    ``scores[i]`` being record ``i``'s step scores p(correct): the PRM trainer's evaluation forward or any
    ``StepScorer`` (``llm.alignment.rm.scoring.score_records``) gives them."""
    solutions, groups = [], defaultdict(list)
    for s, rec in zip(scores, records, strict=True):
        if getattr(rec, "first_error", None) is not None:
            solutions.append(Solution(s, rec.first_error, rec.subset, rec.generator))
        if getattr(rec, "correct", None) is not None and s:
            groups[rec.group].append(Candidate(s, rec.answer, rec.correct))
    metrics: dict[str, float] = {}
    if solutions:
        metrics.update(processbench_metrics(solutions, threshold))
        if threshold_subset is not None:
            metrics.update(best_threshold_metrics(solutions, threshold_subset))
    if groups:
        metrics.update(best_of_n_metrics(groups, aggregations, seed))
    return metrics


def plot_best_of_n(metrics: dict[str, float], path: str, title: str = "best-of-N") -> None:
    """Accuracy against N (log 2 axis) for every best-of-N curve in ``metrics``, as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for key, value in metrics.items():
        name, at, n = key.rpartition("@")[0], "@" in key, key.rpartition("@")[2]
        if at and n.isdigit():
            curves[name.removeprefix("eval_")].append((int(n), value))
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in sorted(curves):
        points = sorted(curves[name])
        ax.plot([n for n, _ in points], [v for _, v in points], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("N (candidates per problem)")
    ax.set_ylabel("accuracy")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
