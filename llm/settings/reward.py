"""Reward-model fields, declared on subclasses of the shared argument dataclasses: only ``run_reward.py`` (and
``serve_reward.py``) accept them, so an SFT or DPO config with ``process_reward`` or ``margin`` stops at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from llm.settings.flat import DataArgument, ModelArgument, TrainingArguments
from llm.settings.shared import reward_token_pair
from llm.utils.errors import UserError

# the PRM kinds run_reward.py trains (the field prm_kind); each is also a step scorer (STEP_SCORERS, same name)
PRM_KINDS = ("discriminative",)


@dataclass
class RewardModelArgument(ModelArgument):
    placeholder_token: str = field(default="ки", metadata={"help": "PRM step placeholder token (one token)."})
    reward_tokens: str = field(
        default="+,-", metadata={"help": "PRM label tokens 'positive,negative'; each must be one token."}
    )
    add_placeholder_token: bool = field(
        default=False,
        metadata={
            "help": "PRM: when placeholder_token is not one token of the tokenizer, add it as a new special token "
            "and resize the model's embeddings (a new, untrained row); false: such a placeholder stops the run."
        },
    )

    # reward_tokens as (positive, negative), parsed once here (not a setting: derived, never fingerprinted)
    label_tokens: tuple[str, str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.label_tokens = reward_token_pair(self.reward_tokens)  # refused at start-up, before any model loads


@dataclass
class RewardTrainingArguments(TrainingArguments):
    script: ClassVar[str] = "rm"
    process_reward: bool = field(default=False, metadata={"help": "true: process reward model (PRM); false: ORM."})
    prm_kind: str = field(
        default="discriminative",
        metadata={
            "help": "PRM: the kind trained and evaluated, one of PRM_KINDS: discriminative (a causal LM read at a "
            "placeholder token after every step: softmax over the two reward tokens)."
        },
    )
    soft_labels: bool = field(
        default=False,
        metadata={
            "help": "PRM: train on the records' soft_labels (llm/run_label.py's Monte Carlo values): binary "
            "cross-entropy of p(+) = softmax([l+, l-])[0] against each step's soft label, its hard label where it "
            "has none; false: cross-entropy against the hard labels."
        },
    )
    margin: float = field(default=0.0, metadata={"help": "ORM: loss -log sigmoid(s_c - s_r - margin)."})
    center_rewards_coefficient: float = field(
        default=0.0, metadata={"help": "ORM: coefficient of mean((s_c + s_r)^2) (reward centering).", "min": 0}
    )
    score_regularization: float = field(
        default=0.0,
        metadata={
            "help": "ORM: coefficient of mean(s_c^2 + s_r^2), an L2 penalty on the scores (PaddleNLP's "
            "regularization).",
            "min": 0,
        },
    )
    prm_threshold: float = field(
        default=0.5,
        metadata={
            "help": "PRM evaluation (ProcessBench): a step scored below it is the predicted first error.",
            "min": 0,
        },
    )
    prm_threshold_subset: str | None = field(
        default=None,
        metadata={
            "help": "PRM evaluation: also find the threshold that maximises ProcessBench F1 on this subset "
            "(ProcessBench tunes it on gsm8k) and report every metric at it."
        },
    )
    bon_aggregations: str = field(
        default="min,product,last,mean",
        metadata={"help": "PRM evaluation, best-of-N: how step scores make a solution's score (comma-separated)."},
    )

    def __post_init__(self) -> None:
        if self.prm_kind not in PRM_KINDS:
            raise UserError(f"prm_kind must be one of {', '.join(PRM_KINDS)}, got {self.prm_kind!r}")
        if self.prm_kind != "discriminative" and not self.process_reward:
            raise UserError(f"prm_kind {self.prm_kind!r} is a PRM's: set process_reward true, or remove prm_kind")
        if self.soft_labels and not self.process_reward:
            raise UserError("soft_labels is a PRM's (step soft labels): set process_reward true, or remove it")
        if self.prm_threshold > 1:
            raise UserError(f"prm_threshold is a probability in [0, 1], got {self.prm_threshold}")
        super().__post_init__()


REWARD_ARGUMENT_TYPES = (RewardModelArgument, DataArgument, RewardTrainingArguments)
