"""``rollout_log_probs``: the actor's old log-probs taken from the generation's own logits equal the packed
forward's (the default path), and a run with it equals a run without."""

import pytest
import torch

from llm.alignment.ppo.prompts import Prompt, make_samples
from llm.alignment.ppo.roles import PolicyModel
from llm.run_ppo import main
from tests.helpers import tiny_model, tokenizer
from tests.test_ppo_run import config, history


@pytest.mark.parametrize(
    "sampling",
    [
        {"do_sample": True, "top_p": 0.9, "top_k": 20},  # warpers must not leak into the log-probs
        {"do_sample": False, "top_p": 1.0, "top_k": 0},
    ],
)
def test_generated_log_probs_equal_the_packed_forward(sampling):
    tok = tokenizer()
    model = tiny_model(hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    head = torch.nn.Linear(64, model.lm_head.out_features, bias=True)  # an EOS bias: some responses stop early
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[tok.eos_token_id] = 3.0
    model.lm_head = head
    policy = PolicyModel(model, tok, temperature=0.7, micro_batch_size=3)
    prompts = [tok("Tony buys 3 kg of cheese.")["input_ids"], tok("2 + 2")["input_ids"], [5, 6, 7, 8, 9, 10, 11]]
    n = 2 if sampling["do_sample"] else 1  # greedy samples would be identical (the config refuses n > 1)
    responses, logprobs = policy.generate(
        prompts, num_samples=n, max_new_tokens=12, seed=3, with_log_probs=True, **sampling
    )
    again = policy.generate(prompts, num_samples=n, max_new_tokens=12, seed=3, **sampling)
    assert responses == again  # recording changes nothing in the generation
    lengths = [len(r) for r in responses]
    assert all(lengths) and (len(set(lengths)) > 1 or not sampling["do_sample"]), lengths
    samples = make_samples([Prompt(p, "", None) for p in prompts], responses, tok)
    reference = policy.log_probs(samples)
    assert logprobs.shape == reference.shape
    assert (logprobs[samples.response_mask() == 0] == 0).all()
    torch.testing.assert_close(logprobs, reference, rtol=0, atol=1e-5)
    assert (reference.abs() > 1e-3).sum() > 0.9 * sum(lengths)  # not trivially zero


def test_run_with_rollout_log_probs_equals_run_without(tmp_path, monkeypatch):
    """Same seed, same sampled responses; the losses and statistics differ only by float rounding, and the
    actor's scoring forward is gone (actor + reference per step without, the reference only with)."""
    calls = []
    log_probs = PolicyModel.log_probs
    monkeypatch.setattr(PolicyModel, "log_probs", lambda self, *a, **k: calls.append(self) or log_probs(self, *a, **k))
    runs, forwards = {}, {}
    for reuse in (False, True):
        calls.clear()
        out = tmp_path / f"out_{reuse}"
        main(
            [
                config(
                    tmp_path,
                    training={"output_dir": str(out)},
                    actor_rollout={"rollout_log_probs": reuse, "num_samples_per_step": 2, "ppo_epochs": 2},
                )
            ]
        )
        runs[reuse] = history(out)
        forwards[reuse] = len(calls)
    assert forwards == {False: 4, True: 2}  # 2 steps
    for a, b in zip(runs[False], runs[True], strict=True):
        for key in ("score", "kl", "response_length", "policy_loss", "value_loss", "approx_kl", "clipfrac"):
            assert b[key] == pytest.approx(a[key], abs=1e-5), key


def test_fsdp2_generation_gathers_each_module_once(monkeypatch):
    """gathered_for_decoding: an FSDP2-sharded policy all-gathers each module once per generate call
    instead of at every decoding step, with the same responses (a 1-process gloo group)."""
    import socket

    import torch.distributed as dist
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group
    from torch.distributed.fsdp import fully_shard

    from llm.alignment.ppo.fsdp import gathered_for_decoding

    gathers = []  # unshards that gather (not the no-op ones of an already unsharded module)
    real = param_group.FSDPParamGroup.unshard

    def unshard(self, *args, **kwargs):
        if not self.is_unsharded:
            gathers.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(param_group.FSDPParamGroup, "unshard", unshard)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        tok = tokenizer()
        model = tiny_model(hidden_size=64, intermediate_size=128, num_hidden_layers=2).eval()
        for layer in model.model.layers:
            fully_shard(layer, reshard_after_forward=True)
        fully_shard(model, reshard_after_forward=True)
        prompt = torch.tensor([tok("Tony buys 3 kg of cheese.")["input_ids"]])
        kwargs = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "pad_token_id": tok.pad_token_id}
        runs = {}
        for gather in (False, True):
            gathers.clear()
            with torch.no_grad(), gathered_for_decoding(model, gather):
                out = model.generate(prompt, **kwargs)
            runs[gather] = (out.tolist(), len(gathers))
        modules = 3  # two layers and the root
        assert runs[True][0] == runs[False][0]
        assert runs[True][1] == modules and runs[False][1] == 8 * modules  # once, against once per step
        # afterwards the model is sharded again and trains as before: a forward gathers again
        gathers.clear()
        model(prompt)
        assert len(gathers) >= 2
    finally:
        dist.destroy_process_group()
