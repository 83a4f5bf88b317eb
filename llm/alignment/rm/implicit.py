"""The implicit PRM as a step scorer (``prm.kind: implicit``) and what its output directory holds.

A trained implicit PRM (``run_reward.py`` with ``prm_kind: implicit``) is a causal LM directory with
``implicit_prm.json``: ``{"beta": ..., "reference": ...}``, the reference a path relative to that directory
(``reference``: the initial model, saved there once by the final save) or absolute (the ``implicit_reference`` the
run named; not copied). ``read_implicit_prm`` checks it as untrusted input.

Step scores (``ImplicitPRM``): the solution is laid out as in training (``llm.data.encode_implicit``: every step
followed by a newline, after ``tokenizer(problem)``); ``token_log_ratios`` is ``log pi - log pi_ref`` of every
response token, ``step_rewards`` beta times each step's sum (the process reward), ``score_steps`` p(correct) of step
k = ``sigmoid`` of the cumulative reward up to k (its Q-value; ``implicit_loss.step_probabilities``). PPO's
``implicit_prm`` reward reads ``token_log_ratios`` on the actor's own tokens (``llm.alignment.ppo.rewards.implicit``).
"""

from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from llm.alignment.lm import full_weight, readout_log_probs
from llm.alignment.ppo.engine import forward_readouts
from llm.alignment.rm.implicit_loss import step_probabilities
from llm.alignment.rm.scoring import DTYPES, register_step_scorer
from llm.data.encode_implicit import implicit_response_ids, solution_readouts
from llm.data.packing import causal_example
from llm.utils.errors import UserError
from llm.utils.modeling import load_model, load_tokenizer

if TYPE_CHECKING:
    from llm.settings.search import PRMSection

IMPLICIT_FILE = "implicit_prm.json"
REFERENCE_DIR = "reference"


def save_implicit_prm(output_dir: str, ref_model, reference_path: str | None, args) -> None:
    """``implicit_prm.json`` next to the saved model, and the reference once: into ``output_dir/reference`` when it is
    the initial model (not again if it is there: a resumed run's final save), by path when the run named one."""
    if reference_path:
        reference = os.path.abspath(reference_path)
    else:
        reference = REFERENCE_DIR
        target = os.path.join(output_dir, REFERENCE_DIR)
        if not os.path.isfile(os.path.join(target, "config.json")):
            ref_model.save_pretrained(target, safe_serialization=True)
    with open(os.path.join(output_dir, IMPLICIT_FILE), "w", encoding="utf-8") as f:
        json.dump({"beta": args.implicit_beta, "reference": reference, "loss": args.implicit_loss}, f, indent=2)


def read_implicit_prm(model_dir: str, field: str) -> tuple[float, str]:
    """``(beta, reference directory)`` of a trained implicit PRM (``field``: the setting naming ``model_dir``)."""
    path = os.path.join(model_dir, IMPLICIT_FILE)
    fix = "give a model trained with run_reward.py prm_kind implicit (its output_dir)"
    if not os.path.isfile(path):
        raise UserError(f"{field} {model_dir}: has no {IMPLICIT_FILE}, so no implicit PRM: {fix}")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as err:
        raise UserError(f"{path}: not readable JSON ({err}): {fix}") from None
    beta = data.get("beta") if isinstance(data, dict) else None
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta) or beta <= 0:
        raise UserError(f"{path}: field 'beta' must be a number > 0, got {beta!r}: {fix}")
    reference = data.get("reference")
    if not isinstance(reference, str) or not reference:
        raise UserError(f"{path}: field 'reference' must be the reference model's directory, got {reference!r}: {fix}")
    reference = os.path.join(model_dir, reference)  # an absolute path stays as it is
    if not os.path.isfile(os.path.join(reference, "config.json")):
        raise UserError(f"{path}: field 'reference': {reference} holds no model (no config.json): {fix}")
    return float(beta), reference


