"""The ``prime`` section of a PPO config: PRIME (Cui et al. 2025, "Process Reinforcement through Implicit Rewards"),
an implicit PRM trained online from the verifier's outcomes, its dense rewards and the outcome reward turned into
advantages separately (leave-one-out within each prompt's group) and summed with coefficients (the schema; the
math: ``llm.alignment.ppo.prime``; the checks against the other sections: ``llm.settings.prime_validation``).

The section is absent (None) unless the file or the command line gives it; given, the run's ``reward`` (one section
or a list) is the outcome verifier (a rule, e.g. ``math_exact_match``, or an HTTP scorer, answering in [0, 1]) and
``algorithm.adv_estimator`` is ``rloo``, as verl's PRIME recipe sets it. verl's names: ``reward_model.model.update``
(``update``), ``beta_train`` (``beta``), ``prime_granularity`` (``granularity``), ``prime_norm`` (``norm``),
``algorithm.reward_gt_coef`` (``outcome_coef``), ``algorithm.reward_dpo_coef`` (``process_coef``).
"""

from __future__ import annotations

from dataclasses import dataclass

from llm.settings.fields import help_field as _f

UPDATES = ("before", "after", "none")
GRANULARITIES = ("token", "whole")
NORMS = ("batch_norm", "none")


@dataclass
class PrimeSection:
    """The implicit PRM ``r_t = beta * log(pi_phi(y_t) / pi_ref(y_t))``, its online update and PRIME's advantages."""

    model_name_or_path: str | None = _f(
        None,
        "the implicit PRM's initial model (trained online); null: the actor's model (PRIME's default, the SFT "
        "model), with actor_rollout.init_from_config. It reads the actor's token ids: the actor's vocabulary",
    )
    init_from_config: bool = _f(False, "a model_name_or_path of its own: seeded random weights from its config")
    ref_model_name_or_path: str | None = _f(
        None, "the PRM's frozen reference pi_ref; null: the PRM's initial model (the same weights)"
    )
    beta: float = _f(0.05, "the implicit reward's scale (verl: beta_train), > 0", low=0)
    update: str = _f(
        "before",
        "when the PRM trains on a step's rollouts (verl: reward_model.model.update): before (update on the "
        "verifier's outcomes, then score with the updated PRM), after (score with the PRM as it was, then update) "
        "or none (a frozen PRM)",
    )
    granularity: str = _f(
        "token",
        "the process rewards (verl: prime_granularity): token (beta * log-ratio at every token) or whole (their "
        "sum at the last token)",
    )
    norm: str = _f(
        "batch_norm",
        "verl's prime_norm: batch_norm divides the process rewards by the largest |return| of the batch (the "
        "largest absolute reverse cumulative sum), none leaves them",
    )
    outcome_coef: float = _f(5.0, "the outcome (verifier) advantages' weight (verl: reward_gt_coef), >= 0", low=0)
    process_coef: float = _f(5.0, "the process (implicit PRM) advantages' weight (verl: reward_dpo_coef), >= 0", low=0)
    learning_rate: float | None = _f(None, "the PRM's AdamW learning rate; null: training.learning_rate", low=0)
    weight_decay: float | None = _f(None, "null: training.weight_decay", low=0)
    adam_beta1: float | None = _f(None, "null: training.adam_beta1", low=0)
    adam_beta2: float | None = _f(None, "null: training.adam_beta2", low=0)
    adam_epsilon: float | None = _f(None, "null: training.adam_epsilon", low=0)
    max_grad_norm: float | None = _f(None, "null: training.max_grad_norm (verl: grad_clip)", low=0)
    lr_warmup_steps: int | None = _f(None, "null: training.lr_warmup_steps", low=0)
    mini_batch_size: int | None = _f(
        None, "samples per PRM optimizer step; null: the whole step's rollouts (one step per update epoch)", low=1
    )
    update_epochs: int = _f(1, "passes of the PRM's update over a step's rollouts", low=1)
    micro_batch_size: int | None = _f(None, "samples per PRM forward; null: training.micro_batch_size", low=1)
