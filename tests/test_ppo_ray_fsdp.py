"""A role on several devices: a group of Ray actors running torch.distributed (gloo) with FSDP2.

All four roles share one 2-rank group (``colocate``, 2 devices each), so every model is sharded in
two and every batch split in two (data parallel); a rollout copy in its own actor takes the actor's
gathered weights after each update. Its own Ray instance: 3 logical CPUs (the group's two ranks hold
one each, the copy the third). The batch is odd (9 samples, mini-batches of 3, micro-batches of 1),
so the ranks' slices and shares differ and the smaller ones run spare forwards and backwards.
"""

import os
import signal
import threading

import pytest
import torch
from safetensors.torch import load_file

from llm.alignment.ppo.interfaces import RoleFailure
from llm.alignment.ppo.prompts import make_samples
from tests.helpers import tokenizer
from tests.test_ppo_ray import ORM_REWARD, assert_same_step, fixed_responses, two_steps
from tests.test_ppo_run import config

ROLES = ("actor_rollout", "ref", "critic", "reward")
SAMPLES = 9  # 3 prompts x 3 samples: 5 + 4 per forward call, 2 + 1 of every mini-batch of 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import ray

    path = config(
        tmp_path_factory.mktemp("fsdp"),
        reward=ORM_REWARD,
        algorithm={"kl_loss_coef": 0.1},
        data={"rollout_batch_size": 3},
        actor_rollout={"num_samples_per_step": 3, "ppo_mini_batch_size": 3, "entropy_coeff": 0.01},
        critic={"critic_mini_batch_size": 3},
        training={"micro_batch_size": 1},
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each Ray worker
    try:
        with two_steps(path, samples=SAMPLES) as local:
            local["seen"] = {n: local["roles"][n].samples_seen for n in ROLES}
    finally:
        torch.set_num_threads(threads)
    flags = ["--resource_pool.use_ray", "true", "--resource_pool.rollout", "1"]
    flags += ["--resource_pool.colocate", '[["actor_rollout", "ref", "critic", "reward"]]']
    for role in ROLES:
        flags += [f"--resource_pool.{role}", "2"]
    ray.init(num_cpus=3, include_dashboard=False, object_store_memory=200 * 1024**2)
    try:
        with two_steps(path, *flags, samples=SAMPLES) as remote:
            remote["seen"] = {n: remote["roles"][n].per_rank("samples_seen") for n in ROLES}
            remote["checkpoint"] = remote["trainer"].save_checkpoint()
            yield local, remote
    finally:
        ray.shutdown()


def test_fsdp2_group_gives_the_same_steps_as_one_process(runs):
    local, remote = runs
    roles = remote["roles"]
    assert [len(roles[n].pids) for n in ROLES] == [2] * 4 and len({roles[n].where for n in ROLES}) == 1
    assert len(roles["rollout"].pids) == 1 and roles["rollout"].pids[0] not in roles["actor_rollout"].pids
    assert local["steps"][0]["exp"].scored.samples.response_ids == fixed_responses(SAMPLES)
    assert len(local["steps"][0]["history"]) == 6  # 3 actor and 3 critic mini-batches
    assert_same_step(local["steps"][0], remote["steps"][0])
    # Step 2 is sampled by the rollout copy from the weights gathered off the FSDP2 actor.
    responses = local["steps"][1]["exp"].scored.samples.response_ids
    assert remote["steps"][1]["exp"].scored.samples.response_ids == responses
    # After one update: FSDP2 sums the gradients over 2 ranks in another order than one process, and the
    # whitened advantages of step 2 (values ~1) carry that fp32 rounding to ~1.4e-6 on some CPUs (measured
    # 2026-12-01, 2 of 72 elements; the same at the previous commit): 2e-6 absolute, still ~10 ulp of 1.
    assert_same_step(local["steps"][1], remote["steps"][1], atol=2e-6)


def test_fsdp2_checkpoint_is_whole_and_loads_in_one_process(runs):
    local, remote = runs
    actor, critic = local["roles"]["actor_rollout"], local["roles"]["critic"]
    for role, name in ((actor, "actor"), (critic, "critic")):
        saved = load_file(os.path.join(remote["checkpoint"], name, "model.safetensors"))
        mine = role.model.state_dict()
        assert saved.keys() == mine.keys()
        for key, value in mine.items():
            # Two steps of 3 + 3 mini-batches, each rank's gradient summed over its share and then over
            # the ranks: the order of the sums differs from one process, not the arithmetic. Measured: at
            # most ~1.4e-6, in single rows of the embedding / LM head (tokens seen once, tiny Adam second
            # moments: 1 / (sqrt(v) + eps) amplifies rounding there).
            torch.testing.assert_close(saved[key], value, rtol=0, atol=1e-5, msg=key)
    # The optimizer state was gathered from the shards by parameter name: it loads into one process.
    before = {k: v.clone() for k, v in actor.optim.optimizer.state[next(actor.model.parameters())].items()}
    actor.load(os.path.join(remote["checkpoint"], "actor"))
    after = actor.optim.optimizer.state[next(actor.model.parameters())]
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(after[key], before[key], rtol=1e-5, atol=1e-7)


def test_each_rank_computes_only_its_slice(runs):
    """The samples each rank's roles ran forwards over (spares not counted) add up to one process's:
    with the batch replicated on every rank each would have seen all of them."""
    local, remote = runs
    for name in ROLES:
        ranks = remote["seen"][name]
        assert sum(ranks) == local["seen"][name] and max(ranks) < local["seen"][name], (name, ranks)
    # The actor, per step: log_probs 5 + 4 of 9, the update 2 + 1 of each of 3 mini-batches.
    assert remote["seen"]["actor_rollout"] == [2 * (5 + 3 * 2), 2 * (4 + 3 * 1)]


def test_split_calls_on_fewer_samples_than_ranks_and_generation(runs):
    local, remote = runs
    mine, theirs = local["roles"]["ref"], remote["roles"]["ref"]  # frozen: the same weights in both
    samples = local["steps"][1]["exp"].scored.samples
    one = samples.select([0])  # rank 1 runs a stand-in sample to keep up with the all-gathers, dropped
    torch.testing.assert_close(theirs.log_probs(one), mine.log_probs(one), rtol=1e-5, atol=1e-6)
    reward = remote["roles"]["reward"].score(samples.select([0, 1, 2]))
    torch.testing.assert_close(reward.scores, local["roles"]["reward"].score(samples.select([0, 1, 2])).scores)
    prompts = [local["trainer"].prompts[i].ids for i in range(3)]
    greedy = {"num_samples": 1, "max_new_tokens": 6, "do_sample": False, "top_p": 1.0, "top_k": 0}
    # Greedy: the ranks' slices (2 + 1 prompts, stepped together by synced_gpus) give one process's answer.
    assert theirs.generate(prompts, **greedy) == mine.generate(prompts, **greedy)
    assert theirs.generate(prompts[:1], **greedy) == mine.generate(prompts[:1], **greedy)
    # Sampling: rank r draws from seed * 2 + r.
    sampled = {**greedy, "num_samples": 2, "do_sample": True, "top_k": 50}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = mine.generate(prompts[:2], **sampled, seed=14) + mine.generate(prompts[2:], **sampled, seed=15)
    finally:
        torch.set_num_threads(threads)
    assert theirs.generate(prompts, **sampled, seed=7) == expected
    # rollout_log_probs: the log-probs recorded during the group's generation (synced_gpus: a rank that
    # finished steps on) equal the packed forward's.
    responses, logprobs = theirs.generate(prompts, **sampled, seed=7, with_log_probs=True)
    assert responses == expected
    forward = mine.log_probs(make_samples([local["trainer"].prompts[i] for i in range(3)], responses, tokenizer()))
    torch.testing.assert_close(logprobs, forward, rtol=0, atol=1e-5)


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
