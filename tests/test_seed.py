"""Seeding: what a run draws at random depends on ``seed`` only. ``from_pretrained`` of a sequence-classification
model on a causal-LM checkpoint (an ORM, a PPO critic) draws a new ``score`` head; ``load_model`` seeds before
building any model, so runs with one seed log the same losses and hold the same head, run after run (in one
process, where the RNG has moved on between the runs) and on every rank (tests/test_distributed.py)."""

import os

import pytest
import torch
from safetensors.torch import load_file

from llm.alignment.ppo.build import Place, PPOContext, build_critic
from llm.run_reward import main
from llm.settings.load import parse_ppo_config
from tests.helpers import tiny_model
from tests.test_ppo_run import config as ppo_config
from tests.test_run_reward import config, small_split, train_losses


@pytest.fixture(scope="module")
def causal_lm(tmp_path_factory) -> str:
    """A saved random LlamaForCausalLM: backbone and LM head, no score head."""
    path = tmp_path_factory.mktemp("causal_lm")
    tiny_model("llama", seed=5).save_pretrained(path)
    assert "score.weight" not in load_file(path / "model.safetensors")
    return str(path)


def orm_run(tmp_path, causal_lm: str, seed: int, name: str):
    out = tmp_path / name
    train = small_split(tmp_path, "pairs_train.jsonl", 16)
    cfg = config(
        tmp_path,
        "rm_argument.json",
        model_name_or_path=causal_lm,
        init_from_config=False,
        train_dataset_path=train,
        max_steps=3,
        do_eval=False,
        seed=seed,
        output_dir=str(out),
    )
    torch.manual_seed(len(name))  # a different RNG state before each run, as a fresh process may have
    main([cfg])
    return train_losses(out), load_file(out / "model.safetensors")["score.weight"]


def test_orm_from_a_causal_lm_checkpoint_is_reproducible(tmp_path, causal_lm):
    losses_a, head_a = orm_run(tmp_path, causal_lm, 42, "a")
    losses_b, head_b = orm_run(tmp_path, causal_lm, 42, "bb")
    assert len(losses_a) == 3 and losses_a == losses_b
    assert torch.equal(head_a, head_b)
    losses_c, head_c = orm_run(tmp_path, causal_lm, 7, "ccc")
    assert losses_c != losses_a and not torch.allclose(head_c, head_a)  # the seed does decide


def test_ppo_critic_from_a_causal_lm_checkpoint_is_reproducible(tmp_path, causal_lm):
    def critic(seed: int, rng: int):
        c = parse_ppo_config(
            [
                ppo_config(
                    tmp_path,
                    training={"seed": seed},
                    critic={"model_name_or_path": causal_lm, "init_from_config": False},
                )
            ]
        )
        torch.manual_seed(rng)
        return build_critic(c, Place(), PPOContext.load(c)).model

    a, b, other = critic(42, 0), critic(42, 1), critic(7, 0)
    assert torch.equal(a.score.weight, b.score.weight)
    assert not torch.allclose(a.score.weight, other.score.weight)
    backbone = load_file(os.path.join(causal_lm, "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(a.model.embed_tokens.weight, backbone)  # the rest is the checkpoint's
