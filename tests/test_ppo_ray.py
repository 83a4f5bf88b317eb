"""PPO roles in Ray actors (resource_pool.use_ray) against the same run in one process.

One local Ray instance for the module: 2 CPUs, roles on fractional CPUs (four 1-CPU actors on 2 CPUs
would wait forever), no dashboard, usage stats off, a small object store.
"""

import contextlib
import json
import os
import signal
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from llm.alignment.ppo.build import PPOContext, build_ppo, load_prompts, placed_roles
from llm.alignment.ppo.interfaces import RoleFailure
from llm.run_ppo import main
from llm.settings.load import parse_ppo_config
from llm.utils.errors import UserError, run_cli
from tests.helpers import ROOT, tokenizer
from tests.test_ppo_run import ORM_REWARD, config, history

SAMPLES = 8  # the test config's rollout: 4 prompts x 2 samples


@pytest.fixture(scope="module")
def ray_cluster():
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import ray  # requirements-dev installs Ray: an import error fails these tests

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024**2)
    yield ray
    ray.shutdown()


def fixed_responses(n: int) -> list[list[int]]:
    """Random responses of 3-8 tokens (ids 7.. avoid special tokens); every other one ends with EOS."""
    gen = torch.Generator().manual_seed(3)
    eos = tokenizer().eos_token_id
    out = []
    for i in range(n):
        ids = torch.randint(7, 600, (int(torch.randint(3, 9, (1,), generator=gen)),), generator=gen).tolist()
        out.append(ids + [eos] * (i % 2))
    return out


@contextlib.contextmanager
def two_steps(path: str, *overrides: str, samples: int = SAMPLES):
    """Step 1 on ``samples`` fixed responses, step 2 generated (after step 1's update and, on Ray, the
    weight sync). The roles stay up until the block ends."""
    c = parse_ppo_config([path, *overrides])
    run = PPOContext.load(c)
    with placed_roles(c, run) as roles:
        trainer = build_ppo(c, load_prompts(c, run), roles, run)
        steps = []
        for responses in (fixed_responses(samples), None):
            metrics = trainer.train_step(responses=responses)
            steps.append({"metrics": metrics, "exp": trainer.last_experience, "history": list(trainer.history)})
            trainer.history.clear()
        yield {"steps": steps, "roles": roles, "trainer": trainer}


def step_responses(trainer, policy, step: int) -> list[list[int]]:
    """What ``policy`` samples for the prompts and seed of ``step`` (as ``PPOTrainer.rollout``)."""
    a = trainer.c.actor_rollout
    return policy.generate(
        [trainer.prompts[i].ids for i in trainer.prompt_indices(step)],
        num_samples=a.num_samples_per_step,
        max_new_tokens=a.max_response_length,
        do_sample=a.do_sample,
        top_p=a.top_p,
        top_k=a.top_k,
        seed=trainer.c.training.seed * 1_000_003 + step,
    )


