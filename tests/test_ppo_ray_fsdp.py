"""A role on several devices: a group of Ray actors running torch.distributed (gloo) with FSDP2.

All four roles share one 2-rank group (``colocate``, 2 devices each), so every model is sharded in
two; a rollout copy in its own actor takes the actor's gathered weights after each update. Its own
Ray instance: 3 logical CPUs (the group's two ranks hold one each, the copy the third).
"""

import os
import signal
import threading

import pytest
import torch
from safetensors.torch import load_file

from llm.alignment.ppo.roles import RoleFailure
from tests.test_ppo_ray import ORM_REWARD, assert_same_step, fixed_responses, two_steps
from tests.test_ppo_run import config

ROLES = ("actor_rollout", "ref", "critic", "reward")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import ray

    path = config(
        tmp_path_factory.mktemp("fsdp"),
        reward=ORM_REWARD,
        algorithm={"kl_loss_coef": 0.1},
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each Ray worker
    try:
        with two_steps(path) as local:
            pass
    finally:
        torch.set_num_threads(threads)
    flags = ["--resource_pool.use_ray", "true", "--resource_pool.rollout", "1"]
    flags += ["--resource_pool.colocate", '[["actor_rollout", "ref", "critic", "reward"]]']
    for role in ROLES:
        flags += [f"--resource_pool.{role}", "2"]
    ray.init(num_cpus=3, include_dashboard=False, object_store_memory=200 * 1024**2)
    try:
        with two_steps(path, *flags) as remote:
            remote["checkpoint"] = remote["trainer"].save_checkpoint()
            yield local, remote
    finally:
        ray.shutdown()


def test_fsdp2_group_gives_the_same_steps_as_one_process(runs):
    local, remote = runs
    roles = remote["roles"]
    assert [len(roles[n].pids) for n in ROLES] == [2] * 4 and len({roles[n].where for n in ROLES}) == 1
    assert len(roles["rollout"].pids) == 1 and roles["rollout"].pids[0] not in roles["actor_rollout"].pids
    assert local["steps"][0]["exp"].scored.samples.response_ids == fixed_responses(8)
    assert_same_step(local["steps"][0], remote["steps"][0])
    # Step 2 is sampled by the rollout copy from the weights gathered off the FSDP2 actor.
    responses = local["steps"][1]["exp"].scored.samples.response_ids
    assert remote["steps"][1]["exp"].scored.samples.response_ids == responses
    assert_same_step(local["steps"][1], remote["steps"][1])


def test_fsdp2_checkpoint_is_whole_and_loads_in_one_process(runs):
    local, remote = runs
    actor, critic = local["roles"]["actor_rollout"], local["roles"]["critic"]
    for role, name in ((actor, "actor"), (critic, "critic")):
        saved = load_file(os.path.join(remote["checkpoint"], name, "model.safetensors"))
        mine = role.model.state_dict()
        assert saved.keys() == mine.keys()
        for key, value in mine.items():
            # After two Adam steps single rows of the embedding / LM head (tokens seen once, tiny second
            # moments) differ by up to ~1e-5: 1 / (sqrt(v) + eps) amplifies the rounding of the sharded
            # gradient reduction there. Every other weight agrees to 1e-6; the step outputs above to 1e-5.
            torch.testing.assert_close(saved[key], value, rtol=1e-4, atol=2e-5, msg=key)
    # The optimizer state was gathered from the shards by parameter name: it loads into one process.
    before = {k: v.clone() for k, v in actor.optim.optimizer.state[next(actor.model.parameters())].items()}
    actor.load(os.path.join(remote["checkpoint"], "actor"))
    after = actor.optim.optimizer.state[next(actor.model.parameters())]
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(after[key], before[key], rtol=1e-5, atol=1e-7)


def test_a_rank_dying_inside_a_collective_ends_the_call_with_a_message(runs):
    _, remote = runs
    actor = remote["roles"]["actor_rollout"]
    samples = remote["steps"][0]["exp"].scored.samples
    # Rank 1 stops, so rank 0 blocks in the first all-gather of log_probs; then rank 1 is killed.
    os.kill(actor.pids[1], signal.SIGSTOP)
    killer = threading.Timer(2.0, os.kill, (actor.pids[1], signal.SIGKILL))
    killer.start()
    try:
        with pytest.raises(
            RoleFailure, match=r"role 'actor_rollout' \(Ray actor 2 ranks, pid .* died during log_probs"
        ):
            actor.log_probs(samples)
    finally:
        killer.join()
