"""A tiny GRPO run with a scripted environment, end to end through the config: two steps train, and the ids the
actor's update trains on are exactly the ids its generation returned plus the rendered environment messages."""

import dataclasses
import os

import pytest
import torch

from llm.alignment.ppo.agent.episode import merge_episode_metrics
from llm.alignment.ppo.agent.source import MultiTurn
from llm.alignment.ppo.build import PPOContext, build_ppo, load_prompts, placed_roles
from llm.alignment.ppo.samples_log import sample_rows
from llm.settings.load import parse_ppo_config
from tests.helpers import ROOT, ppo_config_file

TINY = os.path.join(ROOT, "llm", "config", "tiny", "ppo_argument.json")
TURN = 2  # model tokens a turn keeps before its EOS (a random tiny model rarely samples EOS by itself)


def test_grpo_with_an_environment_trains_on_the_sampled_ids(tmp_path):
    path = ppo_config_file(
        tmp_path,
        TINY,
        "grpo",
        {
            "training": {"max_steps": 2},
            "actor_rollout": {"max_response_length": 6, "num_samples_per_step": 2, "ppo_mini_batch_size": 4},
            "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
            "data": {"rollout_batch_size": 2, "use_chat_template": None},
            "environment": {"name_or_path": "tests.agent_envs:Echo", "kwargs": {"turns": 2}, "max_episode_tokens": 256},
        },
    )
    c = parse_ppo_config([path])
    run = PPOContext.load(c)
    with placed_roles(c, run) as roles:
        trainer = build_ppo(c, load_prompts(c, run), roles, run)
        assert isinstance(trainer.source, MultiTurn)
        tok, eos = trainer.tokenizer, trainer.tokenizer.eos_token_id
        real_generate, real_update = trainer.generator.generate, trainer.actor.update
        generated, trained = [], []

        def generate(prompt_ids, **settings):
            out = real_generate(prompt_ids, **settings)  # the actor's own sampling
            turns = [(r[: r.index(eos)] if eos in r else list(r))[:TURN] + [eos] for r in out]
            generated.append((prompt_ids, turns))
            return turns

        def update(batch, orders):
            trained.append(batch.samples)
            return real_update(batch, orders)

        trainer.generator.generate, trainer.actor.update = generate, update
        before = {k: v.clone() for k, v in trainer.actor.model.state_dict().items()}
        metrics = [trainer.train_step() for _ in range(2)]
        after = trainer.actor.model.state_dict()
        row = sample_rows(trainer.last_experience, 2, 1)[0]  # a samples.jsonl row
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert len(generated) == 4 and len(trained) == 2  # two turns a step, all four episodes generating together
    between = tok("\n<|user|>\nobs 1</s>\n<|assistant|>\n", add_special_tokens=False)["input_ids"]  # by hand
    for step, samples in enumerate(trained):
        (first_contexts, first), (second_contexts, second) = generated[2 * step : 2 * step + 2]
        assert len(samples) == 4 and samples.prompt_ids == first_contexts
        for i in range(4):
            response, mask = samples.response_ids[i], samples.action_mask[i]
            assert response == first[i] + between + second[i]
            assert mask == [1] * (TURN + 1) + [0] * len(between) + [1] * (TURN + 1)
            assert [t for t, m in zip(response, mask) if m] == first[i] + second[i]  # trained: the sampled ids
            assert second_contexts[i] == samples.prompt_ids[i] + first[i] + between  # what the model saw
            assert samples.turn_rewards[i] == [0.1, 0.2] and samples.turn_ends[i] == [TURN, len(response) - 1]
        assert tok.decode(samples.prompt_ids[0]).startswith("<|user|>\nstart ")  # Echo's first message
    for m in metrics:
        assert m["env_reward"] == pytest.approx(0.3) and m["episode/turns"] == 2.0 and m["episode/env_errors"] == 0
        assert m["episode/cut_max_turns"] == 0 and m["time/rollout_generation"] > 0
    roles_ = [t["role"] for t in row["episode"]["turns"]]
    assert roles_ == ["user", "assistant", "user", "assistant", "user"] and row["episode"]["turns"][1]["reward"] == 0.1


