"""One problem labelled: its solutions (given, or written by the policy), each step's Monte Carlo value from the
completer and the verifier, the method's labels (``mc``, ``omega``), the judge's consensus, and the PRM records
written for it with the counts of the report.

Every generation of a problem is seeded from ``(seed, problem index, call number)``, so a problem's labels do not
depend on which process labels it, on the other problems, or on a restart.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from llm.alignment.label.completer import Completer, Completion, Prefix, prefix_text, split_steps, within
from llm.alignment.label.mc import NO_ERROR, StepLabels, agrees, first_error_search, math_shepherd
from llm.alignment.label.omega import OmegaSearch, OmegaSettings, Rollout
from llm.alignment.label.verify import Verifier
from llm.data.readers import ProblemRecord
from llm.settings.label import LabelArguments


@dataclass
class Tools:
    """What labelling needs besides the settings: the completer, the policy (None when every problem gives its
    solution), the verifier and the judge (None: no consensus filter)."""

    completer: Completer
    policy: Completer | None
    verifier: Verifier
    judge: Any = None  # verify.FunctionJudge | verify.ModelJudge


@dataclass
class Labelled:
    records: list[dict]  # the PRM records written for the problem
    counts: Counter  # the report's counts (see ``llm.alignment.label.store.report``)


def problem_seed(seed: int, index: int, call: int) -> int:
    """The seed of generation call ``call`` of problem ``index`` (a positive 31-bit integer)."""
    return (seed * 1_000_003 + index * 7919 + call * 104_729 + 1) % (2**31 - 1)


def question_of(problem: ProblemRecord) -> str:
    """The text the verifier and the judge get as the question: the last user turn."""
    return next(m["content"] for m in reversed(problem.prompt) if m["role"] == "user")


def prm_record(problem: ProblemRecord, steps: list[str], labels: StepLabels, tokens: tuple[str, str]) -> dict:
    """PaddleNLP's PRM layout of one labelled solution, with its soft labels."""
    src = [m["content"] for m in problem.prompt if m["role"] == "user"]
    tgt = [m["content"] for m in problem.prompt if m["role"] == "assistant"]
    record: dict[str, Any] = {"src": src, "tgt": tgt}
    system = [m["content"] for m in problem.prompt if m["role"] == "system"]
    if system:
        record["system"] = system[0]
    record.update(
        responses=steps,
        labels=[tokens[0] if right else tokens[1] for right in labels.hard],
        soft_labels=labels.soft,
        problem_index=problem.index,
    )
    return record


