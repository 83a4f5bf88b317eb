"""LoRA in PPO (llm/alignment/ppo/lora.py): actor and critic train only their adapters (and the critic its score
head); the reference of a LoRA actor is the actor's own model with the adapter disabled, equal to an explicit
frozen copy of the base, and so is every PPO step over it; the rollout copy receives the merged weights and then
gives the actor's log-probs; the saved adapters reload with peft (and the merged export) with the trained
outputs; resume from a checkpoint equals an uninterrupted run; the tiny LoRA demo's reward rises; bad settings
stop with a message."""

import json
import os
import shutil

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from llm.alignment.ppo.build import PPOContext, build_ppo, build_role, load_prompts, placed_roles
from llm.alignment.ppo.loading import Place, load_frozen
from llm.alignment.ppo.lora import ActorBase
from llm.alignment.ppo.roles import PolicyModel, ValueModel
from llm.run_ppo import main
from llm.settings.load import parse_ppo_config
from llm.utils.checkpoints import load_tree
from llm.utils.errors import UserError
from llm.utils.modeling import load_model
from tests.helpers import ROOT, ppo_config_file
from tests.test_ppo_ray import assert_same_step, ray_cluster, two_steps  # noqa: F401 - ray_cluster: a fixture

DEMO = os.path.join(ROOT, "llm", "config", "tiny", "ppo_lora_argument.json")
TINY_LLAMA = os.path.join(ROOT, "llm", "assets", "tiny-llama")


SMALL = {  # two short steps of 4 prompts, two epochs
    "training": {"max_steps": 2},
    "actor_rollout": {"max_response_length": 8, "ppo_mini_batch_size": 4, "ppo_epochs": 2},
    "critic": {"critic_mini_batch_size": 4, "critic_update_epochs": 2},
    "data": {"rollout_batch_size": 4},
}


def config(tmp_path, demo_sizes=False, **sections):
    """The LoRA demo config in ``tmp_path`` (small batches unless ``demo_sizes``), ``sections`` merged in."""
    return ppo_config_file(tmp_path, DEMO, "ppo_lora", {} if demo_sizes else SMALL, sections)


def base(auto_class=AutoModelForCausalLM, **kw):
    """The demo's frozen base: the seeded random tiny Llama (init_from_config, seed 42)."""
    return load_model(auto_class, TINY_LLAMA, init_from_config=True, seed=42, pad_token_id=0, **kw).eval()


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def changed(model, before):
    return {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}


def history(out):
    with open(os.path.join(out, "log_history.json"), encoding="utf-8") as f:
        return json.load(f)


def max_diff(a, b):
    return (a - b).abs().max().item()


# --- what trains, what the reference is ----------------------------------------------------------------------


def test_only_adapters_and_the_critic_head_train_and_the_reference_is_the_actors_model(tmp_path):
    c = parse_ppo_config([config(tmp_path)])
    run = PPOContext.load(c)
    with placed_roles(c, run) as roles:
        actor, critic, ref = roles["actor_rollout"], roles["critic"], roles["ref"]
        assert isinstance(ref, ActorBase) and ref.model is actor.model  # no second copy of the weights
        frozen = sum(p.numel() for p in actor.model.parameters() if not p.requires_grad)
        assert frozen == sum(p.numel() for p in base().parameters())
        before = {"actor": snapshot(actor.model), "critic": snapshot(critic.model)}
        trainer = build_ppo(c, load_prompts(c, run), roles, run)
        for _ in range(2):
            trainer.train_step()
        moved_actor = changed(actor.model, before["actor"])
        moved_critic = changed(critic.model, before["critic"])
    assert moved_actor and all(".lora_A." in n or ".lora_B." in n for n in moved_actor), sorted(moved_actor)[:5]
    assert any(".lora_B." in n for n in moved_actor)
    assert {n for n in moved_critic if ".lora_" not in n} == {"base_model.model.score.modules_to_save.default.weight"}
    assert any(".lora_B." in n for n in moved_critic)
    # the optimizers hold the trainable parameters only
    for role in (actor, critic):
        stepped = {id(p) for group in role.optim.optimizer.param_groups for p in group["params"]}
        assert stepped == {id(p) for p in role.model.parameters() if p.requires_grad}


