"""Multi-turn samples in the PPO trainer (``Samples.action_mask`` / ``turn_ends`` / ``turn_rewards`` /
``episodes``), with values derived by hand: which tokens carry loss, GAE over the model's tokens only, the KL on
the model's tokens only, per-turn environment rewards (GAE) or one discounted outcome (grouped estimators), a
trainer step on a two-turn rollout source, and single-turn results bit-identical to the code before these fields.

The episode used throughout: a 7-token response, model turn 1 (tokens 0-2), two environment tokens (3-4),
model turn 2 (tokens 5-6); the environment pays 0.5 after turn 1 and 1.0 after turn 2.
"""

from __future__ import annotations

import time

import pytest
import torch

from llm.alignment.ppo.algorithm import (
    discounted_returns,
    environment_rewards,
    gae,
    last_tokens,
    token_rewards,
)
from llm.alignment.ppo.build import Place, PPOContext, build_actor, build_critic, build_ppo, load_prompts, placed_roles
from llm.alignment.ppo.interfaces import PolicyBatch, Samples, ValueBatch
from llm.alignment.ppo.rollout import RolloutBatch, RolloutContext, sampling, scored_batch
from llm.alignment.ppo.samples_log import sample_rows
from llm.settings.load import parse_ppo_config
from llm.settings.registry import ADV_ESTIMATORS
from tests.test_ppo_run import config

MASK = [1, 1, 1, 0, 0, 1, 1]
ENDS, TURN_REWARDS = [2, 6], [0.5, 1.0]
ENV = [3, 4]  # the environment's tokens
MODEL = [0, 1, 2, 5, 6]


def episode_samples() -> Samples:
    """The two-turn episode, and a one-turn episode of 4 tokens (no environment reward) padded beside it."""
    return Samples(
        prompt_ids=[[7, 8, 9], [7, 8]],
        response_ids=[[20, 21, 22, 30, 31, 23, 24], [40, 41, 42, 43]],
        prompts=["p0", "p1"],
        responses=["r0", "r1"],
        references=[None, None],
        ended=torch.tensor([True, False]),
        action_mask=[MASK, [1, 1, 1, 1]],
        turn_ends=[ENDS, [3]],
        turn_rewards=[TURN_REWARDS, [0.0]],
        episodes=[{"turns": [], "cut": None, "errors": [], "env_seconds": 0.0}] * 2,
    )


# --- the fields --------------------------------------------------------------------------------------------------
def test_the_loss_mask_is_the_action_mask():
    s = episode_samples()
    assert s.response_mask().tolist() == [MASK, [1, 1, 1, 1, 0, 0, 0]]
    plain = Samples(s.prompt_ids, s.response_ids, s.prompts, s.responses, s.references, s.ended)
    assert plain.response_mask().tolist() == [[1] * 7, [1, 1, 1, 1, 0, 0, 0]]  # single-turn: every response token
    picked = s.select([1, 0])
    assert picked.action_mask == [[1, 1, 1, 1], MASK] and picked.turn_ends == [[3], ENDS]
    assert picked.turn_rewards == [[0.0], TURN_REWARDS] and len(picked.episodes) == 2
    both = Samples.concat([s, picked])
    assert both.action_mask == [MASK, [1, 1, 1, 1], [1, 1, 1, 1], MASK] and both.turn_ends[3] == ENDS
    assert Samples.concat([plain, plain]).action_mask is None
    with pytest.raises(ValueError, match="set in some parts only"):
        Samples.concat([s, plain])


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"action_mask": [[1, 1], [1]]}, r"action_mask\[0\] has 2 entries for 7 response tokens"),
        ({"action_mask": [[1, 1, 1, 2, 0, 1, 1], [1] * 4]}, r"action_mask\[0\]: 1 \(a model token\) or 0"),
        ({"turn_ends": [[3, 6], [3]]}, r"turn_ends\[0\]=\[3, 6\]: a turn ends on a model token"),
        ({"turn_ends": [[6, 2], [3]]}, "ascending indices"),
        ({"turn_rewards": [[0.5], [0.0]]}, r"turn_rewards\[0\] needs one reward per turn_ends entry"),
        ({"episodes": [{}]}, "episodes has 1 entries for 2 samples"),
    ],
)
def test_inconsistent_fields_are_refused(fields, message):
    s = episode_samples()
    with pytest.raises(ValueError, match=message):
        Samples(
            s.prompt_ids,
            s.response_ids,
            s.prompts,
            s.responses,
            s.references,
            s.ended,
            **{
                "action_mask": s.action_mask,
                "turn_ends": s.turn_ends,
                "turn_rewards": s.turn_rewards,
                "episodes": s.episodes,
                **fields,
            },
        )


