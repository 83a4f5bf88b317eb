"""Fields that mean the same in the flat scripts and in PPO's trained roles, declared once.

LoRA with peft, PaddleNLP's names: ``ModelArgument`` (SFT, reward models, DPO) and PPO's actor and critic
sections (``TrainedSection``) inherit ``LoraFields``; ``llm.utils.lora`` checks and applies them for both.

The optimizer, precision, checkpoint and logging fields are not here: the flat scripts take them from
``transformers.TrainingArguments`` (``learning_rate``, ``warmup_steps``, ``bf16`` with ``fp16_opt_level``,
``save_steps``, ``report_to``, ...), PPO from its ``training`` section with per-role overrides, under the same
names where the meaning is the same (``learning_rate``, ``weight_decay``, ``adam_beta1/2``, ``adam_epsilon``,
``max_grad_norm``, ``seed``, ``max_steps``, ``output_dir``, ``overwrite_output_dir``, ``resume_from_checkpoint``,
``save_steps``, ``save_total_limit``, ``logging_steps``, ``report_to``, ``disable_tqdm``,
``gradient_checkpointing``); PPO's ``lr_warmup_steps`` and ``bf16`` (bf16 weights with fp32 master weights,
the flat scripts' ``bf16`` + ``fp16_opt_level: O2``) keep the names of MindSpeed-LLM's files.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
