"""LoRA in PPO: the actor and the critic train peft adapters (the critic also its ``score`` head) on frozen
bases, with the flat trainers' fields and checks (``llm.utils.lora``) in their sections (``lora``,
``lora_rank``, ``lora_alpha``, ``lora_dropout``, ``target_modules``, ``rslora``, ``lora_path``,
``lora_merge``).

- The reference of a LoRA actor whose ``ref`` names no other model is the actor's own model with the adapter
  disabled (``ActorBase``, peft's ``disable_adapter``): no second copy of the weights, the ref role builds no
  model. It must live in the actor's process: in this one by default, or with Ray colocated with the actor
  (``resource_pool.colocate: [["actor_rollout", "ref"]]``); anything else stops at start-up. With
  ``lora_path`` the reference is still the base without any adapter, as in the flat DPO.
- A separate rollout copy receives the merged weights (base + adapter, ``llm.utils.lora.merged_state_dict``)
  under the plain Hugging Face names: it stays a plain model.
- Saves: the adapter (``PeftModel.from_pretrained(base, dir)``), and with ``lora_merge`` also ``dir/merged``
  at the final save; checkpoints hold adapters and their optimizer state only (checkpoint.py).
- Stops at start-up: a LoRA role sharded over an FSDP2 group (Ray, more than one device), a reference that
  shares the actor's base but has its own ``dtype`` or ``offload``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from llm.alignment.ppo.roles import PolicyModel
from llm.utils.errors import UserError
from llm.utils.lora import apply_lora, reference_model
from llm.utils.memory import release_between_layers

if TYPE_CHECKING:
    from llm.alignment.ppo.interfaces import Samples
    from llm.settings.ppo import PPOConfig

# the builders' log (llm.alignment.ppo.loading: tests read what the memory savers did under this name)
logger = logging.getLogger("llm.alignment.ppo.build")

TASKS = {"actor_rollout": "causal_lm", "critic": "seq_cls"}


def with_lora(c: PPOConfig, role: str, model):
    """``model`` with the adapters of ``role``'s section (peft), or as it is without ``lora``. A LoRA role is
    activation-checkpointed unless ``training.gradient_checkpointing`` says otherwise (LoRA's memory default: with
    no gradients or optimizer state of the base, a LoRA update's peak is mostly activations), and hands glibc's
    freed heap back between its decoder layers either way (``llm.utils.memory``)."""
    section = getattr(c, role)
    if not section.lora:
        return model
    release_between_layers(model, role)
    if c.training.gradient_checkpointing is None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        logger.info(
            "%s: activation checkpointing on (the LoRA default; training.gradient_checkpointing false turns it off)",
            role,
        )
    return apply_lora(model, section, TASKS[role])


class ActorBase(PolicyModel):
    """The reference policy of a LoRA actor: the actor role's own model with its adapter disabled (in eval
    mode: ``llm.utils.lora.reference_model``), found in ``roles`` (the roles of this process, by name) when a
    call comes, so the two may be built in either order. No weights of its own."""

    def __init__(self, roles: dict, tokenizer, temperature: float, micro_batch_size: int) -> None:
        self.roles, self.tokenizer = roles, tokenizer
        self.temperature, self.micro_batch_size = temperature, micro_batch_size
        self.gather_for_generation = False

    @property
    def model(self):
        actor = self.roles.get("actor_rollout")
        if actor is None:
            raise UserError(
                "ref: the reference of a LoRA actor is the actor's model with the adapter disabled, but no actor "
                "role was built in this process (with Ray, colocate actor_rollout and ref)"
            )
        return actor.model

    def log_probs(self, samples: Samples, *args, **kwargs):
        """``PolicyModel.log_probs`` (and whatever it returns besides) of the base: the adapter disabled."""
        with reference_model(self.model):
            return super().log_probs(samples, *args, **kwargs)

    def generate(self, *args, **kwargs):
        raise UserError("ref: the reference of a LoRA actor does not generate (the actor or its rollout copy does)")

    def load_weights(self, state) -> None:
        raise UserError("ref: the reference of a LoRA actor is the actor's frozen base: it takes no weights")