# --- the math, by hand ---------------------------------------------------------------------------------------------
def test_gae_runs_over_the_model_tokens_only():
    """gamma 0.9, lam 0.8 (gamma lam 0.72); the environment tokens' values (9) and rewards (7) are never read.
    t=6: delta = 1 - 5 = -4, A = -4;  t=5: delta = 0.9*5 - 4 = 0.5, A = 0.5 + 0.72*(-4) = -2.38;
    t=2 (next model token: 5): delta = 0.5 + 0.9*4 - 3 = 1.1, A = 1.1 + 0.72*(-2.38) = -0.6136;
    t=1: delta = 0.9*3 - 2 = 0.7, A = 0.7 + 0.72*(-0.6136) = 0.258208;
    t=0: delta = 0.9*2 - 1 = 0.8, A = 0.8 + 0.72*0.258208 = 0.98590976."""
    mask = torch.tensor([MASK], dtype=torch.float32)
    rewards = torch.tensor([[0.0, 0.0, 0.5, 7.0, 7.0, 0.0, 1.0]])
    values = torch.tensor([[1.0, 2.0, 3.0, 9.0, 9.0, 4.0, 5.0]])
    adv, returns = gae(rewards, values, mask, 0.9, 0.8)
    expected = [0.98590976, 0.258208, -0.6136, 0.0, 0.0, -2.38, -4.0]
    torch.testing.assert_close(adv[0], torch.tensor(expected))
    torch.testing.assert_close(returns[0], torch.tensor([1.98590976, 2.258208, 2.3864, 0.0, 0.0, 1.62, 1.0]))
    # the same episode without its environment tokens: the same advantages at the model tokens
    short, _ = gae(rewards[:, MODEL], values[:, MODEL], torch.ones(1, 5), 0.9, 0.8)
    torch.testing.assert_close(short[0], adv[0, MODEL])


def test_discounted_returns_skip_the_environment_tokens():
    """REINFORCE++, gamma 0.9: G6 = 1, G5 = 0.9, G2 = 0.5 + 0.81 = 1.31, G1 = 1.179, G0 = 1.0611."""
    mask = torch.tensor([MASK], dtype=torch.float32)
    got = discounted_returns(torch.tensor([[0.0, 0.0, 0.5, 7.0, 7.0, 0.0, 1.0]]), mask, 0.9)
    torch.testing.assert_close(got[0], torch.tensor([1.0611, 1.179, 1.31, 0.0, 0.0, 0.9, 1.0]))


def test_environment_rewards_per_turn_or_as_one_outcome():
    s = episode_samples()
    mask = s.response_mask()
    per_turn = environment_rewards(s.turn_ends, s.turn_rewards, mask, per_turn=True, gamma=0.5)
    assert per_turn.tolist() == [[0, 0, 0.5, 0, 0, 0, 1.0], [0] * 7]
    # the outcome: 0.5 + 0.5 * 1.0 at the last model token (6; the one-turn episode's: 3)
    outcome = environment_rewards(s.turn_ends, [[0.5, 1.0], [2.0]], mask, per_turn=False, gamma=0.5)
    assert outcome.tolist() == [[0, 0, 0, 0, 0, 0, 1.0], [0, 0, 0, 2.0, 0, 0, 0]]
    ends_early = torch.tensor([[1.0, 1.0, 0.0, 0.0]])  # an episode whose last token is not the model's
    assert last_tokens(ends_early).tolist() == [1] and last_tokens(mask).tolist() == [6, 3]
    assert [e.per_turn for e in (ADV_ESTIMATORS["gae"], ADV_ESTIMATORS["grpo"], ADV_ESTIMATORS["rloo"])] == [
        True,
        False,
        False,
    ]
    assert not ADV_ESTIMATORS["reinforce_plus_plus"].per_turn


def test_token_rewards_of_an_episode():
    """KL 0.1 per token (0 on the environment's after the mask), kl_coef 0.5, score 2 at the last model token,
    the turn rewards at the turn ends: -0.05 per model token, +0.5 at token 2, +2 + 1 at token 6."""
    s = episode_samples().select([0])
    mask = s.response_mask()
    env = environment_rewards(s.turn_ends, s.turn_rewards, mask, per_turn=True, gamma=1.0)
    got = token_rewards(torch.full((1, 7), 0.1) * mask, torch.tensor([2.0]), mask, 0.5, env=env)
    torch.testing.assert_close(got[0], torch.tensor([-0.05, -0.05, 0.45, 0.0, 0.0, -0.05, 2.95]))