class ProblemLabeller:
    """Labels one problem with ``tools`` as ``args`` say; ``label()`` returns its records and counts."""

    def __init__(self, problem: ProblemRecord, tools: Tools, args: LabelArguments) -> None:
        self.p, self.tools, self.args = problem, tools, args
        self.where = f"{problem.source}: record {problem.index}"
        self.question = question_of(problem)
        self.calls = 0
        self.counts: Counter = Counter()

    # --- generation, counted and bounded in time ----------------------------------------------------------
    def generate(self, completer: Completer, prefixes: list[Prefix], n: int, what: str) -> list[list[Completion]]:
        seed = problem_seed(self.args.seed, self.p.index, self.calls)
        self.calls += 1
        out = self.bounded(lambda: completer.complete(prefixes, n, seed), f"{what} model", len(prefixes) * n)
        done = [c for batch in out for c in batch]
        self.counts[f"generated_{what}s"] += len(done)
        self.counts[f"unfinished_{what}s"] += sum(not c.finished for c in done)
        return out

    def bounded(self, work, who: str, count: int):
        """``work()`` within ``completion_timeout`` seconds, else the run stops naming the problem."""
        timeout = self.args.completion_timeout

        def late() -> str:
            return (
                f"{self.where}, field 'completion_timeout': the {who} did not finish {count} generation(s) within "
                f"completion_timeout={timeout:g} s; nothing of this problem was written. Fix: raise "
                "completion_timeout if it is only slow, lower max_new_tokens, or check the engine"
            )

        return within(timeout, work, late)

    def right(self, solution: str) -> bool:
        return self.tools.verifier(self.question, solution, self.p.reference, self.where)

    # --- solutions -----------------------------------------------------------------------------------------
    def usable(self, steps: list[str]) -> bool:
        """A solution is labelled unless it is empty, too long or holds the PRM's placeholder."""
        if not steps:
            self.counts["skipped_empty"] += 1
        elif len(steps) > self.args.max_solution_steps:
            self.counts["skipped_too_many_steps"] += 1
        elif any(self.args.placeholder_token in s for s in steps):
            self.counts["skipped_placeholder"] += 1
        else:
            return True
        return False

    def solutions(self) -> list[list[str]]:
        if self.p.steps is not None:
            return [self.p.steps] if self.usable(self.p.steps) else []
        n = self.args.solutions_per_problem
        (written,) = self.generate(self.tools.policy, [Prefix(self.p.prompt, [])], n, "solution")
        return [
            steps for steps in (split_steps(c.text, self.args.step_separator) for c in written) if self.usable(steps)
        ]

    # --- the estimates -------------------------------------------------------------------------------------
    def values(self, steps: list[str], indices: list[int]) -> dict[int, float]:
        """MC value of the prefix ending at each step of ``indices``: the fraction of ``num_completions``
        completions whose full solution reaches the reference."""
        if not indices:
            return {}
        n, sep = self.args.num_completions, self.args.step_separator
        prefixes = [Prefix(self.p.prompt, steps[: i + 1]) for i in indices]
        batches = self.generate(self.tools.completer, prefixes, n, "completion")
        self.counts["estimates"] += len(indices)
        out = {}
        for i, prefix, batch in zip(indices, prefixes, batches):
            start = prefix_text(prefix.steps, sep)
            out[i] = sum(self.right(start + c.text) for c in batch) / n
        return out

    def label_solution(self, steps: list[str]) -> StepLabels:
        last = len(steps) - 1
        known = {last: float(self.right(self.args.step_separator.join(steps)))}  # the solution's own answer
        if self.args.method == "math_shepherd":  # every prefix at once: one batch of completions
            return math_shepherd(len(steps), self.values(steps, list(range(last))).__getitem__, known)
        if known[last] == 1.0:  # OmegaPRM searches wrong solutions only
            return StepLabels([True] * len(steps), [None] * last + [1.0], 0)
        return first_error_search(len(steps), lambda i: self.values(steps, [i])[i], known)

    def omega_tree(self) -> list[tuple[list[str], StepLabels]]:
        a, sep = self.args, self.args.step_separator

        def rollouts(prefix: list[str], k: int) -> list[Rollout]:
            # the root's rollouts are the policy's solutions; a prefix's, the completer's completions
            model, what = (self.tools.completer, "completion") if prefix else (self.tools.policy, "solution")
            (batch,) = self.generate(model, [Prefix(self.p.prompt, prefix)], k, what)
            start = prefix_text(prefix, sep)
            return [Rollout(split_steps(c.text, sep), self.right(start + c.text)) for c in batch]

        settings = OmegaSettings(
            a.num_completions,
            a.omega_alpha,
            a.omega_beta,
            a.omega_length_scale,
            a.omega_c_puct,
            a.omega_max_search_count,
            a.omega_rollout_budget,
        )
        search = OmegaSearch(rollouts, settings)
        found = search.run()
        self.counts["estimates"] += search.estimates
        return [(s.steps, s.labels) for s in found if self.usable(s.steps)]

    def judged(self, steps: list[str]) -> int | None:
        """The judge's first wrong step of ``steps`` (-1: none; None: no answer)."""
        seed = problem_seed(self.args.seed, self.p.index, self.calls)
        self.calls += 1
        judge = self.tools.judge
        return self.bounded(lambda: judge(self.question, steps, self.p.reference, self.where, seed), "judge", 1)

    # --- the problem -----------------------------------------------------------------------------------------
    def label(self) -> Labelled:
        tokens = (self.args.positive_token, self.args.negative_token)
        if self.p.steps is None and self.args.method == "omegaprm":
            labelled = self.omega_tree()
        else:
            labelled = [(steps, self.label_solution(steps)) for steps in self.solutions()]
        records = []
        for steps, labels in labelled:
            if self.tools.judge is not None:
                verdict = self.judged(steps)
                self.counts["judged"] += 1
                self.counts["judge_no_answer"] += verdict is None
                if not agrees(labels, verdict):
                    self.counts["dropped_by_consensus"] += 1
                    continue
            record = prm_record(self.p, steps, labels, tokens)
            record["solution_index"] = len(records)
            records.append(record)
            self.counts["solutions"] += 1
            self.counts["steps"] += len(steps)
            self.counts["positive_steps"] += sum(labels.hard)
            self.counts["solutions_without_error"] += labels.first_error == NO_ERROR
            self.counts["soft_values"] += sum(v is not None for v in labels.soft)
            self.counts["soft_sum"] += sum(v for v in labels.soft if v is not None)
        self.counts["problems"] += 1
        return Labelled(records, self.counts)
