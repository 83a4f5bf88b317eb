"""Peak RSS of PPO with LoRA (actor and critic adapters, the reference = the actor's base with the adapter
disabled) vs full fine-tuning, ours and TRL 1.12 ``PPOTrainer`` (``peft_config``), on one seeded random Llama
(default ~45M parameters: hidden 640 x 9 layers, vocab 648), CPU.

Sides, each in its own subprocess (``harness.run_worker``: its own peak RSS):

* ``ours_full``: actor, reference (a frozen copy), critic, ORM reward: four models, AdamW on actor and critic.
* ``ours_lora``: the same with ``lora`` on actor and critic (rank ``--rank``, the default projections; the
  critic's score head trained): no reference copy, AdamW state for the adapters only.
* ``trl_full`` / ``trl_lora``: TRL's ``PPOTrainer`` over the same models; with ``peft_config`` TRL wraps the
  policy with peft and uses its disabled adapter as the reference (``ref_model=None``); TRL's value model is
  always fully trained (it has no LoRA for it).

Every side runs ``--steps`` PPO steps of ``--batch`` prompts, exactly ``--response-len`` sampled tokens (EOS
ignored), 2 mini-batches x 2 epochs (the TRL parity settings, ``ppo_sides``). Reported: peak RSS of the side's
process, the RSS once the models are built, and the difference (what training added), medians of
``--repeats`` interleaved runs. Memory, not speed, is the point here; timings are printed for reference only.

    python bench/bench_ppo_lora.py                  # 45M model, 3 steps, 2 repeats
    python bench/bench_ppo_lora.py --quick          # the tiny demo size, 1 repeat (smoke test)
    python bench/bench_ppo_lora.py --sides ours_full,ours_lora
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.harness import (
    add_worker_flags,
    environment,
    forward_flags,
    markdown_table,
    medians,
    rss_mib,
    run_interleaved,
    run_worker,
    start_worker,
    tokenizer,
    worker_env,
    worker_result,
    write_report,
)
from bench.ppo_sides import parity_ours_config, parity_trl_args, trl_trainer

SIDES = ("ours_full", "ours_lora", "trl_full", "trl_lora")
WORKER_SETTINGS = (
    "batch",
    "prompt_len",
    "response_len",
    "hidden",
    "layers",
    "intermediate",
    "steps",
    "rank",
    "threads",
)
LR = 1e-5


def models(a, attn: str, with_ref: bool = True):
    """policy, reference (a copy of the policy; None without ``with_ref``: never built, so not in the peak),
    critic, reward: seeded random Llamas of the chosen size (as ``ppo_sides.four_models``), with ``attn`` (ours:
    the packed kernel its forwards need; TRL: sdpa)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from llm.utils.modeling import tiny_config

    sizes = {"hidden_size": a.hidden, "num_hidden_layers": a.layers, "intermediate_size": a.intermediate}
    cfg = tiny_config("llama", 648, pad_token_id=0, num_labels=1, num_attention_heads=8, num_key_value_heads=8, **sizes)
    built = []
    for seed, auto in (
        (1, AutoModelForCausalLM),
        (2, AutoModelForSequenceClassification),
        (3, AutoModelForSequenceClassification),
    ):
        transformers.set_seed(seed)
        built.append(auto.from_config(copy.deepcopy(cfg), attn_implementation=attn))
    policy, critic, reward = built
    return policy, copy.deepcopy(policy) if with_ref else None, critic, reward


def prompts(a) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(0)
    return torch.randint(7, 600, (a.batch, a.prompt_len), generator=gen).tolist()


def lora_fields(section, rank: int) -> None:
    section.lora, section.lora_rank = True, rank


def run_ours(a, lora: bool) -> dict:
    from llm.alignment.ppo.build import build_from_models
    from llm.alignment.ppo.prompts import Prompt
    from llm.utils.attention import PACKED_SDPA
    from llm.utils.lora import apply_lora

    tok = tokenizer()
    c = parity_ours_config(a.batch, a.steps, LR, max_response_length=a.response_len, ignore_eos=True)
    policy, ref, critic, reward = models(a, PACKED_SDPA, with_ref=not lora)
    if lora:
        lora_fields(c.actor_rollout, a.rank)
        lora_fields(c.critic, a.rank)
        policy = apply_lora(policy, c.actor_rollout, "causal_lm")
        critic = apply_lora(critic, c.critic, "seq_cls")  # ref None: the actor's base with the adapter disabled
    trainer = build_from_models(c, [Prompt(p, "", None) for p in prompts(a)], tok, policy, ref, critic, reward)
    built = rss_mib()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        trainer.train_step()
    return {"built_rss_mb": built, "train_s": time.perf_counter() - t0, **params(policy, critic)}


