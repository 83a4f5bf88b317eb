"""Fields that mean the same in the flat scripts and in PPO's trained roles, declared once.

- ``LoraFields`` (LoRA with peft, PaddleNLP's names): ``ModelArgument`` (SFT, reward models, DPO) and PPO's
  actor and critic sections (``TrainedSection``); ``llm.utils.lora`` checks and applies them for both.
- ``OptimizerFields`` (AdamW): the flat ``TrainingArguments`` (over transformers' own definitions, same
  defaults) and PPO's ``training`` section (``learning_rate`` 1e-6 there: ``with_default``); a trained role
  overrides each one with its own value (``TrainedSection``: null = the ``training`` value).

Checkpoint and logging fields have the same names in both (``seed``, ``max_steps``, ``output_dir``,
``overwrite_output_dir``, ``resume_from_checkpoint``, ``save_steps``, ``save_total_limit``, ``logging_steps``,
``report_to``, ``disable_tqdm``) but not one definition: transformers types the step counts as floats (a
fraction of the run) and PPO as whole numbers. Precision differs in meaning: the flat ``bf16`` autocasts
unless ``fp16_opt_level`` is O2, PPO's ``training.bf16`` is always O2 (bf16 weights, fp32 master weights).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from llm.utils.errors import UserError


@dataclass
class LoraFields:
    lora: bool = field(
        default=False,
        metadata={
            "help": "Train LoRA adapters (peft) on a frozen base model instead of every weight (a PPO critic: and "
            "its score head)."
        },
    )
    lora_rank: int = field(default=8, metadata={"help": "LoRA rank r (> 0)."})
    lora_alpha: float = field(
        default=-1,
        metadata={"help": "LoRA alpha (> 0); -1 (PaddleNLP's default): 2 * lora_rank, or 4 with rslora."},
    )
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA input, in [0, 1)."})
    target_modules: str | list[str] | None = field(
        default=None,
        metadata={
            "help": "Module names that get adapters (a list, or comma-separated), matched as peft does (the end of a "
            "module's name); default the attention and MLP projections q_proj,k_proj,v_proj,o_proj,gate_proj,"
            "up_proj,down_proj."
        },
    )
    rslora: bool = field(
        default=False, metadata={"help": "Rank-stabilised LoRA: scale alpha / sqrt(r), not alpha / r."}
    )
    lora_path: str | None = field(
        default=None,
        metadata={"help": "Continue training the PEFT adapter saved in this directory (its own rank and targets)."},
    )
    lora_merge: bool = field(
        default=False,
        metadata={
            "help": "With lora: also write the base model with the adapter merged in, a plain Hugging Face "
            "checkpoint, to <output dir>/merged (PPO: <role dir>/merged); the output dir itself holds the adapter."
        },
    )


@dataclass
class OptimizerFields:
    learning_rate: float = field(default=5e-5, metadata={"help": "AdamW learning rate (peak, after warmup).", "min": 0})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW decoupled weight decay.", "min": 0})
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1, in [0, 1).", "min": 0})
    adam_beta2: float = field(default=0.999, metadata={"help": "AdamW beta2, in [0, 1).", "min": 0})
    adam_epsilon: float = field(default=1e-8, metadata={"help": "AdamW epsilon.", "min": 0})
    max_grad_norm: float = field(
        default=1.0, metadata={"help": "Gradient clipping (global L2 norm); 0: none.", "min": 0}
    )


def with_default(cls: type, name: str, default: Any) -> Any:
    """Field ``name`` of dataclass ``cls`` (its help and bounds) with another default, for a schema whose
    default differs (PPO's learning rate)."""
    original = next(f for f in dataclasses.fields(cls) if f.name == name)
    return field(default=default, metadata=original.metadata)


def reward_token_pair(value: str | Sequence[str], field: str = "reward_tokens") -> tuple[str, str]:
    """A PRM's two label tokens, ``"positive,negative"`` (or a pair), as ``(positive, negative)``: the one parser of
    the setting for the flat reward scripts, the data readers and PPO's PRM reward (each checks at config time)."""
    tokens = [t.strip() for t in value.split(",")] if isinstance(value, str) else list(value)
    if len(tokens) != 2 or not all(isinstance(t, str) and t for t in tokens) or tokens[0] == tokens[1]:
        raise UserError(
            f"{field} must be two different tokens 'positive,negative' (the positive label first, e.g. \"+,-\"), "
            f"got {value!r}"
        )
    return tokens[0], tokens[1]


def check_reward_url(url: str) -> None:
    """``reward.url`` must be an http:// or https:// URL with a host (never file://, ftp://, ...)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError as err:
        raise UserError(f"reward.url {url!r} is not a valid URL ({err})") from None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise UserError(
            f"reward.url {url!r}: only http:// and https:// URLs with a host are allowed (e.g. "
            "http://127.0.0.1:8000/score)"
        )
