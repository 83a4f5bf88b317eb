"""reasoning-gym (``pip install reasoning-gym``): procedurally generated tasks with verifiable answers, scored by
each dataset's own ``score_answer``. Prompt records come from ``python -m llm.data.make_reasoning_gym`` (``src``:
the question, ``tgt``: the dataset's answer, ``metadata``: the dataset's entry metadata, which some scorers need).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable

from llm.alignment.ppo.agent.envs.task import task_text
from llm.utils.errors import UserError, closest

INSTALL = "pip install reasoning-gym==0.1.25"


def _reasoning_gym():
    try:
        import reasoning_gym
    except ImportError:
        raise UserError(f"the reasoning-gym environment needs the reasoning-gym package: {INSTALL}") from None
    return reasoning_gym


@functools.lru_cache(maxsize=32)
def _scorer(name: str, config_json: str) -> Callable:
    """The dataset's ``score_answer``, made once per process for each dataset name and configuration (building a
    dataset may read files)."""
    rg = _reasoning_gym()
    if name not in rg.factory.DATASETS:
        raise UserError(
            f"reasoning-gym has no dataset {name!r} (closest: {closest(name, rg.factory.DATASETS)}); name one of "
            "reasoning_gym.factory.DATASETS"
        )
    config = json.loads(config_json)
    if not config:
        return rg.get_score_answer_fn(name)
    try:
        return rg.create_dataset(name, **config).score_answer
    except (TypeError, ValueError, AssertionError) as err:
        raise UserError(f"reasoning-gym dataset {name!r} with dataset_config {config}: {err}") from None


class ReasoningGymTask:
    """A reasoning-gym task: the question (``src``) as the first user message; each reply's answer (the text in
    its last ``<answer_tag>...</answer_tag>``, or the whole reply stripped when ``answer_tag`` is null) is scored
    by the dataset's ``score_answer(answer, entry)``, ``entry`` being ``{"question": src, "answer": tgt,
    "metadata": the record's metadata}``.

    ``max_attempts`` 1: one reply, its score is the reward, done. More: while the score is under
    ``success_score`` and attempts are left, the reward is 0 and the next user message says the answer was not
    right (with its score) and asks again; the last attempt's score is the reward.

    The dataset: the record's ``metadata.source_dataset`` (what the generator writes), else ``dataset``;
    ``dataset_config``: the dataset's configuration for its scorer (reasoning-gym's defaults when empty)."""

    def __init__(
        self,
        dataset: str | None = None,
        answer_tag: str | None = "answer",
        max_attempts: int = 1,
        success_score: float = 1.0,
        dataset_config: dict | None = None,
    ) -> None:
        if max_attempts < 1:
            raise UserError(f"ReasoningGymTask: max_attempts must be >= 1, got {max_attempts}")
        _reasoning_gym()
        self.dataset, self.answer_tag, self.max_attempts = dataset, answer_tag, max_attempts
        self.success_score = float(success_score)
        self.config_json = json.dumps(dataset_config or {}, sort_keys=True)
        self.entry: dict | None = None

    def reset(self, task: dict) -> str:
        question = task_text(task, "src")
        metadata = task.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise UserError(f"the task record {str(task)[:120]}: 'metadata' must be an object (reasoning-gym's entry)")
        name = metadata.get("source_dataset") or self.dataset
        if not name:
            raise UserError(
                f"the task record {str(task)[:120]} names no reasoning-gym dataset: give the environment's "
                "kwargs a 'dataset', or write the prompts with python -m llm.data.make_reasoning_gym"
            )
        self.name, self.score_answer = name, _scorer(name, self.config_json)
        answer = task.get("tgt")
        self.entry = {"question": question, "answer": None if answer is None else str(answer), "metadata": metadata}
        self.attempts = 0
        return question

    def answer_of(self, reply: str) -> str | None:
        """The answer in ``reply``: the last ``<tag>...</tag>``'s text, or the reply stripped (no tag set)."""
        if self.answer_tag is None:
            return reply.strip()
        from reasoning_gym.utils import extract_answer

        return extract_answer(reply, tag_name=self.answer_tag)

    def score(self, reply: str) -> float:
        """The dataset's score of ``reply``'s answer (0.0 without one)."""
        if self.entry is None:
            raise RuntimeError("ReasoningGymTask.step before reset")
        answer = self.answer_of(reply)
        if answer is None:
            return 0.0
        try:
            value = self.score_answer(answer, self.entry)
        except (KeyError, TypeError, IndexError, AttributeError) as err:
            raise UserError(
                f"reasoning-gym's {self.name}.score_answer failed on this record ({type(err).__name__}: {err}): it "
                "needs the entry's metadata; write the prompts with python -m llm.data.make_reasoning_gym"
            ) from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UserError(f"reasoning-gym's {self.name}.score_answer returned {value!r}, not a finite number")
        return float(value)

    def step(self, action: str) -> tuple[str | None, float, bool]:
        value = self.score(action)
        self.attempts += 1
        if value >= self.success_score or self.attempts >= self.max_attempts:
            return None, value, True
        left = self.max_attempts - self.attempts
        again = f"Try again ({left} attempt{'s' if left > 1 else ''} left)."
        if self.answer_of(action) is None:
            tag = self.answer_tag
            return f"I found no answer: put your final answer between <{tag}> and </{tag}>. {again}", 0.0, False
        return f"That answer is not right (score {value:g}). {again}", 0.0, False
