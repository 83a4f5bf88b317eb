"""LoRA's memory (issue 30): the adapted layers add their update in place (``llm.utils.lora.add_updates_in_place``):
bit-identical to peft's forward, at most one output-sized temporary per adapted layer where peft makes three; a LoRA
step keeps no more autograd bytes than full fine-tuning of the same model; the chunked LM-head readout is taken
under the peft wrapper; activation checkpointing (and with it glibc's free heap handed back between decoder
layers, ``llm.utils.memory``) is on by default with lora (``recompute`` unset; PPO:
``training.gradient_checkpointing`` unset, for the LoRA roles)."""

import copy
import json
import logging
import os

import pytest
import torch
from peft.tuners.lora.layer import Linear as PeftLinear
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.modeling_layers import GradientCheckpointingLayer

from llm.alignment.context import RunContext
from llm.alignment.lm import token_log_probs
from llm.alignment.ppo.build import Place, build_actor, build_critic
from llm.alignment.ppo.context import PPOContext
from llm.alignment.sft.build import build_sft_trainer
from llm.data.packing import causal_example, collate, pack
from llm.settings.flat import ARGUMENT_TYPES, ModelArgument, validate_arguments
from llm.settings.load import parse_arguments, parse_ppo_config
from llm.utils import memory
from llm.utils.lora import DEFAULT_TARGETS, apply_lora
from tests.helpers import ROOT, ppo_config_file, tiny_model

LAYERS = 2  # tiny_model's decoder layers


def lora_model(dropout: float = 0.0, seed: int = 3) -> torch.nn.Module:
    model = apply_lora(tiny_model("llama", seed=seed), ModelArgument(lora=True, lora_dropout=dropout), "causal_lm")
    torch.manual_seed(0)
    with torch.no_grad():  # B starts at zero: give the adapters an update to add
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05)
    return model