def test_grouped_estimators_see_the_discounted_outcome():
    """GRPO over a group of two episodes, environment gamma 0.5: outcomes 2 + (0.5 + 0.5 * 1.0) = 3 and 1 + 0 = 1;
    mean 2, unbiased std sqrt(2): advantages +-1/sqrt(2) on every model token, 0 on the environment's."""
    s = episode_samples()
    mask = s.response_mask()
    env = environment_rewards(s.turn_ends, s.turn_rewards, mask, per_turn=False, gamma=0.5)
    rewards = token_rewards(torch.zeros(2, 7), torch.tensor([2.0, 1.0]), mask, 0.0, env=env)
    adv, _ = ADV_ESTIMATORS["grpo"].estimate(rewards, None, mask, 1.0, 1.0, 2)
    a = 1 / 2**0.5
    torch.testing.assert_close(adv, torch.tensor([[a, a, a, 0, 0, a, a], [-a, -a, -a, -a, 0, 0, 0]]), atol=1e-5, rtol=0)


# --- single-turn: bit-identical to the code before the multi-turn fields ----------------------------------------------
def gae_before(rewards, values, mask, gamma, lam):
    values = values * mask
    last = torch.zeros_like(rewards[:, 0])
    out = torch.zeros_like(rewards)
    T = rewards.shape[1]
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t + 1 < T else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * last
        out[:, t] = last
    out = out * mask
    return out, (out + values) * mask


def returns_before(rewards, mask, gamma):
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        out[:, t] = running
    return out * mask


def token_rewards_before(kl, scores, mask, kl_coef, dense=None):
    rewards = (-kl_coef * kl * mask).clone()
    last = (mask.sum(1).long() - 1).clamp_min(0)
    rewards[torch.arange(len(scores)), last] += scores
    return rewards if dense is None else rewards + dense * mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_single_turn_math_is_bit_identical_to_before(seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 12, (6,), generator=gen).tolist()
    s = Samples([[1]] * 6, [[5] * n for n in lengths], [""] * 6, [""] * 6, [None] * 6, torch.zeros(6, dtype=torch.bool))
    mask = s.response_mask()
    kl = torch.randn(mask.shape, generator=gen) * mask
    scores, dense, values = (
        torch.randn(6, generator=gen),
        torch.randn(mask.shape, generator=gen),
        torch.randn(mask.shape, generator=gen),
    )
    rewards = token_rewards(kl, scores, mask, 0.05, dense)
    assert torch.equal(rewards, token_rewards_before(kl, scores, mask, 0.05, dense))
    for got, want in zip(gae(rewards, values, mask, 0.99, 0.95), gae_before(rewards, values, mask, 0.99, 0.95)):
        assert torch.equal(got, want)
    assert torch.equal(discounted_returns(rewards, mask, 0.97), returns_before(rewards, mask, 0.97))


# --- the roles: environment tokens carry no loss ---------------------------------------------------------------------
def test_environment_tokens_carry_no_loss(tmp_path):
    """The actor's update (policy loss, entropy bonus, KL loss) and the critic's (value loss) on the episode: any
    old log-probs, advantages, reference log-probs, old values and returns at the environment's tokens leave the
    updated weights bit-identical; a change at one model token moves them."""
    c = parse_ppo_config(
        [
            config(
                tmp_path,
                actor_rollout={"entropy_coeff": 0.1, "ppo_mini_batch_size": 2},
                algorithm={"kl_loss_coef": 0.2},
            )
        ]
    )
    s, gen = episode_samples(), torch.Generator().manual_seed(0)
    mask = s.response_mask()
    old, adv, ref = (torch.randn(2, 7, generator=gen) for _ in range(3))
    values, returns = torch.randn(2, 7, generator=gen), torch.randn(2, 7, generator=gen)

    def at(t: torch.Tensor, positions: list[int]) -> torch.Tensor:
        t = t.clone()
        t[0, positions] += 3.0
        return t

    run = PPOContext.load(c)

    def updated(build, batch) -> dict:
        role = build(c, Place(), run)  # a fresh role each time: seeded, the same weights and optimizer state
        role.update(batch, [[0, 1]])
        return role.model.state_dict()

    def actor_after(o, a, r):
        return updated(build_actor, PolicyBatch(s, mask, o * mask, a * mask, r * mask))

    def critic_after(v, ret):
        return updated(build_critic, ValueBatch(s, mask, v * mask, ret * mask))

    def same(x, y) -> bool:
        return all(torch.equal(x[k], y[k]) for k in x)

    base = actor_after(old, adv, ref)
    assert same(base, actor_after(at(old, ENV), at(adv, ENV), at(ref, ENV)))
    assert not same(base, actor_after(old, at(adv, [5]), ref))
    base = critic_after(values, returns)
    assert same(base, critic_after(at(values, ENV), at(returns, ENV)))
    assert not same(base, critic_after(values, at(returns, [5])))


