"""One step-score interface for every kind of process reward model: ``StepScorer.score_steps(problems, steps)``.

``problems[i]`` is the text before the solution as the scorer reads it (a problem, or a prompt already
rendered); ``steps[i]`` the solution's steps. The answer is p(correct) of every step, ``len(steps[i])`` floats
in [0, 1] per solution (an empty solution: an empty list). The evaluators (ProcessBench, best-of-N), the
reward server, PPO's PRM reward and the PRM-guided search read a PRM through it only, so a new kind (an
implicit PRM, a generative one) is one class here, registered by name (``@register_step_scorer``) in the
registry ``STEP_SCORERS`` (``llm/settings/registry.py``, the config field ``prm.kind``) with a
``from_settings(prm_section, seed)`` constructor. ``score_records`` scores evaluation records (ProcessBench,
best-of-N) with any kind for ``evaluation.step_score_metrics``, the metrics the PRM trainer's evaluation reports.

The kinds:

- ``discriminative``: our PRM (``run_reward.py`` with ``process_reward``), a causal LM read at a placeholder
  token after every step: p(correct) = softmax over the two reward tokens' logits, the positive one's
  probability (``rm.loss.step_scores``). The solution is encoded as in training (``prm_response_ids``:
  exactly one placeholder id per step), after ``tokenizer(problem)``.
- ``orm``: an outcome reward model (a sequence classifier with one label) as a step scorer: step k's score
  is ``sigmoid`` of the ORM's logit for the solution cut after step k (steps joined with a newline, as an
  ORM best-of-N candidate; read at its last token, no EOS appended: the solution is not known to be
  finished), so ``last`` aggregation is the ORM's score of the whole text. Each prefix is its own sequence
  (K sequences for K steps): exact, and quadratic in the steps.
- ``implicit`` (``implicit.py``, a module of its own: ``scorers.py`` imports every kind's module): an implicit PRM
  (``run_reward.py`` with ``prm_kind: implicit``): p(correct) of step k = ``sigmoid`` of beta times the log-ratio
  to its reference summed over the steps up to k.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, PreTrainedTokenizerBase

from llm.alignment.lm import full_weight
from llm.alignment.ppo.engine import forward_readouts
from llm.alignment.ppo.fsdp import head_linear
from llm.alignment.rm.data import orm_candidate_text
from llm.alignment.rm.evaluation import sigmoid
from llm.alignment.rm.loss import step_scores
from llm.data.encode_reward import prm_response_ids
from llm.data.encoding import single_token_id
from llm.data.packing import causal_example
from llm.settings.registry import STEP_SCORERS
from llm.settings.shared import reward_token_pair
from llm.utils.errors import UserError
from llm.utils.modeling import load_model, load_tokenizer

if TYPE_CHECKING:
    from llm.settings.search import PRMSection

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class StepScorer(Protocol):
    """p(correct) of every step of every solution (see the module docstring)."""

    def score_steps(self, problems: list[str], steps: list[list[str]]) -> list[list[float]]: ...


def register_step_scorer(name: str) -> Callable[[type], type]:
    """Class decorator: ``prm.kind: name`` builds this class with ``cls.from_settings(prm_section, seed)``."""

    def register(cls: type) -> type:
        STEP_SCORERS.add(name, cls)
        return cls

    return register


def problem_text(messages: list[dict]) -> str:
    """The problem before a solution as the PRM trainer encodes it without a chat template: the prompt's messages
    joined by newlines, then a newline; "" when there is none (Math-Shepherd layouts: the question starts the first
    step; the tokenizer's BOS alone then precedes the steps, as in training)."""
    return "\n".join(m["content"] for m in messages) + "\n" if messages else ""


def score_records(scorer: StepScorer, records: Sequence, batch_size: int = 64) -> list[list[float]]:
    """The step scores of PRM records (``PRMRecord``: ProcessBench solutions, best-of-N candidates) by any step
    scorer, for ``evaluation.step_score_metrics``: the evaluation of a PRM of any kind."""
    out: list[list[float]] = []
    for start in range(0, len(records), batch_size):
        part = records[start : start + batch_size]
        out += scorer.score_steps([problem_text(r.prompt) for r in part], [list(r.steps) for r in part])
    return out


def _check_shape(problems: list[str], steps: list[list[str]]) -> None:
    if len(problems) != len(steps):
        raise ValueError(f"score_steps: {len(problems)} problems and {len(steps)} solutions; give one per problem")


def _load(auto_class: type, s: PRMSection, seed: int, **overrides):
    tokenizer = load_tokenizer(s.tokenizer_name_or_path or s.model_name_or_path)
    model = load_model(
        auto_class,
        s.model_name_or_path,
        init_from_config=s.init_from_config,
        seed=seed,
        dtype=DTYPES[s.dtype],
        pad_token_id=tokenizer.pad_token_id,
        **overrides,
    )
    if torch.cuda.is_available():
        model = model.to("cuda")
    return model.eval(), tokenizer


@register_step_scorer("discriminative")
class DiscriminativePRM:
    """Our PRM: ``P(+)`` from the LM head's two reward-token logits at the placeholder after every step."""

    def __init__(
        self,
        model,
        tokenizer: PreTrainedTokenizerBase,
        placeholder: str,
        reward_token_ids: tuple[int, int],
        placeholder_id: int,
        micro_batch_size: int,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.placeholder, self.placeholder_id = placeholder, placeholder_id
        self.reward_token_ids = list(reward_token_ids)
        self.micro_batch_size = micro_batch_size

    @classmethod
    def from_settings(cls, s: PRMSection, seed: int) -> DiscriminativePRM:
        model, tok = _load(AutoModelForCausalLM, s, seed)
        tokens = reward_token_pair(s.reward_tokens, "prm.reward_tokens")
        ids = tuple(single_token_id(tok, t, "prm.reward_tokens") for t in tokens)
        vocab = model.get_output_embeddings().weight.shape[0]
        if max(ids) >= vocab:
            raise UserError(
                f"prm.reward_tokens ids {ids} are outside the model's vocabulary ({vocab}): give the PRM's own "
                "tokenizer as prm.tokenizer_name_or_path"
            )
        placeholder_id = single_token_id(tok, s.placeholder_token, "prm.placeholder_token")
        return cls(model, tok, s.placeholder_token, ids, placeholder_id, s.micro_batch_size)

    @torch.no_grad()
    def score_steps(self, problems: list[str], steps: list[list[str]]) -> list[list[float]]:
        _check_shape(problems, steps)
        examples = []
        for i, (problem, solution) in enumerate(zip(problems, steps)):
            if not solution:
                continue
            p = self.tokenizer(problem)["input_ids"]
            # token level, as in PRM training: exactly one placeholder id per step, whatever the tokenizer
            r, marks = prm_response_ids(self.tokenizer, list(solution), self.placeholder, self.placeholder_id)
            examples.append(causal_example(p + r, [len(p) + m for m in marks], [0] * len(marks), record=i))
        out: list[list[float]] = [[] for _ in problems]
        if not examples:
            return out
        lm_head = self.model.get_output_embeddings()
        head = lambda hidden: F.linear(hidden, full_weight(lm_head.weight)[self.reward_token_ids])
        pad = self.tokenizer.pad_token_id
        for batch, logits in forward_readouts(self.model, examples, self.micro_batch_size, pad, True, head):
            probs = step_scores(logits).cpu().tolist()
            for e, prob in zip(batch.records[batch.readout_example].tolist(), probs):
                out[e].append(prob)
        return out


@register_step_scorer("orm")
class OutcomeScorer:
    """An ORM read after every step: step k's score is ``sigmoid(logit)`` of the solution up to step k."""

    def __init__(self, model, tokenizer: PreTrainedTokenizerBase, micro_batch_size: int) -> None:
        self.model, self.tokenizer, self.micro_batch_size = model, tokenizer, micro_batch_size

    @classmethod
    def from_settings(cls, s: PRMSection, seed: int) -> OutcomeScorer:
        model, tok = _load(AutoModelForSequenceClassification, s, seed, num_labels=1)
        if not hasattr(model, "score"):
            raise UserError(f"prm.kind orm: {type(model).__name__} has no `score` head: give a trained ORM")
        return cls(model, tok, s.micro_batch_size)

    @torch.no_grad()
    def score_steps(self, problems: list[str], steps: list[list[str]]) -> list[list[float]]:
        _check_shape(problems, steps)
        examples, slots = [], []
        for i, (problem, solution) in enumerate(zip(problems, steps)):
            p = self.tokenizer(problem)["input_ids"]
            for k in range(len(solution)):
                r = self.tokenizer(orm_candidate_text(list(solution[: k + 1])), add_special_tokens=False)["input_ids"]
                ids = p + (r or [self.tokenizer.pad_token_id])
                examples.append(causal_example(ids, [len(ids) - 1], [0], record=len(slots)))
                slots.append(i)
        out: list[list[float]] = [[] for _ in problems]
        logits = [0.0] * len(slots)
        head = lambda hidden: head_linear(self.model.score, hidden).squeeze(-1).float().cpu()
        pad = self.tokenizer.pad_token_id
        for batch, values in forward_readouts(self.model, examples, self.micro_batch_size, pad, False, head):
            for e, value in zip(batch.records[batch.readout_example].tolist(), values.tolist()):
                logits[e] = value
        for slot, logit in zip(slots, logits):  # slots are in step order within each solution
            out[slot].append(sigmoid(logit))
        return out
