"""``reward.type: generative_prm``: a generative PRM (``run_reward.py`` with ``prm_kind: generative``) as PPO's
reward, read through its step scorer (``llm.alignment.rm.generative``): for every step of a response (split at
``step_separator``) it writes a critique, then reads p(positive verdict). ``prm_aggregation`` as the
discriminative PRM's (``PRMReward``, whose dense rewards and aggregations this type shares): ``dense`` puts each
step's score at the step's last response token."""

from __future__ import annotations

from typing import TYPE_CHECKING

from transformers import AutoModelForCausalLM

from llm.alignment.ppo.loading import load_frozen, offload_idle
from llm.alignment.ppo.rewards.base import register_reward
from llm.alignment.ppo.rewards.model import PRMReward
from llm.alignment.rm.generative import CritiqueSettings, GenerativePRM, reward_ids
from llm.utils.errors import UserError

if TYPE_CHECKING:
    from llm.alignment.ppo.context import PPOContext
    from llm.alignment.ppo.loading import Place
    from llm.settings.ppo import PPOConfig


@register_reward("generative_prm", needs=("model_name_or_path",), has_model=True)
class GenerativePRMReward(PRMReward):
    """Dense (or aggregated) step rewards of a generative PRM: its ``scorer`` is a ``GenerativePRM``."""

    def __init__(
        self, model, tokenizer, actor_tokenizer, separator: str, scorer: GenerativePRM, aggregation: str
    ) -> None:
        self.model, self.tokenizer, self.actor_tokenizer = model, tokenizer, actor_tokenizer
        self.separator, self.aggregation, self.scorer = separator, aggregation, scorer

    @classmethod
    def from_config(cls, c: PPOConfig, place: Place, run: PPOContext) -> GenerativePRMReward:
        r, tok = c.reward, run.reward_tokenizer
        if place.layout is not None:
            raise UserError(
                "reward.type generative_prm with the reward model sharded over an FSDP2 group: not supported (each "
                "rank writes critiques of its own length); give the reward model one device"
            )
        model = load_frozen(c, AutoModelForCausalLM, r.model_name_or_path, r.init_from_config, tok, place, r.dtype)
        micro = r.micro_batch_size or c.training.micro_batch_size  # passes that write their critiques together
        settings = CritiqueSettings(
            r.critique_samples, r.max_critique_tokens, r.critique_temperature, c.training.seed, micro
        )
        scorer = GenerativePRM(model, tok, reward_ids(tok, r.label_tokens, model, "reward.reward_tokens"), settings)
        prm = cls(model, tok, run.tokenizer, r.step_separator, scorer, r.prm_aggregation)
        return offload_idle(c, prm, model, "reward", place, ("score",))