@register_step_scorer("implicit")
class ImplicitPRM:
    """``beta * log(pi / pi_ref)`` per token, per step, and p(correct) per step (see the module docstring)."""

    def __init__(self, model, reference, tokenizer: PreTrainedTokenizerBase, beta: float, micro_batch_size: int):
        self.model, self.reference, self.tokenizer = model, reference, tokenizer
        self.beta, self.micro_batch_size = beta, micro_batch_size

    @classmethod
    def from_settings(cls, s: PRMSection, seed: int) -> ImplicitPRM:
        """From a search's ``prm`` section: beta and the reference as the model's ``implicit_prm.json`` names them."""
        beta, reference = read_implicit_prm(s.model_name_or_path, "prm.model_name_or_path")
        tokenizer = load_tokenizer(s.tokenizer_name_or_path or s.model_name_or_path)
        return cls.load(s.model_name_or_path, reference, tokenizer, beta, s.micro_batch_size, seed, DTYPES[s.dtype],
                        s.init_from_config)  # fmt: skip

    @classmethod
    def load(
        cls,
        model_path: str,
        reference_path: str,
        tokenizer: PreTrainedTokenizerBase,
        beta: float,
        micro_batch_size: int,
        seed: int,
        dtype: torch.dtype = torch.float32,
        init_from_config: bool = False,
    ) -> ImplicitPRM:
        """The model and its reference loaded for scoring (eval mode, on the GPU when there is one)."""
        models = []
        for path, from_config in ((model_path, init_from_config), (reference_path, False)):
            model = load_model(
                AutoModelForCausalLM,
                path,
                init_from_config=from_config,
                seed=seed,
                dtype=dtype,
                pad_token_id=tokenizer.pad_token_id,
            )
            models.append((model.to("cuda") if torch.cuda.is_available() else model).eval())
        return cls(models[0], models[1], tokenizer, beta, micro_batch_size)

    def _log_probs(self, model, examples: list) -> list[tuple[int, int, float]]:
        head = model.get_output_embeddings()
        out = []
        for batch, hidden in forward_readouts(
            model, examples, self.micro_batch_size, self.tokenizer.pad_token_id, True, lambda h: h
        ):
            logps, _ = readout_log_probs(hidden, batch.readout_target, full_weight(head.weight), full_weight(head.bias))
            records = batch.records[batch.readout_example].tolist()
            out += zip(records, batch.readout_part.tolist(), logps.float().cpu().tolist())
        return out

    @torch.no_grad()
    def token_log_ratios(self, prompts: list[list[int]], responses: list[list[int]]) -> list[torch.Tensor]:
        """``log pi(y_t) - log pi_ref(y_t)`` of every response token, one ``(len(response),)`` tensor per sample (0 for
        a first token that nothing precedes: a sample without prompt tokens)."""
        examples = []
        for i, (p, r) in enumerate(zip(prompts, responses)):
            positions, targets = solution_readouts(p, r)
            if targets:
                index = list(range(len(r) - len(targets), len(r)))  # each readout's token index in the response
                examples.append(causal_example(list(p) + list(r), positions, targets, index, record=i))
        out = [torch.zeros(len(r), dtype=torch.float64) for r in responses]
        for model, sign in ((self.model, 1.0), (self.reference, -1.0)):
            for i, t, logp in self._log_probs(model, examples):
                out[i][t] += sign * logp
        return [o.float() for o in out]

    def step_rewards(self, problems: list[str], steps: list[list[str]]) -> list[list[float]]:
        """The process reward of every step: ``beta`` times the sum of its tokens' log-ratios."""
        if len(problems) != len(steps):
            raise ValueError(f"score_steps: {len(problems)} problems and {len(steps)} solutions; give one per problem")
        prompts = [self.tokenizer(p)["input_ids"] for p in problems]
        laid_out = [implicit_response_ids(self.tokenizer, list(s)) for s in steps]
        ratios = self.token_log_ratios(prompts, [ids for ids, _ in laid_out])
        out = []
        for ratio, (_, step_of), solution in zip(ratios, laid_out, steps):
            sums = torch.zeros(len(solution), dtype=torch.float64)
            sums.index_add_(0, torch.tensor(step_of, dtype=torch.long), ratio.double())
            out.append((self.beta * sums).tolist())
        return out

    def score_steps(self, problems: list[str], steps: list[list[str]]) -> list[list[float]]:
        return [step_probabilities(r) for r in self.step_rewards(problems, steps)]