def explicit_ref_trainer(c):
    """The trainer of ``c`` with the reference an explicit frozen copy of the base (what a LoRA actor's
    disabled adapter must equal): the same roles otherwise, built in the same order."""
    run = PPOContext.load(c)
    roles = {"actor_rollout": build_role(c, "actor_rollout", run=run)}
    copy = load_frozen(c, AutoModelForCausalLM, c.actor_rollout.model_name_or_path, True, run.tokenizer, Place())
    roles["ref"] = PolicyModel(copy, run.tokenizer, c.actor_rollout.temperature, c.micro("ref"))
    roles["reward"] = build_role(c, "reward", run=run)
    roles["critic"] = build_role(c, "critic", run=run)
    return build_ppo(c, load_prompts(c, run), roles, run)


@pytest.mark.parametrize(
    "kl", [{"kl_penalty": "kl"}, {"kl_penalty": "low_var_kl", "kl_loss_coef": 0.5}, {"kl_penalty": "full"}]
)
def test_disabled_adapter_reference_equals_an_explicit_frozen_copy(tmp_path, kl):
    c = parse_ppo_config([config(tmp_path, algorithm={**kl, "kl_ctrl": {"type": "fixed", "kl_coef": 0.1}})])
    run = PPOContext.load(c)
    with placed_roles(c, run) as roles:
        shared = build_ppo(c, load_prompts(c, run), roles, run)
        runs = {"shared": shared, "copy": explicit_ref_trainer(c)}
        steps = {name: [t.train_step() for _ in range(3)] for name, t in runs.items()}
        exps = {name: t.last_experience for name, t in runs.items()}
        # after three updates the adapter is far from zero: the actor differs from its base, the two references agree
        samples = exps["shared"].scored.samples
        ref_shared = shared.ref.log_probs(samples)
        ref_copy = runs["copy"].ref.log_probs(samples)
        actor_now = shared.actor.log_probs(samples)
    mask = exps["shared"].scored.mask.bool()
    assert max_diff(ref_shared[mask], ref_copy[mask]) < 1e-6
    assert max_diff(actor_now[mask], ref_shared[mask]) > 1e-2
    assert shared.actor.model.training  # the disabled-adapter forwards left the actor's mode as it was
    a, b = exps["shared"].scored, exps["copy"].scored
    assert max_diff(a.ref_logprobs, b.ref_logprobs) < 1e-6 and a.kl.abs().max() > 0
    assert max_diff(a.kl, b.kl) < 1e-6
    losses = [(h["role"], h["loss"]) for h in runs["shared"].history]
    want = [(h["role"], h["loss"]) for h in runs["copy"].history]
    assert [r for r, _ in losses] == [r for r, _ in want]
    assert max(abs(x - y) for (_, x), (_, y) in zip(losses, want)) < 1e-6
    for ms, mc in zip(steps["shared"], steps["copy"]):
        for key in ("score", "kl", "reward", "policy_loss", "value_loss", "kl_loss"):
            assert abs(ms[key] - mc[key]) < 1e-6, (key, ms[key], mc[key])


def test_rollout_copy_receives_the_merged_weights_and_gives_the_actors_log_probs(tmp_path):
    c = parse_ppo_config([config(tmp_path)])
    run = PPOContext.load(c)
    with placed_roles(c, run) as roles:
        trainer = build_ppo(c, load_prompts(c, run), roles, run)
        trainer.train_step()
        trainer.train_step()
        actor = roles["actor_rollout"]
        copy = build_role(c, "rollout", run=run)  # a plain model: the base as loaded
        assert not hasattr(copy.model, "peft_config")
        samples = trainer.last_experience.scored.samples
        mask = samples.response_mask().bool()
        want = actor.log_probs(samples)
        assert max_diff(copy.log_probs(samples)[mask], want[mask]) > 1e-2  # before the sync: the base
        before = snapshot(actor.model)
        weights = actor.weights()
        assert set(weights) == set(copy.model.state_dict())  # the plain Hugging Face names
        copy.sync_from(actor)
        assert not changed(actor.model, before)  # merged beside the model: the trained weights are untouched
        got = copy.log_probs(samples)
    assert max_diff(got[mask], want[mask]) < 1e-5


# --- saves, resume ---------------------------------------------------------------------------------------------


