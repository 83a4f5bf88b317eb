"""Signs and wiring of the PPO loss terms and score shaping, with values derived by hand.

The actor's update minimises ``policy_loss - entropy_coeff * entropy + kl_loss_coef * kl``. With every
advantage 0 and old log-probs equal to the current ones, the policy term has zero gradient, so the first
AdamW step (sign descent: each weight moves by lr against the sign of its gradient) moves the model along
the remaining term only: to first order the entropy rises by lr x sum |dH/dw| > 0 with the bonus, and the
KL to the reference falls with the KL loss. A flipped sign in either term makes the change go the other way.
"""

import math

import pytest
import torch

from llm.alignment.ppo.algorithm import RunningMoments, kl_estimate, shape_scores
from llm.alignment.ppo.build import Place, PPOContext, build_actor
from llm.alignment.ppo.interfaces import PolicyBatch
from llm.settings.load import parse_ppo_config
from llm.settings.registry import ADV_ESTIMATORS, KL_CONTROLLERS, KL_ESTIMATORS, kl_kinds
from llm.utils.errors import UserError
from tests.test_ppo_memory import fixed_samples
from tests.test_ppo_run import config as ppo_config


def _actor(tmp_path, **actor):
    c = parse_ppo_config([ppo_config(tmp_path, actor_rollout={"learning_rate": 1e-4, **actor})])
    return build_actor(c, Place(), PPOContext.load(c))


def _entropy(actor, samples) -> float:
    with torch.no_grad():
        _, ent = actor._log_probs(samples, list(range(len(samples))), with_entropy=True)
    mask = samples.response_mask()[:, : ent.shape[1]]
    return float((ent * mask).sum() / mask.sum())


def test_actor_entropy_of_a_uniform_policy_is_log_vocab(tmp_path):
    """A zero LM head makes every next-token distribution uniform: entropy log V at every response token,
    and every token's log-prob -log V (at any temperature)."""
    actor = _actor(tmp_path)
    head = actor.model.get_output_embeddings()
    with torch.no_grad():
        head.weight.zero_()
    samples = fixed_samples()
    mask = samples.response_mask()
    with torch.no_grad():
        logp, ent = actor._log_probs(samples, list(range(len(samples))), with_entropy=True)
    V = head.weight.shape[0]
    m = mask[:, : ent.shape[1]].bool()
    torch.testing.assert_close(ent[m], torch.full_like(ent[m], math.log(V)))
    torch.testing.assert_close(logp[m], torch.full_like(logp[m], -math.log(V)))


@pytest.mark.parametrize("coeff", [0.5, 0.0])
def test_entropy_bonus_raises_the_entropy(tmp_path, coeff):
    actor = _actor(tmp_path, entropy_coeff=coeff)
    samples = fixed_samples()
    mask = samples.response_mask()
    logp = actor.log_probs(samples)
    before = _entropy(actor, samples)
    actor.update(PolicyBatch(samples, mask, logp, torch.zeros_like(logp), None), [list(range(len(samples)))])
    after = _entropy(actor, samples)
    if coeff:
        assert after > before + 1e-6, (before, after)
    else:  # no bonus, zero advantages: nothing but weight decay moves the weights; the entropy barely moves
        assert abs(after - before) < 1e-4, (before, after)


@pytest.mark.parametrize("kind", ["mse", "low_var_kl"])
def test_kl_loss_term_pulls_the_policy_towards_the_reference(tmp_path, kind):
    """A reference that gives every sampled token 0.5 less log-prob than the policy: the KL loss (an estimator
    that is 0 only at log p = log q) must lower the policy's log-probs of those tokens towards it."""
    c = parse_ppo_config(
        [
            ppo_config(
                tmp_path,
                actor_rollout={"learning_rate": 1e-4},
                algorithm={"kl_loss_coef": 1.0, "kl_penalty": kind, "use_kl_in_reward": False},
            )
        ]
    )
    actor = build_actor(c, Place(), PPOContext.load(c))
    samples = fixed_samples()
    mask = samples.response_mask()
    logp = actor.log_probs(samples)
    ref = logp - 0.5
    before = float((kl_estimate(logp, ref, kind) * mask).sum() / mask.sum())
    actor.update(PolicyBatch(samples, mask, logp, torch.zeros_like(logp), ref), [list(range(len(samples)))])
    new = actor.log_probs(samples)
    after = float((kl_estimate(new, ref, kind) * mask).sum() / mask.sum())
    assert after < before, (before, after)
    assert float(((new - logp) * mask).sum()) < 0  # the sampled tokens lost probability


