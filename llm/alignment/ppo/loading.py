"""A role's models and optimizer on its ``Place``: loading (checkpoint or seeded config, dtype, gradient
checkpointing, FSDP2 sharding), the optimizer a trained role gets, and offloading a frozen one when idle.
Shared by the role builders (build.py) and the model rewards (rewards/model.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from llm.alignment.ppo.fsdp import sum_gradients
from llm.alignment.ppo.offload import OffloadedTrainableRole, offload_when_idle
from llm.alignment.ppo.optim import TrainableRole
from llm.utils.distributed import Layout
from llm.utils.embedding_grad import reuse_embedding_gradient
from llm.utils.errors import UserError
from llm.utils.memory import keep_freed_memory, release_between_layers
from llm.utils.modeling import load_model

if TYPE_CHECKING:
    from llm.settings.ppo import PPOConfig

# The log of the builders: what the memory savers did (tests read it under this name).
logger = logging.getLogger("llm.alignment.ppo.build")


@dataclass(frozen=True)
class Place:
    """Where a role's models go: ``device`` ("cuda" in a Ray GPU worker) and, for one rank of an FSDP2
    group, the group's ``layout`` (None: the whole model in this process)."""

    device: str = "cpu"
    layout: Layout | None = None


def model_dtype(c: PPOConfig, frozen: str | None = None) -> torch.dtype:
    """The trained models' dtype (``training.bf16``), or a frozen role's own ``dtype`` when it sets one."""
    if frozen is not None:
        return getattr(torch, frozen)
    return torch.bfloat16 if c.training.bf16 else torch.float32


def load(
    c: PPOConfig,
    auto_class: type,
    path: str,
    from_config: bool,
    tok,
    place: Place,
    trained: bool,
    dtype: str | None = None,
    **kw,
):
    """One of the run's models on ``place``: trained (gradient checkpointing as configured) or frozen
    (in ``dtype`` when given)."""
    model = load_model(
        auto_class,
        path,
        init_from_config=from_config,
        seed=c.training.seed,
        dtype=model_dtype(c, dtype),
        pad_token_id=tok.pad_token_id,
        layout=place.layout,
        **kw,
    ).to(place.device)
    if trained and c.training.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        release_between_layers(model, "trained model")  # glibc's freed heap back between layers (llm.utils.memory)
    if trained and place.layout is not None:
        sum_gradients(model)
    return model if trained else model.eval().requires_grad_(False)


def load_frozen(c: PPOConfig, auto_class: type, path: str, from_config: bool, tok, place: Place, dtype=None, **kw):
    return load(c, auto_class, path, from_config, tok, place, False, dtype, **kw)


def activation_checkpointed(model) -> bool:
    """Whether ``model`` (a transformers model, peft-wrapped or not) recomputes its activations in backward."""
    flag = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5.x; the old name warns
    return bool(getattr(model, "is_gradient_checkpointing", False) if flag is None else flag)


def optimizer_for(c: PPOConfig, model, role: str, place: Place) -> TrainableRole:
    """The trained role's optimizer: each setting the role's own value, else training's; on the host with
    ``training.adam_offload`` (when there is a device to leave)."""
    t = c.training
    cls = TrainableRole
    if t.adam_offload:
        if place.layout is not None:
            raise UserError(
                f"training.adam_offload with {role} sharded over an FSDP2 group: not supported; give {role} one "
                "device, or use the group's own offload (sharding offload) instead"
            )
        if torch.device(place.device).type == "cpu":
            logger.info(
                "training.adam_offload: %s runs on the CPU, its optimizer state is in host memory already", role
            )
        else:
            logger.info("training.adam_offload: %s keeps its AdamW state (fp32 master + moments) on the host", role)
            cls = OffloadedTrainableRole
    optim = cls(
        model,
        c.lr(role),
        c.optim(role, "weight_decay"),
        (c.optim(role, "adam_beta1"), c.optim(role, "adam_beta2")),
        c.optim(role, "adam_epsilon"),
        c.optim(role, "max_grad_norm"),
        c.optim(role, "lr_warmup_steps"),
    )
    optim.lora_merge = getattr(getattr(c, role), "lora_merge", False)  # the PRIME PRM has no LoRA
    if not activation_checkpointed(model):  # a role that does not save memory reuses it
        keep_freed_memory(role)
    if place.layout is None:  # one process, plain tensors: the embedding's gradient in a kept buffer
        reuse_embedding_gradient(
            model, role
        )  # (llm.utils.memory; a no-op once a role hands its heap back between layers)
    return optim


def offload_idle(c: PPOConfig, role, model, name: str, place: Place, methods: tuple[str, ...]):
    """``offload_when_idle`` when ``<name>.offload`` asks for it and there is a device to leave."""
    if not getattr(c, name).offload:
        return role
    if place.layout is not None:
        raise UserError(
            f"{name}.offload with {name} sharded over an FSDP2 group: not supported; give {name} one device, or "
            "leave the shards where they are (each rank holds only its part)"
        )
    if torch.device(place.device).type == "cpu":
        logger.info("%s.offload: %s runs on the CPU, nothing to offload", name, name)
        return role
    logger.info("%s.offload: the %s model stays in host memory between its forwards", name, name)
    return offload_when_idle(role, model, place.device, methods)
