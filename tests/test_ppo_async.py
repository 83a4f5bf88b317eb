"""One-step-off asynchronous rollouts (``actor_rollout.async_rollout``, llm/alignment/ppo/async_rollout.py): with
``max_staleness`` 0 the run equals the synchronous one; with 1 the rollout of step n+1 comes from the weights
before update n (checked against those weights), resume, and the configurations refused."""

import copy
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from llm.alignment.ppo import generation
from llm.alignment.ppo import trainer as trainer_module
from llm.alignment.ppo.async_rollout import AsyncRollouts, LocalCopy
from llm.alignment.ppo.build import PPOContext, build_ppo, load_prompts, placed_roles
from llm.alignment.ppo.roles import PolicyModel
from llm.alignment.ppo.rollout import Generator
from llm.run_ppo import main
from llm.settings.load import parse_ppo_config
from llm.utils.errors import UserError
from tests.helpers import tokenizer
from tests.test_ppo_run import config, history

STEPS3 = {"max_steps": 3, "log_samples": 100}
S0 = {"async_rollout": True, "max_staleness": 0}
S1 = {"async_rollout": True}


def untimed(h: dict) -> dict:
    return {k: v for k, v in h.items() if not k.startswith(("time/", "timing/")) and k != "staleness"}


def weights(out, role: str) -> dict:
    return load_file(os.path.join(out, role, "model.safetensors"))


def test_staleness_0_equals_the_synchronous_run(tmp_path):
    """Same samples, every metric and the final weights exactly: each rollout waits for the update before it and
    the sync, and the copy generates and scores with the actor's code on equal weights and the same seeds."""
    runs = {}
    for name, actor in (("sync", {}), ("async0", S0)):
        d = tmp_path / name
        d.mkdir()
        main([config(d, training=STEPS3, actor_rollout=actor)])
        runs[name] = d / "out"
    sync, async0 = history(runs["sync"]), history(runs["async0"])
    assert [h["staleness"] for h in async0] == [0, 0, 0]
    assert [untimed(h) for h in async0] == [untimed(h) for h in sync]
    for role in ("actor", "critic"):
        a, b = weights(runs["sync"], role), weights(runs["async0"], role)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    samples = [(runs[n] / "samples.jsonl").read_text() for n in ("sync", "async0")]
    assert samples[0] == samples[1]


class Recording(AsyncRollouts):
    """AsyncRollouts that keeps itself where the test can read it after the loop has closed it."""

    last = None

    def __init__(self, context, episodes=None):
        super().__init__(context, episodes)
        Recording.last = self


def test_staleness_1_trains_on_the_previous_policys_samples(tmp_path, monkeypatch):
    """Step n+1 (1-indexed) trains on samples the copy generated with the weights before update n: the responses
    are what those weights sample with that step's seed, the old log-probs are those weights' (not the updated
    actor's), and the logged staleness is 1 from step 2 on."""
    monkeypatch.setattr(trainer_module, "AsyncRollouts", Recording)
    c = parse_ppo_config([config(tmp_path, training=STEPS3, actor_rollout=S1)])
    seen = []  # per step: actor weights before its update, the samples, the old log-probs
    run = PPOContext.load(c)
    with placed_roles(c, run) as roles:
        trainer = build_ppo(c, load_prompts(c, run), roles, run)
        update_actor = trainer.update_actor

        def recorded(exp):
            state = {k: v.detach().clone() for k, v in trainer.actor.model.state_dict().items()}
            seen.append((state, exp.scored.samples, exp.scored.logprobs.clone()))
            return update_actor(exp)

        trainer.update_actor = recorded
        log = trainer.train()
        assert [h["staleness"] for h in log] == [0, 1, 1]
        assert all(h["timing/rollout_s"] > 0 and h["timing/wait_s"] >= 0 for h in log)
        # the copy's version counter: the weights after 0, 0, 1 updates generated steps 1, 2, 3
        assert Recording.last.taken == [(0, 0), (1, 0), (2, 1)]
        assert trainer.rollout_copy is None and type(trainer.source).__name__ == "SingleTurn"  # given back
        a = c.actor_rollout
        model = copy.deepcopy(trainer.actor.model)
        policy = PolicyModel(model, trainer.tokenizer, a.temperature, c.micro("actor_rollout"))
        for step in (1, 2):
            generating, current = seen[step - 1][0], seen[step][0]
            samples, old = seen[step][1], seen[step][2]
            model.load_state_dict(generating)
            torch.testing.assert_close(policy.log_probs(samples), old, rtol=0, atol=1e-6)
            responses = generation.generate(
                model,
                trainer.tokenizer,
                a.temperature,
                [trainer.prompts[i].ids for i in trainer.prompt_indices(step)],
                num_samples=a.num_samples_per_step,
                max_new_tokens=a.max_response_length,
                do_sample=a.do_sample,
                top_p=a.top_p,
                top_k=a.top_k,
                seed=c.training.seed * 1_000_003 + step,
            )
            assert [r or [trainer.tokenizer.eos_token_id] for r in responses] == samples.response_ids
            model.load_state_dict(current)
            assert (policy.log_probs(samples) - old).abs().max() > 1e-4  # the updated actor's would differ