def test_kl_estimators_by_hand():
    """log p - log q = r = 0.5: k1 = 0.5, abs = 0.5, k2 = r^2 / 2 = 0.125, k3 = e^-r + r - 1 = 0.10653."""
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    expected = {"k1": 0.5, "kl": 0.5, "abs": 0.5, "k2": 0.125, "mse": 0.125}
    expected |= {"k3": math.exp(-0.5) + 0.5 - 1, "low_var_kl": math.exp(-0.5) + 0.5 - 1}
    assert set(expected) == set(KL_ESTIMATORS)
    for kind, value in expected.items():
        assert kl_estimate(logp, ref, kind).item() == pytest.approx(value, abs=1e-6), kind
    assert kl_estimate(ref, logp, "abs").item() == pytest.approx(0.5)  # abs is symmetric, k1 is not
    assert kl_estimate(ref, logp, "k1").item() == pytest.approx(-0.5)


def test_shape_scores_by_hand():
    """scores (1, 3, 5), the last one cut before EOS with missing_eos_penalty 2: (1, 3, 3). Running moments
    from the prior (mean 0, var 1, count 1e-24) updated with this batch: mean 7/3, population var
    ((1-7/3)^2 + 2 (3-7/3)^2) / 3 = 8/9, so normalised: ((1-7/3), (3-7/3), (3-7/3)) / sqrt(8/9) =
    (-1.41421, 0.70711, 0.70711); clipped to 1: (-1, 0.70711, 0.70711)."""
    scores, ended = torch.tensor([1.0, 3.0, 5.0]), torch.tensor([True, True, False])
    shaped = shape_scores(scores, ended, RunningMoments(), missing_eos_penalty=2.0, normalize=True, clip=1.0)
    torch.testing.assert_close(shaped, torch.tensor([-1.0, 0.70711, 0.70711]), atol=1e-5, rtol=0)
    moments = RunningMoments()
    torch.testing.assert_close(
        shape_scores(scores, ended, moments, 2.0, normalize=True),
        torch.tensor([-1.41421, 0.70711, 0.70711]),
        atol=1e-5,
        rtol=0,
    )
    assert (moments.mean, moments.var) == (pytest.approx(7 / 3), pytest.approx(8 / 9))
    # a second batch (0, 0, 0), by Chan's update: mean 7/3 - 7/3 x 3/6 = 7/6, m2 = 8/9 x 3 + 0 x 3 + (7/3)^2 x
    # 3 x 3 / 6 = 8/3 + 49/6 = 65/6 over 6 samples: var 65/36
    shape_scores(torch.zeros(3), torch.ones(3, dtype=torch.bool), moments, normalize=True)
    assert (moments.mean, moments.var) == (pytest.approx(7 / 6), pytest.approx(65 / 36))
    # neither option: the raw scores, the penalty only where EOS is missing
    torch.testing.assert_close(shape_scores(scores, ended, RunningMoments(), 2.0), torch.tensor([1.0, 3.0, 3.0]))
    torch.testing.assert_close(shape_scores(scores, ended, RunningMoments(), clip=2.0), torch.tensor([1.0, 2.0, 2.0]))


@pytest.mark.parametrize(
    "section, key, value",
    [
        ("algorithm", "adv_estimator", "ppo_gae"),
        ("algorithm", "kl_penalty", "k4"),
        ("algorithm.kl_ctrl", "type", "adaptiv"),
    ],
)
def test_an_unregistered_variant_is_refused_with_the_valid_ones(tmp_path, section, key, value):
    registry = {"adv_estimator": ADV_ESTIMATORS, "kl_penalty": kl_kinds(), "type": KL_CONTROLLERS}[key]
    sections = {"algorithm": {key: value}} if section == "algorithm" else {"algorithm": {"kl_ctrl": {key: value}}}
    with pytest.raises(UserError) as err:
        parse_ppo_config([ppo_config(tmp_path, **sections)])
    assert ", ".join(registry) in str(err.value) and repr(value) in str(err.value)


def test_every_registered_advantage_estimator_runs_in_the_ppo_tests():
    """tests/test_ppo_run.py::test_each_estimator_runs_and_saves runs every registered estimator end to end."""
    from tests import test_ppo_run

    marks = test_ppo_run.test_each_estimator_runs_and_saves.pytestmark
    params = next(m.args[1] for m in marks if m.name == "parametrize")
    assert set(params) == set(ADV_ESTIMATORS)