@pytest.fixture(scope="class")
def runs(ray_cluster, tmp_path_factory):
    """The same config in one process and with each role (and a rollout copy) in its own Ray actor."""
    path = config(
        tmp_path_factory.mktemp("ray_parity"),
        reward=ORM_REWARD,
        algorithm={"kl_penalty": "kl", "kl_loss_coef": 0.1},
        actor_rollout={"entropy_coeff": 0.01},
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each Ray worker: the same reduction order, so sampling agrees too
    try:
        with two_steps(path) as local:
            # Negative control: the initial weights (the reference) sample other step-2 responses.
            local["stale"] = step_responses(local["trainer"], local["roles"]["ref"], 1)
    finally:
        torch.set_num_threads(threads)
    flags = ["--resource_pool.use_ray", "true", "--resource_pool.weight_sync_timeout", "60"]
    for role in ("actor_rollout", "ref", "critic", "reward", "rollout"):
        flags += [f"--resource_pool.{role}", "0.4"]  # five workers on 2 CPUs
    with two_steps(path, *flags) as remote:
        yield local, remote


def assert_same_step(a: dict, b: dict, atol: float = 1e-6) -> None:
    for key in ("rewards", "advantages", "returns"):
        torch.testing.assert_close(getattr(a["exp"], key), getattr(b["exp"], key), rtol=1e-5, atol=atol)
    for key in ("logprobs", "ref_logprobs", "values", "kl", "scores"):
        torch.testing.assert_close(getattr(a["exp"].scored, key), getattr(b["exp"].scored, key), rtol=1e-5, atol=1e-6)
    assert [(h["role"], h["epoch"]) for h in a["history"]] == [(h["role"], h["epoch"]) for h in b["history"]]
    for x, y in zip(a["history"], b["history"]):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-6)
    # a metric near 0 (advantage_mean of whitened advantages) is a sum of float32 roundings of the tensors
    # compared above at atol: 2e-6 absolute (a CI run saw 1.007e-6 between Ray + FSDP2 and one process)
    for key, value in a["metrics"].items():
        if not key.startswith("time/"):
            assert b["metrics"][key] == pytest.approx(value, rel=1e-5, abs=max(atol, 2e-6)), key


class TestRayEqualsOneProcess:
    def test_roles_in_separate_actors_give_the_same_steps(self, runs):
        local, remote = runs
        roles = remote["roles"]
        assert all(len(r.pids) == 1 for r in roles.values())
        assert len({roles[n].pids[0] for n in ("actor_rollout", "ref", "critic", "reward", "rollout")}) == 5
        assert os.getpid() not in {r.pids[0] for r in roles.values()}
        assert remote["trainer"].rollout_copy is roles["rollout"] and local["trainer"].rollout_copy is None
        first_local, first_remote = local["steps"][0], remote["steps"][0]
        assert first_local["exp"].scored.samples.response_ids == fixed_responses(SAMPLES)
        assert len(first_local["history"]) == 4 and first_local["metrics"]["kl_loss"] != 0
        assert_same_step(first_local, first_remote)
        # Step 2 generates: on Ray the rollout copy samples with the weights synced after step 1's update.
        responses = local["steps"][1]["exp"].scored.samples.response_ids
        assert remote["steps"][1]["exp"].scored.samples.response_ids == responses
        assert local["stale"] != responses
        assert_same_step(local["steps"][1], remote["steps"][1])

    def test_independent_role_calls_of_a_phase_overlap(self, runs, monkeypatch):
        """resource_pool.concurrent_roles (default): the actor and critic updates (and the scoring calls)
        are in flight at the same time, each waiting on its own actor; false: one after the other."""
        _, remote = runs
        trainer = remote["trainer"]
        spans = {}
        for name in ("actor", "critic"):
            update = getattr(trainer, name).update

            def timed(*args, _update=update, _name=name, **kwargs):
                start = time.perf_counter()
                out = _update(*args, **kwargs)
                spans[_name] = (start, time.perf_counter())
                return out

            monkeypatch.setattr(getattr(trainer, name), "update", timed, raising=False)
        overlap = {}
        for concurrent in (True, False):
            monkeypatch.setattr(trainer.c.resource_pool, "concurrent_roles", concurrent)
            trainer.train_step(responses=fixed_responses(SAMPLES))
            (a0, a1), (c0, c1) = spans["actor"], spans["critic"]
            overlap[concurrent] = a0 < c1 and c0 < a1
        assert overlap == {True: True, False: False}

    def test_weight_sync_to_a_stuck_rollout_copy_times_out(self, runs):
        _, remote = runs
        trainer, rollout = remote["trainer"], remote["roles"]["rollout"]
        trainer.c.resource_pool.weight_sync_timeout = 3
        os.kill(rollout.pids[0], signal.SIGSTOP)  # a hung process: alive, never answers
        try:
            with pytest.raises(RoleFailure, match=r"'rollout' \(Ray actor pid \d+.*did not finish the weight sync "):
                trainer.rollout_copy.sync_from(trainer.actor)
        finally:
            os.kill(rollout.pids[0], signal.SIGCONT)