def test_on_policy_update_is_off_under_async(tmp_path):
    one_step = {"ppo_epochs": 1, "ppo_mini_batch_size": 8}
    no_kl = {"use_kl_in_reward": False}
    assert parse_ppo_config([config(tmp_path, actor_rollout=one_step, algorithm=no_kl)]).on_policy_update
    c = parse_ppo_config([config(tmp_path, actor_rollout={**one_step, **S1}, algorithm=no_kl)])
    assert not c.on_policy_update


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"actor_rollout": {"max_staleness": 0}}, "max_staleness applies to async_rollout true"),
        ({"actor_rollout": {**S1, "max_staleness": 2}}, "max_staleness=2: one rollout is in flight"),
        ({"actor_rollout": S1, "algorithm": {"kl_penalty": "full"}}, "async_rollout with algorithm.kl_penalty full"),
        (
            {"actor_rollout": S1, "algorithm": {"adv_estimator": "grpo", "filter_groups": True}},
            "filter_groups",
        ),
        ({"actor_rollout": S1, "resource_pool": {"use_ray": True}}, "on Ray needs a rollout copy.*resource_pool"),
        (
            {"actor_rollout": {**S1, "rollout_engine": "vllm"}, "resource_pool": {"use_ray": True, "rollout": 1}},
            "vLLM rollout copy on Ray.*rollout_log_probs true",
        ),
    ],
)
def test_what_async_cannot_do_is_refused(tmp_path, sections, message):
    with pytest.raises(UserError, match=message):
        parse_ppo_config([config(tmp_path, **sections)])


def resumed_pair(tmp_path, actor: dict) -> tuple[list, list, str, str]:
    """4 steps uninterrupted, and again resumed from its checkpoint-2: both histories and output dirs."""
    training = {"max_steps": 4, "save_steps": 2, "save_total_limit": None, "log_samples": 100}
    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    main([config(tmp_path, training={**training, "output_dir": str(full_dir)}, actor_rollout=actor)])
    shutil.copytree(full_dir / "checkpoint-2", resumed_dir / "checkpoint-2")
    resume = {**training, "output_dir": str(resumed_dir), "resume_from_checkpoint": "auto"}
    main([config(tmp_path, training=resume, actor_rollout=actor)])
    return history(full_dir), history(resumed_dir), full_dir, resumed_dir


def prompts_by_step(out) -> dict[int, list[str]]:
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    by_step: dict[int, list[str]] = {}
    for r in rows:
        by_step.setdefault(r["step"], []).append(r["prompt"])
    return by_step


def test_resume_with_staleness_0_equals_the_uninterrupted_run(tmp_path):
    full, again, _, _ = resumed_pair(tmp_path, S0)
    assert [h["step"] for h in again] == [1, 2, 3, 4]
    assert [untimed(h) for h in again[2:]] == [untimed(h) for h in full[2:]]


def test_resume_with_staleness_1_regenerates_the_discarded_rollout(tmp_path):
    """The rollout in flight at the checkpoint is not saved: the resumed run generates step 3 at once (staleness 0)
    with the same prompts, and no prompt is drawn twice over the run."""
    full, again, full_dir, resumed_dir = resumed_pair(tmp_path, S1)
    assert [h["staleness"] for h in full] == [0, 1, 1, 1]
    assert [h["staleness"] for h in again[2:]] == [0, 1]
    before, after = prompts_by_step(full_dir), prompts_by_step(resumed_dir)
    assert sorted(after) == [3, 4] and all(after[s] == before[s] for s in (3, 4))
    drawn = [p for s in (1, 2) for p in before[s][::2]] + [p for s in (3, 4) for p in after[s][::2]]
    assert len(drawn) == len(set(drawn)) == 16  # 4 prompts a step (2 samples each), none twice