def test_saved_adapters_reload_with_peft_and_the_merged_export_matches(tmp_path):
    c = parse_ppo_config([config(tmp_path, critic={"lora_merge": True})])
    run = PPOContext.load(c)
    with placed_roles(c, run) as roles:
        trainer = build_ppo(c, load_prompts(c, run), roles, run)
        trainer.train()
        samples = trainer.last_experience.scored.samples
        actor, critic = roles["actor_rollout"], roles["critic"]
        actor.model.eval()
        critic.model.eval()
        want_logp, want_values = actor.log_probs(samples), critic.values(samples)
    out = tmp_path / "out"
    for part in ("actor", "critic"):
        assert (out / part / "adapter_config.json").exists() and (out / part / "adapter_model.safetensors").exists()
        assert not (out / part / "model.safetensors").exists()  # the adapter, not a copy of the base
        assert (out / part / "merged" / "model.safetensors").exists()
    assert "base_model.model.score.weight" in load_file(out / "critic" / "adapter_model.safetensors")
    tok = run.tokenizer
    reloaded = PeftModel.from_pretrained(base(), out / "actor").eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "actor" / "merged").eval()
    value_base = base(AutoModelForSequenceClassification, num_labels=1)
    value_reloaded = PeftModel.from_pretrained(value_base, out / "critic").eval()
    value_merged = AutoModelForSequenceClassification.from_pretrained(out / "critic" / "merged").eval()
    mask = samples.response_mask().bool()
    for model, tol in ((reloaded, 1e-6), (merged, 1e-5)):
        got = PolicyModel(model, tok, c.actor_rollout.temperature, 4).log_probs(samples)
        assert max_diff(got[mask], want_logp[mask]) < tol
    for model, tol in ((value_reloaded, 1e-6), (value_merged, 1e-5)):
        got = ValueModel(model, tok, 4).values(samples)
        assert max_diff(got[mask], want_values[mask]) < tol


def test_checkpoints_hold_the_adapters_and_resume_equals_an_uninterrupted_run(tmp_path):
    whole = tmp_path / "whole"
    whole.mkdir()
    main([config(whole, training={"max_steps": 4})])
    part = tmp_path / "part"
    part.mkdir()
    cfg = config(part, training={"max_steps": 4, "save_steps": 2})
    main([cfg, "--max_steps", "2"])
    ckpt = part / "out" / "checkpoint-2"
    for role in ("actor", "critic"):
        files = set(os.listdir(ckpt / role))
        assert {"adapter_model.safetensors", "optimizer.json", "optimizer.safetensors"} <= files, files
        assert "model.safetensors" not in files  # the frozen base is read again from model_name_or_path
        names = set(load_tree(str(ckpt / role), "optimizer")["optimizer"]["state"])
        assert names and all(".lora_" in n or ".score.modules_to_save." in n for n in names), sorted(names)[:3]
        assert any(".score." in n for n in names) == (role == "critic")
    main([cfg, "--resume_from_checkpoint", str(ckpt)])
    a, b = history(whole / "out"), history(part / "out")
    assert [h["step"] for h in b] == [1, 2, 3, 4]
    for x, y in zip(a, b):
        for key in ("score", "kl", "policy_loss", "value_loss"):
            assert abs(x[key] - y[key]) < 1e-6, (x["step"], key, x[key], y[key])
    for role in ("actor", "critic"):
        want = load_file(whole / "out" / role / "adapter_model.safetensors")
        got = load_file(part / "out" / role / "adapter_model.safetensors")
        assert set(want) == set(got) and max(max_diff(want[k], got[k]) for k in want) < 1e-6


# --- the demo ---------------------------------------------------------------------------------------------------


def test_lora_demo_reward_rises(tmp_path):
    """The tiny LoRA demo (digit_fraction rule reward, 16 steps): the mean score of the last four steps is well
    above the first four's. The same config with lora false over-steps at this learning rate (3x the full demo's,
    as LoRA needs): the policy collapses onto one token within a few steps, entropy ~0 and reward ~0."""
    lora = tmp_path / "lora"
    lora.mkdir()
    main([config(lora, demo_sizes=True, training={"max_steps": 16, "save_steps": 0})])
    scores = [h["score"] for h in history(lora / "out")]
    first, last = sum(scores[:4]) / 4, sum(scores[-4:]) / 4
    assert first < 0.03 and last > first + 0.1 and last > 5 * first, scores

    full = tmp_path / "full"
    full.mkdir()
    off = {"lora": False, "lora_alpha": -1, "lora_merge": False}
    main(
        [
            config(
                full,
                demo_sizes=True,
                training={"max_steps": 8, "save_steps": 0},
                actor_rollout=off,
                critic={"lora": False},
            )
        ]
    )
    logs = history(full / "out")
    assert logs[-1]["entropy"] < 0.1 and sum(h["score"] for h in logs[-4:]) / 4 < 0.005, logs[-1]