def run_trl(a, lora: bool) -> dict:
    import numpy as np
    from datasets import Dataset
    from peft import LoraConfig
    from trl.experimental.ppo import PPOTrainer

    from llm.utils.lora import DEFAULT_TARGETS

    tok = tokenizer()
    tok.padding_side = "left"
    policy, ref, critic, reward = models(a, "sdpa", with_ref=not lora)
    with tempfile.TemporaryDirectory() as tmp:
        args = parity_trl_args(tmp, a.batch, a.steps, a.response_len, LR)
        if not lora:
            trainer = trl_trainer(args, tok, (policy, ref, critic, reward), prompts(a))
        else:
            peft = LoraConfig(
                r=a.rank, lora_alpha=2 * a.rank, target_modules=list(DEFAULT_TARGETS), task_type="CAUSAL_LM"
            )
            trainer = PPOTrainer(
                args=args,
                processing_class=tok,
                model=policy,
                ref_model=None,
                reward_model=reward,
                train_dataset=Dataset.from_dict({"input_ids": prompts(a)}),
                value_model=critic,
                peft_config=peft,
            )
        built = rss_mib()
        np.random.seed(0)
        t0 = time.perf_counter()
        trainer.train()
        policy = trainer.model.policy
    return {"built_rss_mb": built, "train_s": time.perf_counter() - t0, **params(policy, trainer.model.value_model)}


def params(policy, critic) -> dict:
    trained = sum(p.numel() for m in (policy, critic) for p in m.parameters() if p.requires_grad)
    return {"policy_params_m": sum(p.numel() for p in policy.parameters()) / 1e6, "trained_params_m": trained / 1e6}


def run_side(a) -> dict:
    start_worker(a.threads)
    family, kind = a.side.split("_")
    out = (run_ours if family == "ours" else run_trl)(a, kind == "lora")
    out["peak_rss_mb"] = rss_mib()
    out["train_added_mb"] = out["peak_rss_mb"] - out["built_rss_mb"]
    return out


def table(med: dict) -> str:
    rows = []
    for side, m in med.items():
        rows.append(
            [
                side,
                f"{m['policy_params_m']:.1f}",
                f"{m['trained_params_m']:.2f}",
                f"{m['built_rss_mb']:.0f}",
                f"{m['peak_rss_mb']:.0f}",
                f"{m['train_added_mb']:.0f}",
                f"{m['train_s']:.1f}",
            ]
        )
    head = ["side", "policy params (M)", "trained params (M)", "RSS built (MiB)", "peak RSS (MiB)", "train-added"]
    return markdown_table([*head, "train (s)"], rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--response-len", type=int, default=16)
    p.add_argument("--hidden", type=int, default=640)
    p.add_argument("--layers", type=int, default=9)
    p.add_argument("--intermediate", type=int, default=1728)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--quick", action="store_true", help="the tiny demo's size (hidden 128 x 4), 1 repeat, 2 steps")
    p.add_argument("--out")
    add_worker_flags(p)
    a = p.parse_args()
    if a.side:
        worker_result(a.result, run_side(a))
        return
    if a.quick:
        a.hidden, a.layers, a.intermediate, a.repeats, a.steps = 128, 4, 256, 1, 2
    sides = [s for s in a.sides.split(",") if s]
    env = worker_env(a.threads)
    with tempfile.TemporaryDirectory(prefix="bench_ppo_lora_") as workdir:

        def run(side, rep):
            return run_worker(__file__, side, workdir, forward_flags(a, *WORKER_SETTINGS), env=env)

        describe = lambda r: f"peak {r['peak_rss_mb']:.0f} MiB, train-added {r['train_added_mb']:.0f} MiB"
        results = run_interleaved(sides, a.repeats, run, describe=describe)
    med = {side: medians(runs) for side, runs in results.items()}
    print(
        f"PPO, LoRA (rank {a.rank}) vs full fine-tuning: Llama hidden {a.hidden} x {a.layers} layers "
        f"(intermediate {a.intermediate}, vocab 648), B={a.batch}, {a.prompt_len}-token prompts, {a.response_len} "
        f"sampled tokens, {a.steps} steps, {a.threads} threads, median of {a.repeats} runs"
    )
    text = table(med)
    print(text)
    report = {"args": vars(a), "runs": results, "median": med, "table_markdown": text}
    report["environment"] = environment("bench/bench_ppo_lora.py", sys.argv[1:], a)
    write_report(a.out, report, indent=1)


if __name__ == "__main__":
    main()
