"""PPO math: hand-derived values and naive loops as oracles for the vectorised code."""

import math

import pytest
import torch

from llm.alignment.ppo.algorithm import (
    AdaptiveKLController,
    RunningMoments,
    discounted_returns,
    full_kl,
    gae,
    group_advantages,
    kl_estimate,
    masked_whiten,
    token_rewards,
    value_loss,
)
from llm.alignment.ppo.objectives import policy_loss


def naive_gae(rewards, values, lengths, gamma, lam):
    adv = torch.zeros_like(rewards)
    for b, n in enumerate(lengths):
        running = 0.0
        for t in reversed(range(n)):
            next_v = values[b, t + 1].item() if t + 1 < n else 0.0
            delta = rewards[b, t].item() + gamma * next_v - values[b, t].item()
            running = delta + gamma * lam * running
            adv[b, t] = running
    return adv


def mask_of(lengths, T):
    return (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).float()


def test_gae_hand_values():
    # One sequence of 2 tokens, gamma = 1, lam = 1: A_1 = r_1 - V_1 = 1 - 0.5 = 0.5,
    # A_0 = r_0 + V_1 - V_0 + A_1 - V_1 ... = (0 + 0.5 - 0.2) + 0.5 = 0.8; returns = A + V = [1.0, 1.0].
    rewards = torch.tensor([[0.0, 1.0]])
    values = torch.tensor([[0.2, 0.5]])
    adv, ret = gae(rewards, values, torch.ones(1, 2), 1.0, 1.0)
    assert torch.allclose(adv, torch.tensor([[0.8, 0.5]]))
    assert torch.allclose(ret, torch.tensor([[1.0, 1.0]]))


def test_gae_equals_naive_loop_with_padding():
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 3, 1, 4]
    T = 5
    mask = mask_of(lengths, T)
    rewards = torch.randn(4, T, generator=gen) * mask
    values = torch.randn(4, T, generator=gen)  # garbage past the end must be ignored
    adv, ret = gae(rewards, values, mask, 0.99, 0.95)
    oracle = naive_gae(rewards, values, lengths, 0.99, 0.95)
    assert torch.allclose(adv, oracle * mask, rtol=1e-5, atol=1e-6)
    assert torch.allclose(ret, (oracle + values) * mask, rtol=1e-5, atol=1e-6)


def test_kl_estimators_hand_values():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    # log ratio = 0.5: k1 = 0.5, abs = 0.5, k2 = 0.125, k3 = e^-0.5 + 0.5 - 1 = 0.106531
    assert kl_estimate(logp, ref, "kl").item() == pytest.approx(0.5)
    assert kl_estimate(ref, logp, "abs").item() == pytest.approx(0.5)
    assert kl_estimate(logp, ref, "mse").item() == pytest.approx(0.125)
    assert kl_estimate(logp, ref, "low_var_kl").item() == pytest.approx(math.exp(-0.5) - 0.5, abs=1e-6)
    with pytest.raises(ValueError):
        kl_estimate(logp, ref, "nope")


def test_full_kl_matches_definition():
    p = torch.tensor([[0.0, math.log(3.0)]])  # probs 1/4, 3/4
    q = torch.tensor([[0.0, 0.0]])  # probs 1/2, 1/2
    expected = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert full_kl(p, q).item() == pytest.approx(expected, abs=1e-6)


def test_token_rewards_put_score_on_last_token():
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    r = token_rewards(kl, torch.tensor([1.0, 2.0]), mask, kl_coef=0.5)
    assert torch.allclose(r, torch.tensor([[-0.05, -0.1, 0.85], [-0.2, 1.75, 0.0]]))


def test_group_advantages():
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    # rloo, group of 3: [1 - 0, 0 - 0.5, 0 - 0.5]; second group [0 - 1, 1 - 0.5, 1 - 0.5]
    assert torch.allclose(group_advantages(scores, 3, "rloo"), torch.tensor([1.0, -0.5, -0.5, -1.0, 0.5, 0.5]))
    # grpo: mean 1/3, unbiased std sqrt(1/3): (1 - 1/3) / 0.57735 = 1.1547
    g = group_advantages(scores, 3, "grpo", eps=0.0)
    assert g[0].item() == pytest.approx(1.1547005, abs=1e-5) and g[1].item() == pytest.approx(-0.5773503, abs=1e-5)


def test_discounted_returns():
    r = torch.tensor([[1.0, 0.0, 2.0]])
    assert torch.allclose(discounted_returns(r, torch.ones(1, 3), 0.5), torch.tensor([[1.5, 1.0, 2.0]]))


def test_whiten():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = masked_whiten(x, mask)
    # mean 2, unbiased var 1 -> [-1, 0, 1], padding stays 0
    assert torch.allclose(w, torch.tensor([[-1.0, 0.0, 1.0, 0.0]]), atol=1e-6)


