"""A trained role's checkpoint directory: the model in Hugging Face format with its tokenizer, and the
optimizer + LR schedule state beside it as ``optimizer.json`` (param_groups, scheduler, ...) and
``optimizer.safetensors`` (moments, fp32 masters): nothing pickled. The optimizer state is keyed by
parameter name, so it loads under any FSDP2 group size and into either optimizer kind (optim.py,
offload.py). A LoRA role (peft) saves its adapter instead of the model (``adapter_config.json`` +
``adapter_model.safetensors``, which ``PeftModel.from_pretrained`` loads) and its optimizer state covers the
adapters (and head) only: on resume the frozen base is read again from ``model_name_or_path``."""

from __future__ import annotations

import os
from collections.abc import Callable

from torch.distributed.checkpoint.state_dict import set_model_state_dict

from llm.alignment.ppo.fsdp import FULL, first_rank
from llm.utils.checkpoints import load_tree, read_safetensors, save_tree
from llm.utils.disk_full import disk_full_as_error
from llm.utils.errors import UserError
from llm.utils.lora import is_peft_model, save_merged

OPTIMIZER_STATE = "optimizer"
OPTIMIZER_FILE = "optimizer.safetensors"
ADAPTER_FILE = "adapter_model.safetensors"

__all__ = ["OPTIMIZER_FILE", "OPTIMIZER_STATE", "load_optimizer_state", "load_weights", "read_safetensors", "save"]


def save(
    directory: str, model, tokenizer, scheduler, optimizer_state: Callable[[], dict] | None, merged: bool = False
) -> None:
    """``model`` (+ ``tokenizer``) in ``directory``; with ``optimizer_state`` (a checkpoint) also that state and
    the scheduler's; with ``merged`` (a LoRA role's ``lora_merge``) also ``directory/merged``, the base with the
    adapter merged in. Every rank of an FSDP2 group calls this (the gathers are collective); the first writes."""
    with disk_full_as_error(directory):  # a role on Ray: a DiskFull reaches the driver as itself
        model.save_pretrained(directory)
        if merged and is_peft_model(model) and first_rank():
            save_merged(model, directory, tokenizer)
        optimizer = optimizer_state() if optimizer_state is not None else None
        if not first_rank():
            return
        tokenizer.save_pretrained(directory)
        if optimizer is not None:
            save_tree(directory, OPTIMIZER_STATE, {"optimizer": optimizer, "scheduler": scheduler.state_dict()})


def load_weights(model, directory: str) -> None:
    """The saved full weights into ``model``, strictly (every parameter, no stray key); each FSDP2 rank keeps
    its shard. Tied weights (an LM head sharing the embedding) are saved once and loaded so. A LoRA model gets
    the saved adapter (and head) back, strictly too; its base stays as loaded."""
    if is_peft_model(model):
        _load_adapter(model, directory)
        return
    set_model_state_dict(model, read_safetensors(os.path.join(directory, "model.safetensors")), options=FULL)


def _load_adapter(model, directory: str) -> None:
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    path = os.path.join(directory, ADAPTER_FILE)
    if not os.path.isfile(path):
        raise UserError(
            f"{directory}: no {ADAPTER_FILE}: this run trains LoRA adapters (lora true) but the checkpoint holds "
            "no adapter (a full fine-tuning run's?); resume with the lora settings it was saved with"
        )
    state = read_safetensors(path)
    missing = sorted(set(get_peft_model_state_dict(model)) - set(state))
    unexpected = list(set_peft_model_state_dict(model, state).unexpected_keys)
    if unexpected or missing:
        raise UserError(
            f"{path}: the adapter does not fit this run's model (unexpected {unexpected[:3]}, missing "
            f"{missing[:3]}); resume with the lora settings (rank, targets) it was saved with"
        )


def load_optimizer_state(directory: str) -> dict:
    """What ``save`` wrote (JSON + safetensors; an older pickled optimizer.pt is refused, not read)."""
    if not os.path.isfile(os.path.join(directory, f"{OPTIMIZER_STATE}.json")):
        old = os.path.join(directory, "optimizer.pt")
        if os.path.isfile(old):
            raise UserError(
                f"{old}: an optimizer state pickled by an older version; pickles can run code when loaded, so it is "
                "not read: resume from a checkpoint saved by this version"
            )
        raise UserError(
            f"{directory}: no {OPTIMIZER_STATE}.json; the checkpoint is incomplete: resume from another one"
        )
    state = load_tree(directory, OPTIMIZER_STATE)
    if not isinstance(state, dict) or not {"optimizer", "scheduler"} <= set(state):
        raise UserError(f"{directory}/{OPTIMIZER_STATE}.json: not an optimizer state; the checkpoint is damaged")
    return state
