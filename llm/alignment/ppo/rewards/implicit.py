"""``reward.type: implicit_prm``: a trained implicit PRM (``run_reward.py`` with ``prm_kind: implicit``) read through
its step scorer (``llm.alignment.rm.implicit.ImplicitPRM``) on the actor's own tokens.

``prm_aggregation: dense`` gives dense rewards, by ``implicit_granularity``:

- ``token``: ``beta * (log pi(y_t) - log pi_ref(y_t))`` at every response token (PRIME's process reward);
- ``step``: the response split into steps at ``step_separator`` (as ``prm`` splits it), each step's process
  reward ``beta * sum of its tokens' log-ratios`` at its last token. A step's tokens run to the one completing the
  separator after its text (the scorer's layout: each step followed by a newline); the tokens after the last
  step's text (a separator, EOS) count in the last step, those before the first step's text in the first.

``min`` / ``last`` / ``mean``: one outcome score, that aggregation of the steps' p(correct) (the step scorer's
``sigmoid`` of the cumulative reward). The reward model must share the actor's vocabulary (it reads the actor's
token ids; a tokenizer of another vocabulary is refused at start-up).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import AutoModelForCausalLM

from llm.alignment.ppo.interfaces import RewardOutput, Samples
from llm.alignment.ppo.loading import load_frozen
from llm.alignment.ppo.rewards.base import RewardFunction, register_reward
from llm.alignment.ppo.rewards.model import char_to_token_end, decoded_lengths, response_steps, same_vocabulary
from llm.alignment.rm.implicit import ImplicitPRM, read_implicit_prm
from llm.alignment.rm.implicit_loss import step_probabilities
from llm.settings.registry import PRM_AGGREGATIONS
from llm.utils.errors import UserError

if TYPE_CHECKING:
    from llm.alignment.ppo.context import PPOContext
    from llm.alignment.ppo.loading import Place
    from llm.settings.ppo import PPOConfig


def step_token_ends(tokenizer, response_ids: list[int], text: str, separator: str) -> list[int]:
    """The index of each step's last response token: the token completing the separator after the step's text
    (``response_steps``' spans); the last step ends at the last token."""
    _, spans = response_steps(text, separator)
    if not response_ids:
        return []
    lengths = decoded_lengths(tokenizer, response_ids)
    # a step ends with the separator after it, as the step scorer lays a solution out (each step + newline)
    ends = [char_to_token_end(tokenizer, response_ids, end + len(separator), lengths) for _, end in spans[:-1]]
    return sorted(set(ends) - {len(response_ids) - 1}) + [len(response_ids) - 1]


@register_reward("implicit_prm", needs=("model_name_or_path",), has_model=True)
class ImplicitPRMReward(RewardFunction):
    """Dense (per token or per step) or outcome rewards of an implicit PRM (see the module docstring)."""

    def __init__(self, scorer: ImplicitPRM, actor_tokenizer, separator: str, aggregation: str, granularity: str):
        self.scorer, self.actor_tokenizer = scorer, actor_tokenizer
        self.separator, self.aggregation, self.granularity = separator, aggregation, granularity

    @classmethod
    def from_config(cls, c: PPOConfig, place: Place, run: PPOContext) -> ImplicitPRMReward:
        r, tok = c.reward, run.reward_tokenizer
        if not same_vocabulary(run.tokenizer, tok):
            raise UserError(
                "reward.type implicit_prm reads the actor's token ids: its tokenizer (reward.tokenizer_name_or_path) "
                "must have the actor's vocabulary"
            )
        if r.offload:
            raise UserError("reward.offload with reward.type implicit_prm: not supported; set it false")
        beta, reference = read_implicit_prm(r.model_name_or_path, "reward.model_name_or_path")
        policy = load_frozen(c, AutoModelForCausalLM, r.model_name_or_path, r.init_from_config, tok, place, r.dtype)
        ref = load_frozen(c, AutoModelForCausalLM, reference, False, tok, place, r.dtype)
        scorer = ImplicitPRM(policy, ref, tok, beta, c.micro("reward"))
        return cls(scorer, run.tokenizer, r.step_separator, r.prm_aggregation, r.implicit_granularity)

    def token_rewards(self, samples: Samples) -> list[torch.Tensor]:
        """``beta * log(pi / pi_ref)`` of every response token of every sample."""
        self.samples_seen += len(samples)
        ratios = self.scorer.token_log_ratios(samples.prompt_ids, samples.response_ids)
        return [self.scorer.beta * r for r in ratios]

    def step_rewards(self, samples: Samples) -> tuple[list[list[float]], list[list[int]]]:
        """Each step's process reward and the index of its last response token."""
        rewards, ends = [], []
        for i, tokens in enumerate(self.token_rewards(samples)):
            last = step_token_ends(self.actor_tokenizer, samples.response_ids[i], samples.responses[i], self.separator)
            starts = [0] + [e + 1 for e in last[:-1]]
            rewards.append([float(tokens[s : e + 1].sum()) for s, e in zip(starts, last)])
            ends.append(last)
        return rewards, ends

    def step_scores(self, samples: Samples) -> tuple[list[list[float]], list[list[int]]]:
        """p(correct) of every step (``sigmoid`` of the cumulative reward) and the steps' last tokens."""
        rewards, ends = self.step_rewards(samples)
        return [step_probabilities(r) for r in rewards], ends

    def score(self, samples: Samples) -> RewardOutput:
        agg = PRM_AGGREGATIONS[self.aggregation]
        if agg is not None:
            return RewardOutput(torch.tensor([agg(s) for s in self.step_scores(samples)[0]]))
        T = max(len(r) for r in samples.response_ids)
        dense = torch.zeros(len(samples), T)
        if self.granularity == "token":
            for i, tokens in enumerate(self.token_rewards(samples)):
                dense[i, : len(tokens)] = tokens
        else:
            for i, (rewards, ends) in enumerate(zip(*self.step_rewards(samples))):
                for reward, end in zip(rewards, ends):
                    dense[i, end] += reward
        return RewardOutput(torch.zeros(len(samples)), dense)