def test_on_error_zero_and_drop_in_the_batch(tmp_path):
    """Prompts "bad" (its environment raises at step 1) and "good", two episodes each, GRPO. zero: all four stay,
    the bad ones with turn rewards and score 0 (the rule reward would pay the digits they wrote); drop: the bad
    prompt's whole group leaves before scoring."""
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"src": "bad", "tgt": "1"}\n{"src": "good", "tgt": "2"}\n')
    path = ppo_config_file(
        tmp_path,
        TINY,
        "grpo",
        {
            "actor_rollout": {"max_response_length": 4, "num_samples_per_step": 2, "ppo_mini_batch_size": 4},
            "algorithm": {"adv_estimator": "grpo"},
            "reward": {"rule": "tests.agent_envs:always_one"},
            "data": {"rollout_batch_size": 2, "use_chat_template": None, "shuffle": False},
            "environment": {
                "name_or_path": "tests.agent_envs:Faulty",
                "kwargs": {"fault": "raises"},
                "max_error_fraction": 0.5,
            },
        },
    )
    c = parse_ppo_config([path, "--data.train_dataset_path", str(data)])
    run = PPOContext.load(c)
    with placed_roles(c, run) as roles:
        trainer = build_ppo(c, load_prompts(c, run), roles, run)
        eos = trainer.tokenizer.eos_token_id
        trainer.generator.generate = lambda prompt_ids, **s: [[5, eos] for _ in prompt_ids]
        zero = trainer.source.collect(0)
        drop_config = dataclasses.replace(c, environment=dataclasses.replace(c.environment, on_error="drop"))
        drop = MultiTurn(dataclasses.replace(trainer.context, config=drop_config)).collect(0)
    s = zero.scored
    assert [e["errors"] != [] for e in s.samples.episodes] == [True, True, False, False]
    assert s.raw_scores.tolist() == [1.0, 1.0, 1.0, 1.0] and s.scores.tolist() == [0.0, 0.0, 1.0, 1.0]
    assert s.samples.turn_rewards[:2] == [[0.0], [0.0]] and s.samples.turn_rewards[2][0] == 0.1
    assert zero.metrics["episode/env_errors"] == 2.0 and zero.metrics["episode/dropped"] == 0.0
    d = drop.scored
    assert len(d.samples) == 2 and all(e["errors"] == [] for e in d.samples.episodes)
    assert drop.metrics["episode/dropped"] == 2.0


def test_merge_episode_metrics_by_hand():
    a = {"episode/turns": 2.0, "episode/env_reward": 1.0, "episode/env_errors": 1.0, "episode/dropped": 0.0,
         "episode/episodes": 4.0, "episode/cut_max_turns": 1.0}  # fmt: skip
    b = {"episode/turns": 5.0, "episode/env_reward": 0.0, "episode/env_errors": 0.0, "episode/dropped": 2.0,
         "episode/episodes": 2.0, "episode/cut_max_turns": 2.0}  # fmt: skip
    got = merge_episode_metrics([a, {"time/rollout": 1.0}, b])
    assert got["episode/turns"] == pytest.approx((2 * 4 + 5 * 2) / 6)  # means weighted by episodes
    assert got["episode/env_reward"] == pytest.approx(4 / 6)
    assert got["episode/env_errors"] == 1.0 and got["episode/dropped"] == 2.0  # counts summed
    assert got["episode/episodes"] == 6.0 and got["episode/cut_max_turns"] == 3.0 and "time/rollout" not in got
    assert merge_episode_metrics([{"time/rollout": 1.0}]) == {}


def test_dynamic_sampling_keeps_the_episode_metrics_of_every_round(tmp_path):
    """DAPO around a multi-turn source: the step's episode/... metrics cover every generation round's episodes."""
    path = ppo_config_file(
        tmp_path,
        TINY,
        "grpo",
        {
            "actor_rollout": {"max_response_length": 4, "num_samples_per_step": 2, "ppo_mini_batch_size": 4},
            "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False, "filter_groups": True},
            "reward": {"rule": "tests.test_ppo_dapo:half_constant"},
            "data": {"rollout_batch_size": 2, "use_chat_template": None},
            "environment": {"name_or_path": "tests.agent_envs:Echo", "kwargs": {"turns": 2}, "max_episode_tokens": 256},
        },
    )
    c = parse_ppo_config([path])
    run = PPOContext.load(c)
    with placed_roles(c, run) as roles:
        trainer = build_ppo(c, load_prompts(c, run), roles, run)
        eos = trainer.tokenizer.eos_token_id
        trainer.generator.generate = lambda prompt_ids, **s: [[5 + i % 3, eos] for i in range(len(prompt_ids))]
        m = trainer.train_step()
    assert m["dapo/gen_rounds"] > 1 and m["episode/episodes"] == 4 * m["dapo/gen_rounds"]  # 2 prompts x 2 each
    assert m["episode/turns"] == 2.0 and m["episode/env_reward"] == pytest.approx(0.3)
    assert m["time/rollout_generation"] > 0  # the inner source's own phases are summed over the rounds too