_calls = {"n": 0}


def reward_then_die(prompt: str, response: str, reference: str | None) -> float:
    """A rule reward whose worker is killed (as by the OOM killer) when step 2 scores its first sample."""
    _calls["n"] += 1
    if _calls["n"] > SAMPLES:
        os.kill(os.getpid(), signal.SIGKILL)
    return float(len(response))


def test_killed_worker_stops_with_a_message_and_a_usable_checkpoint(ray_cluster, tmp_path, capsys):
    out = tmp_path / "out"
    pool = {
        "use_ray": True,
        "actor_rollout": 0.5,
        "ref": 0.5,
        "critic": 0.5,
        "reward": 0.5,
        "colocate": [["actor_rollout", "ref"], ["critic", "reward"]],
    }
    reward = {"type": "rule", "rule": "tests.test_ppo_ray:reward_then_die"}
    path = config(tmp_path, resource_pool=pool, reward=reward, training={"max_steps": 3, "save_steps": 1})
    with pytest.raises(SystemExit) as e:
        run_cli(main, [path])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "PPO role 'reward' (Ray actor pid" in err and "died during score()" in err, err
    assert f"stopped in step 2; the last checkpoint is {out / 'checkpoint-1'}" in err, err
    assert not (out / "checkpoint-2").exists()
    assert {g["state"] for g in ray_cluster.util.placement_group_table().values()} == {"REMOVED"}
    # The checkpoint is complete: Hugging Face loads the actor, and a run (in one process) resumes from it.
    AutoModelForCausalLM.from_pretrained(out / "checkpoint-1" / "actor")
    resume = config(
        tmp_path,
        reward={"type": "rule", "rule": "llm.alignment.ppo.rewards.rule_functions:digit_fraction"},
        # another reward rule than the run that saved it: another run's checkpoint, so named explicitly
        training={"max_steps": 2, "resume_from_checkpoint": str(out / "checkpoint-1")},
    )
    main([resume])
    assert [h["step"] for h in history(out)] == [1, 2]


def test_bad_role_config_in_a_worker_is_a_user_error(ray_cluster, tmp_path):
    pool = {"use_ray": True, "colocate": [["reward", "actor_rollout", "ref", "critic"]]}  # reward builds first
    for role in ("actor_rollout", "ref", "critic", "reward"):
        pool[role] = 0.5
    c = parse_ppo_config([config(tmp_path, resource_pool=pool, reward={"rule": "no_such_module:fn"})])
    with (
        pytest.raises(UserError, match=r"^reward.rule 'no_such_module:fn': cannot import"),
        placed_roles(c, PPOContext.load(c)),
    ):
        pass


def test_a_request_larger_than_the_cluster_stops_at_once(ray_cluster, tmp_path):
    pool = {"use_ray": True, "actor_rollout": 2, "ref": 1, "critic": 1, "reward": 0.5}  # 4.5 CPUs on 2
    c = parse_ppo_config([config(tmp_path, resource_pool=pool)])
    message = (
        r"asks for 4.5 CPU\(s\) in all \(actor_rollout: 2, ref: 1, reward: 0.5, critic: 1\) but the Ray cluster has 2"
    )
    with pytest.raises(UserError, match=message), placed_roles(c, PPOContext.load(c)):
        pass


def test_use_ray_without_ray_installed_says_pip_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    c = parse_ppo_config([config(tmp_path, resource_pool={"use_ray": True})])
    with pytest.raises(UserError, match="Ray is not installed: pip install ray"), placed_roles(c, PPOContext.load(c)):
        pass


