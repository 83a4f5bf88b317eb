"""The two sides of the PPO benchmarks (``bench_ppo.py``, ``bench_ppo_drift.py``): tiny models, our trainer and
TRL 1.12's ``PPOTrainer`` over them, and the matched settings of the TRL parity test.

``parity_models``, ``parity_trl_args`` and ``parity_ours_config`` are the matched settings of the TRL parity
test, ``tests/test_ppo_trl_parity.py``, which imports them from here (bench does not import tests).
"""

from __future__ import annotations

import copy

# the parity test's learning-math constants (tests/test_ppo_trl_parity.py)
PARITY_KL_COEF, PARITY_VF_COEF = 0.05, 0.1


def four_models(
    attn: str, seeds=(1, 2, 3), vocab: int = 648, eos_bias: float = 0.0, eos_id: int = 2, model_type="llama", **sizes
):
    """(policy, reference = a copy of the policy, critic, reward): random models of ``tiny_config(model_type,
    vocab, **sizes)`` (Llamas by default), seeded per model. ``eos_bias``: the policy's LM head gets a bias of that much on ``eos_id``, so
    a random policy samples EOS with ~exp(bias) / vocab per token (sampled lengths vary)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from llm.utils.modeling import tiny_config

    cfg = tiny_config(model_type, vocab, pad_token_id=0, num_labels=1, **sizes)
    transformers.set_seed(seeds[0])
    policy = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=attn)
    if eos_bias:
        hidden = policy.lm_head.in_features
        head = torch.nn.Linear(hidden, vocab, bias=True)
        with torch.no_grad():
            head.weight.copy_(policy.lm_head.weight)
            head.bias.zero_()
            head.bias[eos_id] = eos_bias
        policy.lm_head = head
    transformers.set_seed(seeds[1])
    critic = AutoModelForSequenceClassification.from_config(copy.deepcopy(cfg), attn_implementation=attn)
    transformers.set_seed(seeds[2])
    reward = AutoModelForSequenceClassification.from_config(copy.deepcopy(cfg), attn_implementation=attn)
    return policy, copy.deepcopy(policy), critic, reward


def parity_models(attn: str):
    """The parity test's ``models(attn)``: tiny_config defaults, seeds 11, 12, 13."""
    return four_models(attn, seeds=(11, 12, 13))


def parity_trl_args(output_dir: str, batch: int, steps: int, response_len: int, lr: float):
    """TRL's side of the matched math (k1 KL in the reward, GAE, whitening, the clip ranges, no gradient
    clipping needed: TRL never clips here; 2 mini-batches x 2 epochs): the parity test's ``trl_args``."""
    from trl.experimental.ppo import PPOConfig as TRLConfig

    return TRLConfig(
        output_dir=output_dir,
        report_to="none",
        use_cpu=True,
        seed=0,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_mini_batches=2,
        num_ppo_epochs=2,
        total_episodes=batch * steps,
        response_length=response_len,
        temperature=1.0,
        kl_coef=PARITY_KL_COEF,
        kl_estimator="k1",
        cliprange=0.2,
        cliprange_value=0.2,
        vf_coef=PARITY_VF_COEF,
        gamma=1.0,
        lam=0.95,
        whiten_rewards=False,
        learning_rate=lr,
        lr_scheduler_type="constant",
        num_sample_generations=0,
        stop_token=None,
        missing_eos_penalty=None,
        local_rollout_forward_batch_size=batch,
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=10_000,
    )


def parity_ours_config(batch: int, steps: int, lr: float, **actor_rollout):
    """Our side of the same math (``parity_trl_args``), the parity test's ``ours_config``; ``actor_rollout``
    adds rollout settings."""
    from llm.settings.ppo import (
        ActorRolloutSection,
        AlgorithmSection,
        CriticSection,
        DataSection,
        KLCtrlSection,
        PPOConfig,
        RefSection,
        ResourcePool,
        RewardSection,
        TrainingSection,
    )

    return PPOConfig(
        training=TrainingSection(
            seed=0, learning_rate=lr, max_grad_norm=0.0, max_steps=steps, micro_batch_size=batch, report_to="none"
        ),
        actor_rollout=ActorRolloutSection(
            temperature=1.0,
            ppo_mini_batch_size=batch // 2,
            ppo_epochs=2,
            clip_ratio=0.2,
            shuffle_minibatch=False,
            **actor_rollout,
        ),
        critic=CriticSection(
            cliprange_value=0.2,
            critic_mini_batch_size=batch // 2,
            critic_update_epochs=2,
            value_loss_coef=PARITY_VF_COEF,
        ),
        ref=RefSection(),
        reward=RewardSection(type="orm"),
        algorithm=AlgorithmSection(
            adv_estimator="gae",
            gamma=1.0,
            lam=0.95,
            kl_penalty="kl",
            kl_ctrl=KLCtrlSection(type="fixed", kl_coef=PARITY_KL_COEF),
            whiten_advantages=True,
        ),
        data=DataSection(rollout_batch_size=batch),
        resource_pool=ResourcePool(),
    )


def our_trainer(config, prompts: list[list[int]], tok, models, labels: list[str] | None = None):
    """Our ``PPOTrainer`` in this process over ``models`` (policy, ref, critic, reward) and token-id prompts."""
    from llm.alignment.ppo.build import build_from_models as trainer_for_models
    from llm.alignment.ppo.prompts import Prompt

    labels = labels or [""] * len(prompts)
    return trainer_for_models(config, [Prompt(p, s, None) for p, s in zip(prompts, labels)], tok, *models)


def trl_trainer(args, tok, models, prompts: list[list[int]], callbacks=None):
    """TRL's ``PPOTrainer`` over the same ``models`` (policy, ref, critic, reward) and prompts."""
    from datasets import Dataset
    from trl.experimental.ppo import PPOTrainer

    policy, ref, critic, reward = models
    return PPOTrainer(
        args=args,
        processing_class=tok,
        model=policy,
        ref_model=ref,
        reward_model=reward,
        train_dataset=Dataset.from_dict({"input_ids": prompts}),
        value_model=critic,
        callbacks=callbacks,
    )
