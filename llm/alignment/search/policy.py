"""The two callables the search runs on (``tree.py``), made of a generating engine and a step scorer.

``StepPolicy.expand``: every request is the problem's prompt ids followed by the tokens of the solution so far
(its text encoded again, as search-and-learn continues the assistant message from text), sampled up to the step
marker with the engine's stop string (``generation.generate`` or ``VLLMRollout.generate``: the same contract)
and cut right after the marker's first occurrence. A step ends the solution when it ends with EOS or reaches
``max_new_tokens`` tokens of solution; one that reaches ``max_step_tokens`` without the marker is a step all
the same (a step cap: counted, and the run's log says how often). In the last round (``final``) no stop string:
the solution is written to its end.

``PRMScore``: a path's steps as a PRM reads them (each node's text split at the marker: stripped, empty ones
dropped), scored by the ``StepScorer`` after the problem's plain text (``question\\n``, the prompt a PRM is
trained on).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from llm.alignment.ppo.rewards.model import response_steps
from llm.alignment.rm.scoring import StepScorer
from llm.alignment.search.tree import Prefix, Step, seed_of

Generate = Callable[..., list[list[int]]]  # (prompt_ids, *, num_samples, max_new_tokens, do_sample, ...) -> ids


@dataclass
class StepCounts:
    """Steps sampled, and those cut at ``max_step_tokens`` without the marker."""

    steps: int = 0
    capped: int = 0


class StepPolicy:
    """``expand`` for ``tree.py`` over ``generate`` (an engine's ``generate`` with the sampling settings bound)."""

    def __init__(
        self,
        generate: Generate,
        tokenizer,
        prompt_ids: list[list[int]],
        marker: str,
        *,
        max_step_tokens: int,
        max_new_tokens: int,
        batch_size: int,
        stop_ids: tuple[int, ...] | None = None,
    ) -> None:
        """``stop_ids``: the ids that end a solution (the tokenizer's EOS and the model's generation-config EOS ids,
        also bound into ``generate``; None: the tokenizer's EOS)."""
        self.generate, self.tokenizer, self.prompt_ids, self.marker = generate, tokenizer, prompt_ids, marker
        self.stop_ids = (tokenizer.eos_token_id,) if stop_ids is None else stop_ids
        self.max_step_tokens, self.max_new_tokens, self.batch_size = max_step_tokens, max_new_tokens, batch_size
        self.counts = StepCounts()

    def _tokens(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def expand(self, prefixes: list[Prefix], counts: list[int], seed: int, final: bool) -> list[list[Step]]:
        # one request per sample, grouped by the token limit (one generate call has one max_new_tokens)
        groups: dict[int, list[tuple[int, list[int], int]]] = defaultdict(list)
        for i, ((problem, path), count) in enumerate(zip(prefixes, counts)):
            solution = self._tokens("".join(path))
            room = self.max_new_tokens - len(solution)
            limit = max(1, room if final else min(self.max_step_tokens, room))
            for _ in range(count):
                groups[limit].append((i, self.prompt_ids[problem] + solution, room))
        out: list[list[Step]] = [[] for _ in prefixes]
        chunk = 0
        for limit in sorted(groups):
            requests = groups[limit]
            for start in range(0, len(requests), self.batch_size):
                part = requests[start : start + self.batch_size]
                ids = self.generate(
                    [r[1] for r in part],
                    num_samples=1,
                    max_new_tokens=limit,
                    seed=seed_of(seed, chunk),
                    stop=None if final else self.marker,
                )
                chunk += 1
                for (i, _, room), response in zip(part, ids):
                    out[i].append(self._step(response, limit, room, final))
        return out

    def _step(self, ids: list[int], limit: int, room: int, final: bool) -> Step:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        self.counts.steps += 1
        at = -1 if final else text.find(self.marker)
        if at >= 0:  # the step ends at its marker (the engine may have run past it within the last token)
            text = text[: at + len(self.marker)]
            return Step(text, len(ids) >= room)
        ended = bool(ids) and ids[-1] in self.stop_ids
        if not ended and not final and len(ids) >= limit and limit < room:
            self.counts.capped += 1  # max_step_tokens without the marker: a step all the same
        return Step(text, final or ended or len(ids) >= room)


class PRMScore:
    """``score`` for ``tree.py``: each path's steps (split at the marker) scored by ``scorer`` after its problem."""

    def __init__(self, scorer: StepScorer, problems: list[str], marker: str) -> None:
        self.scorer, self.problems, self.marker = scorer, problems, marker

    def steps(self, path: tuple[str, ...]) -> list[str]:
        """The steps a PRM reads: each node's text split at the marker (a node of the last round may hold several
        steps; one cut at the step cap is one step), stripped, empty ones dropped; none at all: ``(empty)``."""
        steps = [step for text in path for step in response_steps(text, self.marker)[0] if text.strip()]
        return steps or ["(empty)"]

    def __call__(self, prefixes: list[Prefix]) -> list[list[float]]:
        return self.scorer.score_steps(
            [self.problems[problem] for problem, _ in prefixes], [self.steps(path) for _, path in prefixes]
        )