@pytest.mark.parametrize(
    "pool, message",
    [
        ({"critic": 0.5}, r"resource_pool.critic=0.5: placing roles .* needs Ray: set resource_pool.use_ray true"),
        ({"rollout": 1}, r"resource_pool.rollout=1: a separate rollout copy needs Ray"),
        ({"colocate": [["actor_rollout", "ref"]]}, r"resource_pool.colocate is used only with resource_pool.use_ray"),
        ({"use_ray": True, "critic": 1.5}, r"resource_pool.critic=1.5: more than one device must be a whole number"),
        ({"use_ray": True, "ref": 0}, r"resource_pool.ref=0: every role needs a device"),
        ({"use_ray": True, "device": "tpu"}, r"resource_pool.device must be cpu or gpu"),
        ({"use_ray": True, "call_timeout": 0}, r"resource_pool.call_timeout must be a number of seconds > 0"),
        ({"use_ray": True, "colocate": [["actor", "ref"]]}, r"unknown role 'actor'.*closest: 'actor_rollout'"),
        ({"use_ray": True, "colocate": [["ref"]]}, r"\['ref'\] has one role"),
        ({"use_ray": True, "colocate": [["ref", "critic"], ["critic", "reward"]]}, r"'critic' is listed twice"),
        ({"use_ray": True, "ref": 0.5, "colocate": [["actor_rollout", "ref"]]}, r"equal amounts \(actor_rollout=1"),
    ],
)
def test_resource_pool_validation(tmp_path, pool, message):
    with pytest.raises(UserError, match=message):
        parse_ppo_config([config(tmp_path, resource_pool=pool)])


def test_ray_example_config_and_cli_overrides(tmp_path):
    path = os.path.join(ROOT, "llm", "config", "tiny", "ppo_ray_argument.json")
    c = parse_ppo_config([path, "--resource_pool.colocate", json.dumps([["critic", "reward"]])])
    assert c.resource_pool.use_ray and c.resource_pool.colocate == [["critic", "reward"]]
    assert parse_ppo_config([path]).resource_pool.colocate == [["actor_rollout", "ref"], ["critic", "reward"]]


def test_a_rank_failing_because_its_peer_died_reports_the_death(monkeypatch):
    """The race CI met: rank 0's collective breaks ("Connection reset by peer") and its error reaches the
    driver before Ray reports that rank 1 died. The message names the death, not the broken collective;
    a rank's own error with no death in its group stays that error."""
    import ray

    from llm.alignment.ppo import ray_roles

    monkeypatch.setattr(ray_roles, "PEER_DEATH_GRACE", 1.0)
    broken = ray.exceptions.RayTaskError("call", "gloo", RuntimeError("Connection reset by peer"))
    outcomes = {"rank0": broken, "rank1": ray.exceptions.RayActorError()}

    class FakeRay:
        exceptions = ray.exceptions

        @staticmethod
        def wait(refs, num_returns, timeout):
            return refs[:num_returns], refs[num_returns:]  # in order: rank 0 first

        @staticmethod
        def get(ref):
            raise outcomes[ref]

    with pytest.raises(RoleFailure, match=r"PPO role 'actor_rollout' \(2 ranks\) died during log_probs\(\)"):
        ray_roles.wait(FakeRay, ["rank0", "rank1"], "actor_rollout", "2 ranks", "log_probs()", 60, "call_timeout")
    outcomes["rank1"] = broken
    with pytest.raises(ray.exceptions.RayTaskError):
        ray_roles.wait(FakeRay, ["rank0", "rank1"], "actor_rollout", "2 ranks", "log_probs()", 60, "call_timeout")


