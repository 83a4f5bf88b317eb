"""Reward-model fields, declared on subclasses of the shared argument dataclasses: only ``run_reward.py`` (and
``serve_reward.py``) accept them, so an SFT or DPO config with ``process_reward`` or ``margin`` stops at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from llm.settings.flat import DataArgument, ModelArgument, TrainingArguments
from llm.settings.shared import reward_token_pair
from llm.utils.errors import UserError

# the PRM kinds run_reward.py trains (the field prm_kind); each is also a step scorer (STEP_SCORERS, same name)
PRM_KINDS = ("discriminative", "generative", "implicit")
IMPLICIT_LOSSES = ("ce", "dpo")  # prm_kind implicit: the outcome loss (implicit_loss)


@dataclass
class RewardModelArgument(ModelArgument):
    placeholder_token: str = field(default="ки", metadata={"help": "PRM step placeholder token (one token)."})
    reward_tokens: str = field(
        default="+,-", metadata={"help": "PRM label tokens 'positive,negative'; each must be one token."}
    )
    implicit_reference: str | None = field(
        default=None,
        metadata={
            "help": "prm_kind implicit: the frozen reference model pi_ref of r(y) = implicit_beta * log(pi(y) / "
            "pi_ref(y)). Default: a frozen copy of the initial model (model_name_or_path), or, in an "
            "evaluation-only run of a trained implicit PRM, the reference its output directory names "
            "(implicit_prm.json)."
        },
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
            "placeholder token after every step: softmax over the two reward tokens); generative (a causal LM that writes "
            "a critique of every step, then a verdict token of reward_tokens: the step's score is p(positive verdict) "
            "after its critique; training data with a 'critiques' list); implicit (a causal LM "
            "trained from outcome labels, r(y) = implicit_beta * log(pi(y) / pi_ref(y)); a step's process reward "
            "is implicit_beta times the sum of its tokens' log-ratios). See docs/reward-models.md."
        },
    )
    implicit_beta: float = field(
        default=0.05,
        metadata={"help": "prm_kind implicit: beta of the implicit reward r(y) = beta * log(pi(y) / pi_ref(y))."},
    )
    implicit_loss: str = field(
        default="ce",
        metadata={
            "help": "prm_kind implicit: ce (PRM records with a 0/1 outcome: binary cross-entropy of sigmoid(r(y))) "
            "or dpo (preference pairs, correct over wrong: -log sigmoid(r(y_c) - r(y_r)))."
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
    critique_loss_weight: float = field(
        default=1.0,
        metadata={
            "help": "Generative PRM: the loss weight of every critique token (0: train the verdicts only).",
            "min": 0,
        },
    )
    verdict_loss_weight: float = field(
        default=1.0, metadata={"help": "Generative PRM: the loss weight of every verdict token.", "min": 0}
    )
    critique_samples: int = field(
        default=1,
        metadata={
            "help": "Generative PRM scoring: critiques written per solution (each a pass over all its steps); a "
            "step's score is the mean of their p(positive verdict). More than 1 needs critique_temperature > 0.",
            "min": 1,
        },
    )
    max_critique_tokens: int = field(
        default=64,
        metadata={
            "help": "Generative PRM scoring: the most tokens of one step's critique; the verdict is read after it "
            "when the model has not written one by then.",
            "min": 0,
        },
    )
    critique_temperature: float = field(
        default=0.0,
        metadata={"help": "Generative PRM scoring: sampling temperature of the critiques; 0: greedy.", "min": 0},
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
    head_learning_rate: float | None = field(
        default=None,
        metadata={
            "help": "ORM: the peak learning rate of the score head, a new randomly initialised layer (the same "
            "warmup and schedule as learning_rate, which the rest of the model keeps); null: learning_rate. A head "
            "rate 10-100x the backbone's lets the head fit before the pretrained layers drift "
            "(linear-probe-then-fine-tune).",
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
        if self.prm_kind == "generative":
            if self.soft_labels:
                raise UserError("soft_labels is the discriminative PRM's: a generative PRM trains on its verdicts")
            if self.critique_samples > 1 and self.critique_temperature == 0:
                raise UserError(
                    f"critique_samples {self.critique_samples} with critique_temperature 0: greedy critiques are all "
                    "the same; set critique_temperature > 0 (e.g. 0.7) or critique_samples 1"
                )
            if self.critique_loss_weight == 0 and self.verdict_loss_weight == 0:
                raise UserError("critique_loss_weight and verdict_loss_weight are both 0: nothing to train")
        elif self.prm_kind == "implicit":
            if self.implicit_loss not in IMPLICIT_LOSSES:
                raise UserError(
                    f"implicit_loss must be one of {', '.join(IMPLICIT_LOSSES)}, got {self.implicit_loss!r}"
                )
            if not self.implicit_beta > 0:
                raise UserError(f"implicit_beta must be > 0, got {self.implicit_beta}")
            if self.soft_labels:
                raise UserError(
                    "soft_labels is the discriminative PRM's (step targets): prm_kind implicit trains "
                    "from outcomes; remove soft_labels"
                )
        if self.prm_kind != "implicit" and (self.implicit_loss != "ce" or self.implicit_beta != 0.05):
            raise UserError(
                "implicit_loss / implicit_beta are prm_kind implicit's: set prm_kind implicit, or remove them"
            )
        if self.head_learning_rate is not None and self.process_reward:
            raise UserError(
                "head_learning_rate is an ORM's (its new score head): a PRM reads the model's own LM head, trained "
                "at learning_rate; remove head_learning_rate"
            )
        if self.soft_labels and not self.process_reward:
            raise UserError("soft_labels is a PRM's (step soft labels): set process_reward true, or remove it")
        if self.prm_threshold > 1:
            raise UserError(f"prm_threshold is a probability in [0, 1], got {self.prm_threshold}")
        super().__post_init__()


REWARD_ARGUMENT_TYPES = (RewardModelArgument, DataArgument, RewardTrainingArguments)