def test_policy_loss_clipping_hand_values():
    old = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[1.5, 0.5]]))
    adv = torch.tensor([[1.0, -1.0]])
    out = policy_loss(new, old, adv, torch.ones(1, 2), 0.2, 0.2)
    # token 0: ratio 1.5, A = 1: max(-1.5, -1.2) = -1.2 (clipped); token 1: ratio 0.5, A = -1: max(0.5, 0.8) = 0.8
    assert out.loss.item() == pytest.approx((-1.2 + 0.8) / 2)
    assert out.clipfrac.item() == pytest.approx(1.0)
    # separate ranges: high 0.6 lets ratio 1.5 through: max(-1.5, -1.5) = -1.5
    assert policy_loss(new, old, adv, torch.ones(1, 2), 0.2, 0.6).loss.item() == pytest.approx((-1.5 + 0.8) / 2)


def test_abs_policy_loss_is_the_mean_absolute_per_token_loss():
    mask = torch.ones(1, 2)
    # on-policy (ratio 1), advantages +1 and -1: the per-token losses -1 and +1 cancel in the loss, not in abs_loss
    same = torch.zeros(1, 2)
    out = policy_loss(same, same, torch.tensor([[1.0, -1.0]]), mask, 0.2, 0.2)
    assert out.loss.item() == pytest.approx(0.0) and out.abs_loss.item() == pytest.approx(1.0)
    # the clipped case above: per-token -1.2 and 0.8 -> (1.2 + 0.8) / 2, and over a shared normaliser of 4 tokens
    new, adv = torch.log(torch.tensor([[1.5, 0.5]])), torch.tensor([[1.0, -1.0]])
    assert policy_loss(new, same, adv, mask, 0.2, 0.2).abs_loss.item() == pytest.approx(1.0)
    assert policy_loss(new, same, adv, mask, 0.2, 0.2, normaliser=4.0).abs_loss.item() == pytest.approx(0.5)
    # masked tokens count for nothing; importance weights scale each term (0.5 * |-1.2|, 2 * |0.8| on 2 tokens)
    masked = policy_loss(new, same, adv, torch.tensor([[1.0, 0.0]]), 0.2, 0.2)
    assert masked.abs_loss.item() == pytest.approx(1.2)
    weighted = policy_loss(new, same, adv, mask, 0.2, 0.2, weights=torch.tensor([[0.5, 2.0]]))
    assert weighted.abs_loss.item() == pytest.approx((0.6 + 1.6) / 2)
    assert not out.abs_loss.requires_grad


def test_actor_update_reports_mean_absolute_policy_loss():
    """One on-policy mini-batch of two samples (3 and 2 response tokens) in micro-batches of one: advantages +2 on
    the first sample's tokens, -1 on the second's. Ratio 1, so the per-token losses are -2 (x3) and +1 (x2):
    policy_loss (-6 + 2) / 5 = -0.8, abs_policy_loss (6 + 2) / 5 = 1.6 (abs() of the loss would say 0.8)."""
    from llm.alignment.ppo.interfaces import PolicyBatch, Samples
    from llm.alignment.ppo.optim import TrainableRole
    from llm.alignment.ppo.roles import ActorRole
    from llm.alignment.ppo.update import PolicyUpdate
    from tests.helpers import tiny_model, tokenizer

    tok, model = tokenizer(), tiny_model(seed=3)
    samples = Samples(
        prompt_ids=[[1, 40, 41], [1, 42]],
        response_ids=[[50, 51, 2], [52, 2]],
        prompts=["a", "b"],
        responses=["x", "y"],
        references=[None, None],
        ended=torch.tensor([True, True]),
    )
    optim = TrainableRole(model, 0.0, 0.0, (0.9, 0.999), 1e-8, 1.0, 0)  # lr 0: the weights stay, ratio stays 1
    role = ActorRole(model, tok, 1.0, 1, optim, PolicyUpdate(2, 0.2, 0.2))
    mask = samples.response_mask()
    advantages = torch.tensor([[2.0, 2.0, 2.0], [-1.0, -1.0, 0.0]]) * mask
    stats = role.update(PolicyBatch(samples, mask, role.log_probs(samples), advantages, None), [[0, 1]])
    assert stats.metrics["policy_loss"] == pytest.approx(-0.8, abs=1e-5)
    assert stats.metrics["abs_policy_loss"] == pytest.approx(1.6, abs=1e-5)


def test_value_loss_clipping_hand_values():
    v, old, ret = torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[2.0]])
    # unclipped (1 - 2)^2 = 1; clipped to 0.2: (0.2 - 2)^2 = 3.24 -> 0.5 * 3.24
    loss, frac = value_loss(v, old, ret, torch.ones(1, 1), 0.2)
    assert loss.item() == pytest.approx(1.62) and frac.item() == 1.0
    assert value_loss(v, old, ret, torch.ones(1, 1), None)[0].item() == pytest.approx(0.5)


def test_adaptive_kl_controller():
    ctl = AdaptiveKLController(value=0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=12.0, n_steps=100)  # error clipped to 0.2 -> * (1 + 0.2 * 100 / 10000)
    assert ctl.value == pytest.approx(0.1 * 1.002)


def test_running_moments():
    rm = RunningMoments()
    xs = torch.tensor([1.0, 2.0, 3.0, 4.0])
    rm.update(xs[:2])
    rm.update(xs[2:])
    assert rm.mean == pytest.approx(2.5) and rm.std == pytest.approx(xs.std(unbiased=False).item())