def test_on_ray_the_rollout_copy_runs_ahead(tmp_path):
    """With Ray the existing rollout copy (its own worker) generates the next step while the actor updates: the
    same samples and numbers as the one-process async run (the copy synced before each launch)."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import ray

    local_dir, ray_dir = tmp_path / "local", tmp_path / "ray"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each Ray worker: the same reduction order, so sampling agrees too
    try:
        main([config(tmp_path, training={**STEPS3, "output_dir": str(local_dir)}, actor_rollout=S1)])
    finally:
        torch.set_num_threads(threads)
    pool = {"use_ray": True, "weight_sync_timeout": 60, "rollout": 0.4}
    pool.update({role: 0.4 for role in ("actor_rollout", "ref", "critic", "reward")})
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024**2)
    try:
        main([config(tmp_path, training={**STEPS3, "output_dir": str(ray_dir)}, actor_rollout=S1, resource_pool=pool)])
    finally:
        ray.shutdown()
    local, remote = history(local_dir), history(ray_dir)
    assert [h["staleness"] for h in remote] == [0, 1, 1]
    assert (local_dir / "samples.jsonl").read_text() == (ray_dir / "samples.jsonl").read_text()
    for a, b in zip(local, remote):
        for key, value in untimed(a).items():
            assert b[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("actor", [{}, S1], ids=["sync", "async"])
def test_the_trainer_is_freed_without_a_garbage_collection(tmp_path, actor):
    """No reference cycle through the rollout sources (they hold the trainer's scoring, never the trainer): when the
    run's last reference goes, the trainer and the actor role (with its vLLM engine, when it has one) are freed at
    once. An engine held until some later garbage collection broke the next run's engine start in the same process.
    (The actor's model itself may wait for one: torch's get_model_state_dict leaves a cycle over its modules.)"""
    import gc
    import weakref

    c = parse_ppo_config([config(tmp_path, training={"max_steps": 2, "save_steps": 0}, actor_rollout=actor)])
    run = PPOContext.load(c)
    gc.collect()
    gc.disable()
    try:
        with placed_roles(c, run) as roles:
            trainer = build_ppo(c, load_prompts(c, run), roles, run)
            trainer.train()
            refs = [weakref.ref(trainer), weakref.ref(roles["actor_rollout"])]
            del trainer
        del roles
        assert [r() for r in refs] == [None, None]
    finally:
        gc.enable()


def short_turns(real_generate):
    """``generate`` whose every response is cut to 2 tokens + EOS: episodes of whole turns on a random tiny model."""

    def generate(self, prompt_ids, **settings):
        eos = tokenizer().eos_token_id
        return [
            (r[: r.index(eos)] if eos in r else list(r))[:2] + [eos]
            for r in real_generate(self, prompt_ids, **settings)
        ]

    return generate


def test_episodes_one_step_off(tmp_path, monkeypatch):
    """Multi-turn episodes (a scripted environment, two turns) generated on the copy: with max_staleness 0 the run
    equals the synchronous one, every metric and the final weights; with 1 each step's episodes come from the copy
    one update behind, with the episode metrics of the step they train."""
    monkeypatch.setattr(Generator, "generate", short_turns(Generator.generate))
    monkeypatch.setattr(LocalCopy, "generate", short_turns(LocalCopy.generate))
    env = {
        "data": {"use_chat_template": None},
        "environment": {"name_or_path": "tests.agent_envs:Echo", "kwargs": {"turns": 2}, "max_episode_tokens": 256},
    }
    runs = {}
    for name, actor in (("sync", {"max_response_length": 16}), ("async0", {**S0, "max_response_length": 16}),
                        ("async1", {**S1, "max_response_length": 16})):  # fmt: skip
        d = tmp_path / name
        d.mkdir()
        main([config(d, training=STEPS3, actor_rollout=actor, **env)])
        runs[name] = d / "out"

    def comparable(out):
        return [{k: v for k, v in untimed(h).items() if "seconds" not in k} for h in history(out)]

    sync, async0, async1 = (comparable(runs[n]) for n in ("sync", "async0", "async1"))
    assert async0 == sync and all(h["episode/turns"] == 2.0 and h["env_reward"] == pytest.approx(0.3) for h in sync)
    for role in ("actor", "critic"):
        a, b = weights(runs["sync"], role), weights(runs["async0"], role)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [h["staleness"] for h in history(runs["async1"])] == [0, 1, 1]
    assert all(h["episode/turns"] == 2.0 and h["episode/episodes"] == 8 for h in async1)
    assert async1[0] == sync[0] and async1[2]["policy_loss"] != sync[2]["policy_loss"]  # step 3: older samples
