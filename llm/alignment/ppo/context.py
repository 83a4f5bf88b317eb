"""What a PPO run derives once from its validated config, and passes down to every builder.

``PPOContext.load(config)`` is called once, in the driver (``run_ppo.py``, before the prompts and the roles): it
loads the actor's tokenizer, and the reward model's when there is one (the actor's own object when both name the
same tokenizer), resolves ``data.use_chat_template`` from the actor's, and the ids that end a response
(``stop_ids``: the tokenizer's EOS and the actor model's generation-config EOS ids, as TRL's GRPO stops on; every
generation, the samples' ``ended`` and the episodes' end of turn read them). The prompts (``load_prompts``), every
role builder (``build_role``; a Ray worker gets a copy of the record with its config, so it loads no tokenizer)
and the trainer read this record; the fingerprint is computed from it at its first use, once (the resume check,
else the build). The config stays as validated: nothing derived is written back into it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from llm.data.encoding import resolve_chat_template
from llm.settings.fingerprint import Fingerprint, run_fingerprint
from llm.settings.ppo import PPOConfig
from llm.settings.registry import reward_type
from llm.utils.modeling import generation_eos_ids, load_tokenizer, log_stop_ids, stop_token_ids


@dataclass(frozen=True)
class PPOContext:
    config: PPOConfig
    tokenizer: PreTrainedTokenizerBase  # the actor's: the prompts' and responses' ids, and every role reading them
    reward_tokenizer: PreTrainedTokenizerBase | None  # the reward model's (None: a reward type without a model)
    use_chat_template: bool  # data.use_chat_template as the prompts are rendered (unset: the actor tokenizer decides)
    stop_ids: tuple[int, ...]  # the ids that end a response: the tokenizer's EOS first (modeling.stop_token_ids)
    # ``reward`` as a list: each entry's tokenizer, as ``reward_tokenizer`` (the first entry's); () for one reward
    reward_tokenizers: tuple[PreTrainedTokenizerBase | None, ...] = ()

    @classmethod
    def load(cls, c: PPOConfig) -> PPOContext:
        """The run's tokenizers, each loaded once (a path two roles name: one object), and what they decide (the
        chat-template choice is logged, and the stop ids when the model's generation config adds any to the
        tokenizer's EOS)."""
        a = c.actor_rollout
        actor_path = a.tokenizer_name_or_path or a.model_name_or_path
        tokenizer = load_tokenizer(actor_path)
        loaded: dict[str, PreTrainedTokenizerBase] = {}
        reward_tokenizers = []
        for r in c.rewards:
            if not reward_type(r.type).has_model:
                reward_tokenizers.append(None)
                continue
            path = r.tokenizer_name_or_path or r.model_name_or_path
            if _same_path(path, actor_path):
                reward_tokenizers.append(tokenizer)
                continue
            key = os.path.realpath(path) if os.path.exists(path) else path
            reward_tokenizers.append(loaded[key] if key in loaded else loaded.setdefault(key, load_tokenizer(path)))
        use_chat_template = resolve_chat_template(c.data.use_chat_template, tokenizer, "data.use_chat_template")
        extra = tuple(reward_tokenizers) if c.extra_rewards else ()
        stop_ids = stop_token_ids(tokenizer, generation_eos_ids(a.model_name_or_path))
        log_stop_ids(stop_ids, tokenizer, a.model_name_or_path)
        return cls(c, tokenizer, reward_tokenizers[0], use_chat_template, stop_ids, extra)

    def for_reward(self, i: int, config: PPOConfig) -> PPOContext:
        """The context a list's reward ``i`` is built with: ``config`` holding that entry as ``reward``, and its
        tokenizer as ``reward_tokenizer``."""
        tokenizer = (self.reward_tokenizers or (self.reward_tokenizer,))[i]
        return dataclasses.replace(self, config=config, reward_tokenizer=tokenizer, reward_tokenizers=())

    @functools.cached_property
    def fingerprint(self) -> Fingerprint:
        """``llm.settings.fingerprint.run_fingerprint`` of the run (the prompt files hashed), computed once."""
        return run_fingerprint(self.config, use_chat_template=self.use_chat_template)


def _same_path(a: str, b: str) -> bool:
    """Whether two tokenizer paths name the same tokenizer (a directory that exists: by its real path)."""
    real = lambda p: os.path.realpath(p) if os.path.exists(p) else p
    return real(a) == real(b)
