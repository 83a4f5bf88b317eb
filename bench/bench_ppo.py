"""One PPO step, ours vs TRL 1.12 ``PPOTrainer``, same tiny models, prompts, batch and response length (CPU).

Each side runs in its own subprocess (clean peak RSS); the sides are interleaved and repeated, and
the table reports medians. Both sample exactly ``--response-len`` tokens (EOS ignored on both: TRL
with ``stop_token=None``, ours with ``ignore_eos``), one PPO epoch over 2 mini-batches, AdamW, no
gradient clipping. TRL's phases are timed by wrapping its ``batch_generation`` (rollout) and its
optimizer step calls (update = from the first optimizer step to the end of the step); the rest is
scoring (log-probs, reference, values, reward, advantages).

    python bench/bench_ppo.py [--repeats 3] [--steps 3] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def build_models(attn: str, vocab: int, hidden: int, layers: int):
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from llm.utils.modeling import tiny_config

    cfg = tiny_config(
        "llama",
        vocab,
        pad_token_id=0,
        num_labels=1,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    transformers.set_seed(1)
    policy = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=attn)
    transformers.set_seed(2)
    critic = AutoModelForSequenceClassification.from_config(copy.deepcopy(cfg), attn_implementation=attn)
    transformers.set_seed(3)
    reward = AutoModelForSequenceClassification.from_config(copy.deepcopy(cfg), attn_implementation=attn)
    return policy, copy.deepcopy(policy), critic, reward


def prompts_tensor(n: int, length: int):
    import torch

    return torch.randint(7, 600, (n, length), generator=torch.Generator().manual_seed(0))


def run_ours(a) -> dict:
    import torch

    from llm.alignment.ppo.build import policy_update, value_update
    from llm.alignment.ppo.config import (
        ActorRolloutSection,
        AlgorithmSection,
        CriticSection,
        DataSection,
        KLCtrlSection,
        PPOConfig,
        RefSection,
        ResourcePool,
        RewardSection,
        TrainingSection,
    )
    from llm.alignment.ppo.roles import ActorRole, CriticRole, ORMReward, PolicyModel, TrainableRole
    from llm.alignment.ppo.trainer import PPOTrainer, Prompt
    from llm.utils.attention import PACKED_SDPA
    from tests.helpers import tokenizer

    torch.set_num_threads(a.threads)
    tok = tokenizer()
    policy, ref, critic, reward = build_models(PACKED_SDPA, len(tok), a.hidden, a.layers)
    mb = a.batch // 2
    config = PPOConfig(
        training=TrainingSection(
            seed=0, learning_rate=1e-5, max_grad_norm=0.0, max_steps=a.steps, micro_batch_size=a.batch, report_to="none"
        ),
        actor_rollout=ActorRolloutSection(
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_response_length=a.response_len,
            ppo_mini_batch_size=mb,
            ppo_epochs=1,
            shuffle_minibatch=True,
            ignore_eos=True,
        ),
        critic=CriticSection(critic_mini_batch_size=mb, critic_update_epochs=1, value_loss_coef=0.1),
        ref=RefSection(),
        reward=RewardSection(type="orm"),
        algorithm=AlgorithmSection(kl_ctrl=KLCtrlSection(kl_coef=0.05)),
        data=DataSection(rollout_batch_size=a.batch),
        resource_pool=ResourcePool(),
    )
    prompts = [Prompt(p.tolist(), "", None) for p in prompts_tensor(a.batch, a.prompt_len)]
    trainer = PPOTrainer(
        config,
        prompts,
        tok,
        ActorRole(
            policy,
            tok,
            1.0,
            a.batch,
            TrainableRole(policy, 1e-5, 0.0, (0.9, 0.999), 1e-8, 0.0, 0),
            policy_update(config),
        ),
        ORMReward(reward.eval(), tok, tok, a.batch),
        PolicyModel(ref.eval(), tok, 1.0, a.batch),
        CriticRole(
            critic, tok, a.batch, TrainableRole(critic, 1e-5, 0.0, (0.9, 0.999), 1e-8, 0.0, 0), value_update(config)
        ),
    )
    steps = [trainer.train_step() for _ in range(a.steps)][1:]  # first step is warm-up
    med = {
        k: statistics.median(s[k] for s in steps)
        for k in ("time/rollout", "time/score", "time/advantages", "time/update", "time/step")
    }
    return {
        "rollout": med["time/rollout"],
        "score": med["time/score"] + med["time/advantages"],
        "update": med["time/update"],
        "step": med["time/step"],
    }


def run_trl(a) -> dict:
    import numpy as np
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl.experimental.ppo import PPOConfig as TRLConfig
    from trl.experimental.ppo import PPOTrainer as TRLTrainer
    from trl.experimental.ppo import ppo_trainer as trl_module

    from tests.helpers import tokenizer

    torch.set_num_threads(a.threads)
    tok = tokenizer()
    policy, ref, critic, reward = build_models("sdpa", len(tok), a.hidden, a.layers)
    marks: dict[str, list[float]] = {"gen": [], "first_opt": [], "end": [], "start": []}
    original_gen = trl_module.batch_generation

    def timed_gen(*args, **kwargs):
        t0 = time.perf_counter()
        out = original_gen(*args, **kwargs)
        marks["start"].append(t0)
        marks["gen"].append(time.perf_counter() - t0)
        marks["first_opt"].append(None)
        return out

    trl_module.batch_generation = timed_gen

    class EndOfStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks["end"].append(time.perf_counter())

    with tempfile.TemporaryDirectory() as tmp:
        args = TRLConfig(
            output_dir=tmp,
            report_to="none",
            use_cpu=True,
            seed=0,
            per_device_train_batch_size=a.batch // 2,
            gradient_accumulation_steps=1,
            num_mini_batches=2,
            num_ppo_epochs=1,
            total_episodes=a.batch // 2 * 2 * a.steps,
            response_length=a.response_len,
            temperature=1.0,
            kl_coef=0.05,
            vf_coef=0.1,
            learning_rate=1e-5,
            lr_scheduler_type="constant",
            num_sample_generations=0,
            stop_token=None,
            local_rollout_forward_batch_size=a.batch,
            save_strategy="no",
            disable_tqdm=True,
            logging_steps=10_000,
        )
        # TRL's batch is per_device_train_batch_size x gradient_accumulation x num_mini_batches: make it a.batch
        args.per_device_train_batch_size = a.batch
        args.num_mini_batches = 2
        args.total_episodes = a.batch * a.steps
        dataset = Dataset.from_dict({"input_ids": prompts_tensor(a.batch, a.prompt_len).tolist()})
        trainer = TRLTrainer(
            args=args,
            processing_class=tok,
            model=policy,
            ref_model=ref,
            reward_model=reward,
            train_dataset=dataset,
            value_model=critic,
            callbacks=[EndOfStep()],
        )
        original_step = trainer.optimizer.step

        def timed_step(*s_args, **s_kwargs):
            if marks["first_opt"][-1] is None:
                marks["first_opt"][-1] = time.perf_counter()
            return original_step(*s_args, **s_kwargs)

        trainer.optimizer.step = timed_step
        np.random.seed(0)
        trainer.train()
    rows = []
    for start, gen, first, end in zip(marks["start"], marks["gen"], marks["first_opt"], marks["end"]):
        rows.append({"rollout": gen, "score": first - start - gen, "update": end - first, "step": end - start})
    rows = rows[1:]  # warm-up
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def side(a) -> None:
    out = run_ours(a) if a.side == "ours" else run_trl(a)
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--side", choices=["ours", "trl"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--response-len", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out")
    a = p.parse_args()
    if a.side:
        return side(a)
    if a.quick:
        a.batch, a.response_len, a.steps, a.repeats, a.hidden = 8, 16, 2, 1, 128
    results: dict[str, list[dict]] = {"ours": [], "trl": []}
    for _ in range(a.repeats):
        for name in ("ours", "trl"):  # interleaved
            cmd = [
                sys.executable,
                __file__,
                "--side",
                name,
                "--batch",
                str(a.batch),
                "--prompt-len",
                str(a.prompt_len),
                "--response-len",
                str(a.response_len),
                "--hidden",
                str(a.hidden),
                "--layers",
                str(a.layers),
                "--steps",
                str(a.steps),
                "--threads",
                str(a.threads),
            ]
            env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": str(a.threads)}
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            if proc.returncode:
                sys.exit(f"{name} failed:\n{proc.stderr[-4000:]}")
            results[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    med = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in results.items()}
    print(
        f"PPO step, B={a.batch} prompts x {a.prompt_len} tokens, {a.response_len} response tokens, llama "
        f"hidden {a.hidden} x {a.layers} layers, {a.threads} threads, median of {a.repeats} runs x {a.steps - 1} steps"
    )
    print("| phase | ours (s) | TRL (s) | ours / TRL |\n|---|---|---|---|")
    for k in ("rollout", "score", "update", "step"):
        print(f"| {k} | {med['ours'][k]:.3f} | {med['trl'][k]:.3f} | {med['ours'][k] / med['trl'][k]:.2f} |")
    print(
        f"| peak RSS (MB) | {med['ours']['peak_rss_mb']:.0f} | {med['trl']['peak_rss_mb']:.0f} | "
        f"{med['ours']['peak_rss_mb'] / med['trl']['peak_rss_mb']:.2f} |"
    )
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump({"args": vars(a), "runs": results, "median": med}, f, indent=1)


if __name__ == "__main__":
    main()
