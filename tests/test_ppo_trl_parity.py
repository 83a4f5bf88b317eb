"""PPO parity with TRL 1.12's PPOTrainer on fixed (pre-generated) responses, the method MindSpeed used.

Same tiny actor, reference, critic and reward weights, same prompts, same responses; both sides set
to the same math: k1 KL in the reward (coef 0.05, fixed), GAE (gamma 1, lam 0.95), advantage
whitening, clip 0.2, value clip 0.2, value-loss coefficient 0.1, AdamW lr 1e-3 with a constant
schedule, no gradient clipping (TRL has none), 2 PPO epochs over 2 mini-batches of 4, no shuffling.

How TRL is driven with fixed responses (TRL cannot take them as input):
- ``batch_generation`` in TRL's module is replaced: it appends each query's fixed response and
  returns the policy's logits at the response positions divided by ``temperature + 1e-7``, exactly
  what TRL's own ``generate`` returns (``output.scores`` with top_k 0, top_p 1);
- ``numpy.random.permutation`` (TRL's mini-batch shuffle) is the identity, matching our
  ``shuffle_minibatch: false``;
- TRL's values are read where it computes them: the per-token rewards, raw advantages, returns
  are locals of ``PPOTrainer.train`` when it calls ``masked_whiten`` on the advantages, and the
  mini-batch losses are locals when it calls ``optimizer.step()``; thin wrappers copy them out.
Responses are full length with no EOS and prompts share one length, so TRL needs no padding (its
padded path places the score one token past the EOS, see the closing note of the PPO issue).
"""

import inspect

import numpy as np
import pytest
import torch

from bench.ppo_sides import parity_models as models
from bench.ppo_sides import parity_ours_config as ours_config
from bench.ppo_sides import parity_trl_args as trl_args
from llm.alignment.ppo.build import build_from_models as trainer_for_models
from llm.alignment.ppo.prompts import Prompt
from llm.utils.attention import PACKED_SDPA
from tests.helpers import tokenizer

B, P_LEN, R_LEN, STEPS = 8, 10, 6, 3
LR = 1e-3


def fixed_data():
    gen = torch.Generator().manual_seed(5)
    # token ids 7.. avoid <pad>=0, <s>=1, </s>=2 and the special chat tokens
    prompts = torch.randint(7, 600, (B, P_LEN), generator=gen)
    responses = torch.randint(7, 600, (B, R_LEN), generator=gen)
    return prompts, responses


def run_trl(tmp_path, monkeypatch):
    from datasets import Dataset
    from trl.experimental.ppo import PPOTrainer as TRLTrainer
    from trl.experimental.ppo import ppo_trainer as trl_module

    tok = tokenizer()
    prompts, responses = fixed_data()
    by_prompt = {tuple(p.tolist()): r for p, r in zip(prompts, responses)}
    policy, ref, critic, reward = models("sdpa")
    captured = {"orders": [], "token": [], "losses": []}

    def fixed_generation(model, queries, batch_size, pad_token_id, generation_config):
        captured["orders"].append([next(i for i, p in enumerate(prompts) if torch.equal(p, q)) for q in queries])
        query_responses = torch.cat([queries, torch.stack([by_prompt[tuple(q.tolist())] for q in queries])], 1)
        logits = model(input_ids=query_responses).logits[:, P_LEN - 1 : -1]
        return query_responses, logits / (generation_config.temperature)

    original_whiten = trl_module.masked_whiten

    def spy_whiten(values, mask, shift_mean=True):
        frame = inspect.currentframe().f_back.f_locals
        out = original_whiten(values, mask, shift_mean)
        captured["token"].append(
            {"rewards": frame["rewards"].clone(), "returns": frame["returns"].clone(), "advantages": out.clone()}
        )
        return out

    monkeypatch.setattr(trl_module, "batch_generation", fixed_generation)
    monkeypatch.setattr(trl_module, "masked_whiten", spy_whiten)
    monkeypatch.setattr(np.random, "permutation", lambda n: np.arange(n))

    args = trl_args(str(tmp_path / "trl"), B, STEPS, R_LEN, LR)
    dataset = Dataset.from_dict({"input_ids": prompts.tolist()})
    trainer = TRLTrainer(
        args=args,
        processing_class=tok,
        model=policy,
        ref_model=ref,
        reward_model=reward,
        train_dataset=dataset,
        value_model=critic,
    )
    original_step = trainer.optimizer.step

    def spy_step(*a, **k):
        frame = inspect.currentframe().f_back.f_locals
        captured["losses"].append((frame["pg_loss"].item(), frame["vf_loss"].item()))
        return original_step(*a, **k)

    trainer.optimizer.step = spy_step
    trainer.train()
    return captured


def run_ours(orders):
    tok = tokenizer()
    prompts, responses = fixed_data()
    policy, ref, critic, reward = models(PACKED_SDPA)
    config = ours_config(B, STEPS, LR)
    prompt_list = [Prompt(p.tolist(), f"prompt {i}", None) for i, p in enumerate(prompts)]
    trainer = trainer_for_models(config, prompt_list, tok, policy, ref, critic, reward)
    trainer.prompt_indices = lambda step: orders[step]
    tokens, losses = [], []
    for step in range(STEPS):
        trainer.history.clear()
        trainer.train_step(responses=[responses[i].tolist() for i in orders[step]])
        exp = trainer.last_experience
        tokens.append({"rewards": exp.rewards, "returns": exp.returns, "advantages": exp.advantages})
        actor_losses = [h["loss"] for h in trainer.history if h["role"] == "actor"]
        critic_losses = [h["loss"] for h in trainer.history if h["role"] == "critic"]
        losses += list(zip(actor_losses, critic_losses))
    return tokens, losses


@pytest.mark.filterwarnings("ignore")
def test_rewards_advantages_returns_and_losses_equal_trl(tmp_path, monkeypatch):
    trl = run_trl(tmp_path, monkeypatch)
    assert len(trl["orders"]) == STEPS and len(trl["losses"]) == STEPS * 2 * 2
    ours_tokens, ours_losses = run_ours(trl["orders"])
    for step in range(STEPS):
        for key in ("rewards", "advantages", "returns"):
            diff = (ours_tokens[step][key] - trl["token"][step][key]).abs().max().item()
            assert diff <= 1e-5, (step, key, diff)
    worst = max(max(abs(a - c), abs(b - d)) for (a, b), (c, d) in zip(ours_losses, trl["losses"]))
    assert worst <= 1e-4, (worst, ours_losses, trl["losses"])
    # the update really moved things: later steps' losses differ from the first
    assert len({round(x[0], 6) for x in trl["losses"]}) > 1
