"""Truncated importance sampling for the engine / trainer mismatch (``actor_rollout.rollout_is_cap``): the
weights by hand, in the policy loss, and through a PPO step (the engine's log-probs shifted by a known amount)."""

import math

import pytest
import torch

from llm.alignment.ppo.algorithm import truncated_is_weights
from llm.alignment.ppo.build import PPOContext, build_ppo, load_prompts, placed_roles
from llm.alignment.ppo.objectives import policy_loss
from llm.settings.load import parse_ppo_config
from llm.utils.errors import UserError
from tests.test_ppo_run import config


def test_weights_by_hand():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, 0.0]])
    engine = torch.tensor([[-1.0, -2.5, -3.0], [-2.0, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    w = truncated_is_weights(old, engine, mask, cap=2.0)
    # exp(0) = 1; exp(0.5) = 1.6487; exp(2.5) = 12.18 -> cap 2; exp(-1) = 0.3679 (not raised); masked -> 0
    expected = torch.tensor([[1.0, math.exp(0.5), 2.0], [math.exp(-1.0), 1.0, 0.0]])
    torch.testing.assert_close(w, expected)
    assert not w.requires_grad


def test_weights_scale_each_tokens_policy_loss():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]], requires_grad=True)
    old = torch.tensor([[-1.1, -2.0], [-0.5, -1.0]])
    adv = torch.tensor([[1.0, -1.0], [0.5, 2.0]])
    mask = torch.ones(2, 2)
    w = torch.tensor([[2.0, 1.0], [0.5, 1.0]])
    plain = policy_loss(logp, old, adv, mask, 0.2, 0.2)
    weighted = policy_loss(logp, old, adv, mask, 0.2, 0.2, weights=w)
    # per token max(-A r, -A clip(r)), r = exp(logp - old):
    r = [[math.exp(0.1), 1.0], [1.0, math.exp(-0.5)]]
    per = [
        [max(-1.0 * r[0][0], -1.0 * min(r[0][0], 1.2)), max(1.0 * r[0][1], 1.0 * r[0][1])],
        [max(-0.5 * r[1][0], -0.5 * r[1][0]), max(-2.0 * r[1][1], -2.0 * max(r[1][1], 0.8))],
    ]
    assert plain.loss.item() == pytest.approx(sum(map(sum, per)) / 4, abs=1e-6)
    expected = (2.0 * per[0][0] + per[0][1] + 0.5 * per[1][0] + per[1][1]) / 4
    assert weighted.loss.item() == pytest.approx(expected, abs=1e-6)


def first_step(path, shift: float | None = None):
    """One PPO step of ``path``; with ``shift``, the engine's log-probs are moved by ``shift`` (a known mismatch)."""
    c = parse_ppo_config([path])
    run = PPOContext.load(c)
    with placed_roles(c, run) as roles:
        trainer = build_ppo(c, load_prompts(c, run), roles, run)
        if shift is not None:
            generate = trainer.actor.generate

            def shifted(*args, **kwargs):
                responses, logprobs = generate(*args, **kwargs)
                lengths = torch.tensor([len(r) for r in responses])
                mask = torch.arange(logprobs.shape[1])[None, :] < lengths[:, None]
                return responses, (logprobs + shift) * mask

            trainer.actor.generate = shifted
        return trainer.train_step()


ONE_UPDATE = {"ppo_mini_batch_size": 8, "ppo_epochs": 1, "max_response_length": 6}
RAW_ADVANTAGES = {"whiten_advantages": False}  # whitened, the first forward's policy loss is -mean(A) = 0


def cfg(tmp_path, **actor):
    return config(tmp_path, actor_rollout={**ONE_UPDATE, **actor}, algorithm=RAW_ADVANTAGES)


def test_a_known_mismatch_scales_the_policy_loss(tmp_path):
    """One mini-batch, one epoch: the update's first (and only) forward is at pi_old, so with every engine
    log-prob lowered by 0.5 each weight is e^0.5 and the policy loss is e^0.5 times the uncorrected one; lowered
    by 2, the weights hit the cap 3. The sampled responses and everything else are the same."""
    plain = first_step(cfg(tmp_path))
    assert "rollout_is_weight" not in plain
    assert abs(plain["policy_loss"]) > 1e-3  # something to scale
    exact = first_step(cfg(tmp_path, rollout_is_cap=3.0))
    # no shift: HF generate's log-probs vs the packed forward, float rounding only
    assert exact["rollout_logprob_gap"] < 1e-4
    assert exact["rollout_is_weight"] == pytest.approx(1.0, abs=1e-4)
    assert exact["policy_loss"] == pytest.approx(plain["policy_loss"], rel=1e-4, abs=1e-6)
    half = first_step(cfg(tmp_path, rollout_is_cap=3.0), shift=-0.5)
    assert half["rollout_is_weight"] == pytest.approx(math.exp(0.5), rel=1e-4)
    assert half["rollout_logprob_gap"] == pytest.approx(0.5, abs=1e-4)
    assert half["policy_loss"] == pytest.approx(math.exp(0.5) * plain["policy_loss"], rel=1e-4)
    capped = first_step(cfg(tmp_path, rollout_is_cap=3.0), shift=-2.0)
    assert capped["rollout_is_weight"] == pytest.approx(3.0, rel=1e-6)
    assert capped["policy_loss"] == pytest.approx(3.0 * plain["policy_loss"], rel=1e-4)
    assert capped["score"] == plain["score"]  # same samples


def test_rollout_is_cap_is_checked(tmp_path):
    with pytest.raises(UserError, match="rollout_is_cap with rollout_log_probs true: the old log-probs would be"):
        parse_ppo_config([config(tmp_path, actor_rollout={"rollout_is_cap": 2.0, "rollout_log_probs": True})])
    with pytest.raises(UserError, match="rollout_is_cap"):
        parse_ppo_config([config(tmp_path, actor_rollout={"rollout_is_cap": 0.5})])
    with pytest.raises(UserError, match="rollout_is_cap with rollout_engine vllm needs do_sample true"):
        parse_ppo_config(
            [config(tmp_path, actor_rollout={"rollout_is_cap": 2.0, "rollout_engine": "vllm", "top_k": 5})]
        )