# --- a trainer step on a two-turn rollout source ----------------------------------------------------------------------
class TwoTurns:
    """A multi-turn rollout source for the test: the policy answers the prompt (turn 1), the "environment" appends
    two fixed tokens and pays 0.5, the policy answers again (turn 2) and is paid 1.0."""

    ENV_TOKENS = (11, 12)

    def __init__(self, context: RolloutContext) -> None:
        self.context = context

    def turn(self, prompt_ids: list[list[int]], step: int) -> list[list[int]]:
        settings = {**sampling(self.context.config, step), "num_samples": 1}
        return [r or [13] for r in self.context.generator.generate(prompt_ids, **settings)]

    def collect(self, step: int, round: int = 0) -> RolloutBatch:
        ctx, start = self.context, time.perf_counter()
        prompts = [ctx.prompts[i] for i in ctx.stream.indices(step)]
        first = self.turn([p.ids for p in prompts], step)
        second = self.turn([p.ids + t + list(self.ENV_TOKENS) for p, t in zip(prompts, first)], step)
        responses = [a + list(self.ENV_TOKENS) + b for a, b in zip(first, second)]
        masks = [[1] * len(a) + [0, 0] + [1] * len(b) for a, b in zip(first, second)]
        ends = [[len(a) - 1, len(r) - 1] for a, r in zip(first, responses)]
        tok = ctx.tokenizer
        samples = Samples(
            [p.ids for p in prompts],
            responses,
            [p.text for p in prompts],
            [tok.decode(r) for r in responses],
            [p.reference for p in prompts],
            torch.zeros(len(prompts), dtype=torch.bool),
            action_mask=masks,
            turn_ends=ends,
            turn_rewards=[[0.5, 1.0]] * len(prompts),
            episodes=[{"turns": [{"role": "assistant", "text": tok.decode(a)}], "cut": None} for a in first],
        )
        return scored_batch(ctx, samples, None, metrics={"time/rollout": time.perf_counter() - start})

    def after_update(self, step: int) -> None:
        self.context.generator.sync()

    def close(self, finished: bool) -> None:
        pass


def test_a_trainer_step_on_a_two_turn_source(tmp_path):
    """GAE with a critic and the KL in the reward: the KL, advantages and returns are 0 on the environment's tokens,
    the log-probs come from one forward over the whole episode (environment tokens included), the turn rewards
    sit at the turn ends, and the logged lengths count the model's tokens."""
    c = parse_ppo_config(
        [config(tmp_path, actor_rollout={"num_samples_per_step": 1}, algorithm={"kl_ctrl": {"kl_coef": 0.3}})]
    )
    run = PPOContext.load(c)
    with placed_roles(c, run) as roles:
        trainer = build_ppo(c, load_prompts(c, run), roles, run)
        trainer.source = TwoTurns(trainer.context)
        trainer.train_step()  # the actor moves away from the reference: a KL to check in the second step
        coef = trainer.kl_ctl.value
        metrics = trainer.train_step()
        exp = trainer.last_experience
    s, mask = exp.scored, exp.scored.mask
    samples = s.samples
    env = torch.zeros_like(mask, dtype=torch.bool)
    for i, m in enumerate(samples.action_mask):
        env[i, : len(m)] = torch.tensor(m) == 0
    assert env.sum() == 2 * len(samples) and (mask[env] == 0).all()
    assert (s.kl[env] == 0).all() and (s.kl[mask.bool()] != 0).any()
    assert (s.logprobs[env] != 0).all() and (s.logprobs[env] < 0).all()  # the forward covered them
    assert (exp.advantages[env] == 0).all() and (exp.returns[env] == 0).all()
    assert (exp.advantages[mask.bool()] != 0).all()
    for i, (first, last) in enumerate(samples.turn_ends):
        torch.testing.assert_close(exp.rewards[i, first], -coef * s.kl[i, first] + 0.5)
        torch.testing.assert_close(exp.rewards[i, last], -coef * s.kl[i, last] + 1.0 + s.scores[i])
    assert metrics["env_reward"] == pytest.approx(1.5)
    assert metrics["response_length"] == pytest.approx(mask.sum(1).mean().item())
    assert metrics["response_length"] == pytest.approx(sum(map(len, samples.response_ids)) / len(samples) - 2)
    row = sample_rows(exp, 1, 1)[0]
    assert row["env_reward"] == pytest.approx(1.5) and row["episode"] == samples.episodes[0]
