"""Checking a PPO config's ``prime`` section (``llm.settings.prime``) against the other sections: what PRIME needs of
the reward (an outcome verifier), the advantage estimator and the placement."""

from __future__ import annotations

import math

from llm.settings.ppo import PPOConfig
from llm.settings.prime import GRANULARITIES, NORMS, UPDATES
from llm.settings.reward_list import labels
from llm.utils.errors import UserError, closest

VERIFIER_TYPES = ("rule", "http")  # rewards that answer an outcome (0/1, or a soft label in [0, 1])


def validate_prime(c: PPOConfig, path: str) -> None:
    p = c.prime
    if p is None:
        return
    for name, value, valid in (("update", p.update, UPDATES), ("granularity", p.granularity, GRANULARITIES),
                               ("norm", p.norm, NORMS)):  # fmt: skip
        if value not in valid:
            raise UserError(
                f"{path}: prime.{name} must be one of {', '.join(valid)}, got {value!r} (closest: "
                f"{closest(str(value), valid)})"
            )
    for name in ("beta", "outcome_coef", "process_coef"):
        value = getattr(p, name)
        if not math.isfinite(value):
            raise UserError(f"{path}: prime.{name} must be a finite number, got {value!r}")
    if p.beta <= 0:
        raise UserError(f"{path}: prime.beta must be > 0 (the implicit reward's scale; verl's default 0.05), got 0")
    if p.outcome_coef == 0 and p.process_coef == 0:
        raise UserError(
            f"{path}: prime.outcome_coef and prime.process_coef are both 0: no advantage is left; give at least one "
            "a positive weight (verl's recipe: 5 and 5)"
        )
    for beta in ("adam_beta1", "adam_beta2"):
        if c.optim("prime", beta) >= 1:
            raise UserError(f"{path}: {beta} of prime must be in [0, 1), got {c.optim('prime', beta)}")
    if p.update != "none" and c.lr("prime") == 0:
        raise UserError(
            f"{path}: the implicit PRM's learning_rate is 0 (prime.learning_rate, else training.learning_rate) with "
            f"prime.update {p.update}: give a positive learning rate, or set prime.update none (a frozen PRM)"
        )
    for r, label in zip(c.rewards, labels(c)):
        if r.type not in VERIFIER_TYPES:
            raise UserError(
                f"{path}: {label}.type {r.type!r} with a prime section: PRIME's process rewards come from its own "
                "implicit PRM, and the run's reward is the outcome verifier that trains it: give reward a "
                f"{' or '.join(VERIFIER_TYPES)} reward answering in [0, 1] (e.g. rule "
                "llm.alignment.ppo.rewards.rule_functions:math_exact_match)"
            )
    alg = c.algorithm
    if alg.adv_estimator != "rloo":
        raise UserError(
            f"{path}: algorithm.adv_estimator {alg.adv_estimator!r} with a prime section: PRIME's advantages are "
            "leave-one-out (RLOO) on the outcome and on the process rewards, summed: set algorithm.adv_estimator rloo"
        )
    if alg.kl_in_reward:
        raise UserError(
            f"{path}: algorithm.use_kl_in_reward with a prime section: PRIME's returns are the outcome and process "
            "rewards only; set algorithm.use_kl_in_reward false (a KL term: algorithm.kl_loss_coef, as verl's recipe)"
        )
    if c.resource_pool.use_ray:
        raise UserError(f"{path}: prime with resource_pool.use_ray: not supported yet (the PRM trains in this process)")
    if c.environment is not None:
        raise UserError(f"{path}: prime with an environment (multi-turn episodes): not supported; remove one of them")
    if p.mini_batch_size is not None:
        batch = c.data.rollout_batch_size * c.actor_rollout.num_samples_per_step
        if batch % p.mini_batch_size:
            raise UserError(
                f"{path}: prime.mini_batch_size={p.mini_batch_size} must divide rollout_batch_size x "
                f"num_samples_per_step = {batch}"
            )
    if p.model_name_or_path is None and p.init_from_config:
        raise UserError(
            f"{path}: prime.init_from_config without prime.model_name_or_path: the PRM is then the actor's model, "
            "loaded as actor_rollout.init_from_config says; remove it"
        )
