"""DPO fields, declared once on subclasses of the shared argument dataclasses (only ``run_dpo.py`` accepts them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from llm.settings.flat import DataArgument, ModelArgument, TrainingArguments
from llm.settings.registry import DPO_LOSSES
from llm.utils.errors import UserError


@dataclass
class DPOModelArgument(ModelArgument):
    ref_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Frozen reference model (usually the SFT model). Default: a frozen copy of the initial policy "
            "(model_name_or_path). Required for evaluation-only runs of losses that use a reference."
        },
    )


@dataclass
class DPOTrainingArguments(TrainingArguments):
    script: ClassVar[str] = "dpo"
    loss_type: str = field(
        default="sigmoid",
        metadata={
            "help": "Preference loss, a registered loss_type: sigmoid | hinge | ipo | simpo | orpo (formulas in "
            "llm/alignment/dpo/loss.py)."
        },
    )
    beta: float = field(
        default=0.1,
        metadata={
            "help": "DPO/hinge/SimPO temperature beta; IPO's tau; ORPO's lambda (weight of the odds-ratio term)."
        },
    )
    label_smoothing: float = field(
        default=0.0,
        metadata={"help": "sigmoid (cDPO) and simpo: probability that a preference label is flipped, in [0, 0.5)."},
    )
    reference_free: bool = field(
        default=False,
        metadata={"help": "sigmoid/hinge/ipo: no reference model (its log-probs are taken as 0)."},
    )
    simpo_gamma: float = field(default=0.5, metadata={"help": "SimPO target reward margin gamma."})
    sft_loss_weight: float = field(
        default=0.0,
        metadata={
            "help": "Weight of an SFT term on the chosen answer: per-pair mean NLL of its tokens (RPO). TRL<1.0 "
            "calls it rpo_alpha, TRL 1.12 loss_type ['sigmoid', 'sft'], PaddleNLP sft_loss_ratio. Not with orpo, "
            "which has its own NLL term."
        },
    )
    precompute_ref_log_probs: bool = field(
        default=False,
        metadata={
            "help": "Compute the reference log-probs of every pair once before training, then free the reference "
            "model (saves its memory and forward passes). Not with lazy streaming."
        },
    )

    def __post_init__(self) -> None:
        spec = DPO_LOSSES.lookup(self.loss_type)
        if self.beta <= 0:
            raise UserError(f"beta must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise UserError(f"label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and not spec.label_smoothing:
            smoothed = [name for name, s in DPO_LOSSES.items() if s.label_smoothing]
            raise UserError(
                f"label_smoothing has no effect with loss_type={self.loss_type!r}: set it to 0 "
                f"(it applies to {' and '.join(smoothed)})"
            )
        if self.sft_loss_weight < 0:
            raise UserError(f"sft_loss_weight must be >= 0, got {self.sft_loss_weight}")
        if self.sft_loss_weight and spec.nll_term:
            raise UserError(
                f"sft_loss_weight: {self.loss_type} already includes its NLL term; set sft_loss_weight to 0"
            )
        if self.reference_free and not spec.needs_reference:
            raise UserError(f"reference_free: loss_type={self.loss_type!r} has no reference anyway; set it false")
        if self.precompute_ref_log_probs and not self.uses_reference:
            raise UserError(
                f"precompute_ref_log_probs: loss_type={self.loss_type!r}"
                f"{' with reference_free' if self.reference_free else ''} uses no reference model; set it false"
            )
        super().__post_init__()

    @property
    def uses_reference(self) -> bool:
        return DPO_LOSSES.lookup(self.loss_type).needs_reference and not self.reference_free


DPO_ARGUMENT_TYPES = (DPOModelArgument, DataArgument, DPOTrainingArguments)