def with_peft_forward(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose adapted layers run peft's own forward again."""
    twin = copy.deepcopy(model)
    for module in twin.modules():
        if isinstance(module, PeftLinear):
            module.__class__ = PeftLinear
    return twin


def batch(vocab: int = 648):
    g = torch.Generator().manual_seed(1)
    examples = []
    for record, n in enumerate((90, 70, 50)):
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        examples.append(causal_example(ids, list(range(n - 1)), ids[1:], record=record))
    return collate(pack(examples, 128, "greedy")[0], pad_token_id=0)


def step(model, b, chunk: int = 1024):
    """Forward and backward of the SFT readout; the log-probs and every trained parameter's gradient."""
    torch.manual_seed(7)  # the same dropout masks on both sides
    model.train()
    logps, _ = token_log_probs(model, model.get_output_embeddings(), b, chunk)
    (-logps.sum()).backward()
    return logps.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_every_adapted_projection_adds_in_place():
    model = lora_model()
    adapted = [m for m in model.modules() if isinstance(m, PeftLinear)]
    assert len(adapted) == len(DEFAULT_TARGETS) * LAYERS
    assert all(type(m) is not PeftLinear for m in adapted)  # the in-place subclass, every one


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_in_place_update_is_bit_identical_to_peft(dropout):
    ours = lora_model(dropout)
    theirs = with_peft_forward(ours)
    b = batch()
    logps, grads = step(ours, b)
    peft_logps, peft_grads = step(theirs, b)
    assert torch.equal(logps, peft_logps)
    assert grads.keys() == peft_grads.keys() and len(grads) == 2 * len(DEFAULT_TARGETS) * LAYERS
    for name, grad in grads.items():
        assert torch.equal(grad, peft_grads[name]), name
    assert any(g.abs().max() > 0 for n, g in grads.items() if ".lora_A." in n)  # the adapters are in the graph


def test_disabled_adapter_is_the_base():
    model = lora_model()
    b = batch()
    base = tiny_model("llama", seed=3)
    with torch.no_grad(), model.disable_adapter():
        ours = token_log_probs(model, model.get_output_embeddings(), b)[0]
    with torch.no_grad():
        expected = token_log_probs(base, base.get_output_embeddings(), b)[0]
        adapted = token_log_probs(model, model.get_output_embeddings(), b)[0]
    assert torch.equal(ours, expected)
    assert not torch.allclose(adapted, expected)  # and the adapter, enabled, changes the outputs


class FreshBytes(TorchDispatchMode):
    """Bytes of the new tensors the ops return (not views, not in-place results): what the allocator is asked for."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        mutates = func._schema.is_mutable or func.is_view
        if not mutates:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.sizes.append(t.numel() * t.element_size())
        return out


def output_sized_allocations(layer: torch.nn.Module, rows: int = 256) -> int:
    x = torch.randn(rows, layer.in_features, requires_grad=True)
    out_bytes = rows * layer.out_features * 4
    with FreshBytes() as fresh:
        layer(x)
    return sum(1 for size in fresh.sizes if size >= out_bytes)


def test_an_adapted_layer_allocates_one_output_sized_temporary_beside_its_output():
    model = lora_model()
    ours = model.base_model.model.model.layers[0].mlp.up_proj
    theirs = with_peft_forward(model).base_model.model.model.layers[0].mlp.up_proj
    # the output and the adapter's update (scaled and added in place); peft: + the scaled update + the sum
    assert output_sized_allocations(ours) == 2
    assert output_sized_allocations(theirs) == 4


def saved_bytes(model, b) -> int:
    """Bytes autograd keeps for backward over the SFT readout step: distinct storages, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack_hook(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        logps, _ = token_log_probs(model, model.get_output_embeddings(), b)
    (-logps.sum()).backward()
    return sum(seen.values())


def test_a_lora_step_keeps_no_more_autograd_bytes_than_full_fine_tuning():
    b = batch()
    full = saved_bytes(tiny_model("llama", seed=3), b)
    lora = saved_bytes(lora_model(), b)
    # full keeps what LoRA keeps (the inputs of the projections, attention, activations) plus the norms' inputs for
    # their weights; LoRA adds only the rank-8 lora_A outputs
    assert 0 < lora < full, (lora, full)


def test_the_chunked_readout_is_taken_under_peft():
    """The model's own head runs at one position per row (``logits_to_keep``), the readouts go through the
    chunked head: no (tokens, vocab) logits of the whole batch."""
    model = lora_model()
    head = model.get_output_embeddings()
    positions = []
    head.register_forward_hook(lambda module, args, out: positions.append(args[0].shape[-2]))
    b = batch()
    logps, _ = token_log_probs(model, head, b, chunk_size=32)
    assert positions == [1]  # one call inside the forward, one position per row
    assert logps.shape[0] == b.readout_index.numel() > 32


def parsed(tmp_path, **overrides):
    with open(os.path.join(ROOT, "llm", "config", "tiny", "sft_argument.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    for key in ("model_name_or_path", "tokenizer_name_or_path", "train_dataset_path", "dev_dataset_path"):
        cfg[key] = os.path.join(ROOT, cfg[key])
    cfg.update(output_dir=str(tmp_path / "out"), report_to="none", **overrides)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    model_args, data_args, training_args = parse_arguments([str(path)], ARGUMENT_TYPES)
    validate_arguments(model_args, data_args, training_args)
    return model_args, data_args, training_args


@pytest.mark.parametrize(
    "overrides, on",
    [({"lora": True}, True), ({"lora": True, "recompute": False}, False), ({}, False), ({"recompute": True}, True)],
)
def test_recompute_defaults_to_on_with_lora_and_hands_the_free_heap_back(tmp_path, overrides, on):
    model_args, data_args, args = parsed(tmp_path, **overrides)
    assert args.recompute is on and bool(args.activation_checkpointing) is on
    noted = any("activation checkpointing on" in note for note in args.config_notes)
    assert noted is (on and "recompute" not in overrides)  # the default says so in the log; an explicit value not
    trainer, _, _ = build_sft_trainer(RunContext.load(model_args, data_args, args))
    layers = [m for m in trainer.model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert len(layers) == 4  # the tiny-llama config's decoder layers
    released = on or bool(model_args.lora)  # with lora the free heap goes back, checkpointed or not
    assert all(bool(layer._forward_hooks) is released for layer in layers)


def test_the_free_heap_goes_back_at_each_layer_boundary_of_a_training_step(monkeypatch):
    calls = []
    monkeypatch.setattr(memory, "release_free_heap", lambda: calls.append(1))
    model = tiny_model("llama")
    assert memory.release_between_layers(model) == LAYERS
    b = batch()
    step(model, b)
    assert len(calls) == 2 * LAYERS  # after each layer's forward, before each layer's backward
    model.eval()
    with torch.no_grad():
        token_log_probs(model, model.get_output_embeddings(), b)
    model.train()
    with torch.no_grad():  # a frozen forward in training mode (PPO's old log-probs)
        token_log_probs(model, model.get_output_embeddings(), b)
    assert len(calls) == 2 * LAYERS  # evaluation and frozen forwards: left alone
    assert memory.release_between_layers(model) == LAYERS  # asked again: no second hook
    step(model, b)
    assert len(calls) == 4 * LAYERS


@pytest.mark.parametrize(
    "setting, actor_on, critic_on", [(None, True, False), (False, False, False), (True, True, True)]
)
def test_a_ppo_lora_role_is_checkpointed_unless_told_otherwise(tmp_path, caplog, setting, actor_on, critic_on):
    """``training.gradient_checkpointing`` unset: on for the LoRA actor, off for the fully trained critic."""
    training = {} if setting is None else {"gradient_checkpointing": setting}
    demo = os.path.join(ROOT, "llm", "config", "tiny", "ppo_lora_argument.json")
    c = parse_ppo_config([ppo_config_file(tmp_path, demo, "ppo", {"training": training, "critic": {"lora": False}})])
    assert c.training.gradient_checkpointing is setting  # the config keeps what was given
    run = PPOContext.load(c)
    with caplog.at_level(logging.INFO):
        actor, critic = build_actor(c, Place(), run).model, build_critic(c, Place(), run).model
    said = [r.getMessage() for r in caplog.records if "activation checkpointing on (the LoRA default" in r.getMessage()]
    assert len(said) == (setting is None) and all(m.startswith("actor_rollout: ") for m in said)  # the default, said
    for model, on, released in ((actor, actor_on, True), (critic, critic_on, critic_on)):
        assert model.is_gradient_checkpointing is on
        layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        # the free heap goes back in the LoRA actor always, in the full critic with checkpointing
        assert layers and all(len(layer._forward_hooks) == int(released) for layer in layers)