# --- checks ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"actor_rollout": {"lora": False, "lora_merge": False}}, r"^\S+: actor_rollout\.lora_alpha only take"),
        (
            {"critic": {"lora": False, "rslora": True}},
            r"critic\.rslora only take\(s\) effect with lora: set critic\.lora",
        ),
        ({"actor_rollout": {"lora_rank": 0}}, r"actor_rollout\.lora_rank must be > 0"),
        ({"critic": {"lora_dropout": 1.0}}, r"critic\.lora_dropout must be in \[0, 1\)"),
        ({"actor_rollout": {"lora_rank": "8"}}, r"actor_rollout\.lora_rank"),
        (
            {"actor_rollout": {"lora_path": "/no/such/adapter"}},
            r"actor_rollout\.lora_path '/no/such/adapter': no PEFT adapter",
        ),
        (
            {"ref": {"dtype": "bfloat16"}},
            r"ref\.dtype: with actor_rollout\.lora the reference is the actor's own model",
        ),
        ({"ref": {"offload": True}}, r"ref\.offload: with actor_rollout\.lora"),
        (
            {"resource_pool": {"use_ray": True, "actor_rollout": 0.5, "ref": 0.5, "critic": 0.5, "reward": 0.5}},
            r"must run in the actor's process: add \[\"actor_rollout\", \"ref\"\] to resource_pool\.colocate",
        ),
        (
            {"resource_pool": {"use_ray": True, "actor_rollout": 2, "ref": 2, "colocate": [["actor_rollout", "ref"]]}},
            r"actor_rollout\.lora with resource_pool\.actor_rollout=2: .*FSDP2",
        ),
        ({"resource_pool": {"use_ray": True, "critic": 2}}, r"critic\.lora with resource_pool\.critic=2"),
    ],
)
def test_bad_lora_settings_stop_with_a_message(tmp_path, sections, message):
    with pytest.raises(UserError, match=message):
        parse_ppo_config([config(tmp_path, **sections)])


def test_a_separate_reference_model_is_loaded_and_colocated_ray_is_accepted(tmp_path):
    other = tmp_path / "other-llama"  # another path: a reference of its own (the same path is the actor's base)
    shutil.copytree(TINY_LLAMA, other)
    c = parse_ppo_config([config(tmp_path, ref={"model_name_or_path": str(other), "init_from_config": True})])
    ref = build_role(c, "ref", run=PPOContext.load(c))
    assert not isinstance(ref, ActorBase) and not hasattr(ref.model, "peft_config")
    pool = {"use_ray": True, "actor_rollout": 0.5, "ref": 0.5, "critic": 0.5, "reward": 0.5}
    c = parse_ppo_config([config(tmp_path, resource_pool={**pool, "colocate": [["ref", "actor_rollout"]]})])
    assert c.resource_pool.colocate == [["ref", "actor_rollout"]]
    # a ref built before its actor (colocated in that order) finds the actor's model once it is built
    roles: dict = {}
    run = PPOContext.load(c)
    roles["ref"] = build_role(c, "ref", built=roles, run=run)
    with pytest.raises(UserError, match="no actor role was built in this process"):
        roles["ref"].model  # noqa: B018
    roles["actor_rollout"] = build_role(c, "actor_rollout", built=roles, run=run)
    assert roles["ref"].model is roles["actor_rollout"].model


# --- Ray: the reference colocated with the actor, a rollout copy on merged weights --------------------------------


def test_ray_colocated_reference_and_rollout_copy_equal_one_process(ray_cluster, tmp_path):  # noqa: F811
    path = config(tmp_path, actor_rollout={"ppo_epochs": 1}, critic={"critic_update_epochs": 1})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each Ray worker: the same reduction order, so sampling agrees too
    try:
        with two_steps(path) as local:
            pass
    finally:
        torch.set_num_threads(threads)
    flags = ["--resource_pool.use_ray", "true", "--resource_pool.weight_sync_timeout", "60"]
    for role in ("actor_rollout", "ref", "critic", "reward", "rollout"):
        flags += [f"--resource_pool.{role}", "0.4"]
    flags += ["--resource_pool.colocate", '[["ref", "actor_rollout"]]']
    with two_steps(path, *flags) as remote:
        roles = remote["roles"]
        assert roles["ref"].pids == roles["actor_rollout"].pids != roles["rollout"].pids
    for a, b in zip(local["steps"], remote["steps"]):
        assert_same_step(a, b)
    # step 2 was generated by the rollout copy (a plain model) from the merged weights synced after step 1
    responses = local["steps"][1]["exp"].scored.samples.response_ids
    assert remote["steps"][1]["exp"].scored.samples.response_ids == responses