def test_episodes_on_ray_equal_episodes_in_one_process(ray_cluster, tmp_path, monkeypatch):
    """Multi-turn episodes with the roles and a rollout copy in Ray actors: the environment runs in the driver,
    where the rollout source is; greedy turns (each cut to 2 tokens + EOS: a random tiny model rarely ends a turn)
    give the same episodes and numbers as one process, step 2 sampled by the copy after the weight sync."""
    from llm.alignment.ppo.rollout import Generator

    real_generate, eos = Generator.generate, tokenizer().eos_token_id

    def short_turns(self, prompt_ids, **settings):
        out = real_generate(self, prompt_ids, **settings)
        return [(r[: r.index(eos)] if eos in r else list(r))[:2] + [eos] for r in out]

    monkeypatch.setattr(Generator, "generate", short_turns)
    path = config(
        tmp_path,
        actor_rollout={"do_sample": False, "num_samples_per_step": 1, "max_response_length": 16},
        data={"use_chat_template": None},
        environment={"name_or_path": "tests.agent_envs:Echo", "kwargs": {"turns": 2}, "max_episode_tokens": 256},
    )

    def run(*overrides):
        c = parse_ppo_config([path, *overrides])
        run = PPOContext.load(c)
        with placed_roles(c, run) as roles:
            trainer = build_ppo(c, load_prompts(c, run), roles, run)
            return [trainer.train_step() for _ in range(2)], trainer.last_experience.scored.samples.response_ids

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each Ray worker: the same reduction order
    try:
        local, local_ids = run()
    finally:
        torch.set_num_threads(threads)
    flags = ["--resource_pool.use_ray", "true", "--resource_pool.weight_sync_timeout", "60"]
    for role in ("actor_rollout", "ref", "critic", "reward", "rollout"):
        flags += [f"--resource_pool.{role}", "0.4"]
    remote, remote_ids = run(*flags)
    assert remote_ids == local_ids
    for a, b in zip(local, remote):
        assert a["episode/turns"] == b["episode/turns"] == 2.0 and b["env_reward"] == pytest.approx(0.3)
        for key in ("score", "kl", "policy_loss", "value_loss", "response_length", "entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
    assert local[1]["kl"] != 0  # the policy moved: step 2's equality says the copy took the update


def test_two_reward_models_in_one_ray_role_equal_one_process(ray_cluster, tmp_path):
    """A reward list of two models (an ORM and a dense PRM, weighted) runs in the one Ray reward role: the same
    steps, weighted rewards and per-reward metrics as in one process (issue 27 item 1 with Ray placement)."""
    path = config(tmp_path, algorithm={"kl_penalty": "kl", "kl_loss_coef": 0.1})
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    prm = {
        "type": "prm",
        "name": "prm",
        "model_name_or_path": os.path.join(ROOT, "llm", "assets", "tiny-prm"),
        "tokenizer_name_or_path": ORM_REWARD["tokenizer_name_or_path"],
        "init_from_config": True,
        "prm_aggregation": "dense",
        "weight": 2.0,
    }
    raw["reward"] = [{**ORM_REWARD, "name": "orm", "weight": 0.5}, prm]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(raw, f)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each Ray worker: the same reduction order
    try:
        with two_steps(path) as local:
            local_steps = local["steps"]
    finally:
        torch.set_num_threads(threads)
    flags = ["--resource_pool.use_ray", "true", "--resource_pool.weight_sync_timeout", "60"]
    for role in ("actor_rollout", "ref", "critic", "reward", "rollout"):
        flags += [f"--resource_pool.{role}", "0.4"]
    with two_steps(path, *flags) as remote:
        assert len(remote["roles"]["reward"].pids) == 1  # both models in the one reward actor
        remote_steps = remote["steps"]
    for a, b in zip(local_steps, remote_steps):
        assert_same_step(a, b)
        for name in ("orm", "prm"):
            assert f"reward/{name}/mean" in a["metrics"], sorted(a["metrics"])
        scored, other = a["exp"].scored, b["exp"].scored
        assert scored.dense is not None and bool((scored.dense != 0).any())  # the PRM's step rewards
        torch.testing.assert_close(scored.dense, other.dense, rtol=1e-5, atol=1e-6)
        for name in ("orm", "prm"):
            torch.testing.assert_close(scored.components[name], other.components[name], rtol=1e-5, atol=1e-6)
    assert local_steps[0]["metrics"]["reward/orm/mean"] != local_steps[0]["metrics"]["reward/prm/mean"]
