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


def build_models(attn: str, vocab: int, hidden: int, layers: int, eos_bias: float = 0.0, eos_id: int = 2):
    import torch
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
    if eos_bias:  # a biased LM head: EOS gets ~exp(bias) / vocab per token, so sampled lengths vary
        head = torch.nn.Linear(hidden, vocab, bias=True)
        with torch.no_grad():
            head.weight.copy_(policy.lm_head.weight)
            head.bias.zero_()
            head.bias[eos_id] = eos_bias
        policy.lm_head = head
    transformers.set_seed(2)
    critic = AutoModelForSequenceClassification.from_config(copy.deepcopy(cfg), attn_implementation=attn)
    transformers.set_seed(3)
    reward = AutoModelForSequenceClassification.from_config(copy.deepcopy(cfg), attn_implementation=attn)
    return policy, copy.deepcopy(policy), critic, reward


def prompt_ids(a, tok) -> list[list[int]]:
    """fixed: ``batch`` random prompts of ``prompt_len`` tokens; realistic: the first ``batch`` sample
    prompts (llm/data/sample/prompts.jsonl) tokenised with the tiny tokenizer (18..42 tokens)."""
    import torch

    if a.mode == "fixed":
        return torch.randint(7, 600, (a.batch, a.prompt_len), generator=torch.Generator().manual_seed(0)).tolist()
    with open(os.path.join(ROOT, "llm/data/sample/prompts.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [tok(r["src"]).input_ids for r in rows[: a.batch]]


class Timers:
    """Wraps methods to accumulate their wall time per key (reset per step)."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = {}

    def wrap(self, obj, name: str, key: str) -> None:
        original = getattr(obj, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.acc[key] = self.acc.get(key, 0.0) + time.perf_counter() - t0

        setattr(obj, name, timed)

    def take(self) -> dict[str, float]:
        out, self.acc = self.acc, {}
        return out


def run_ours(a) -> dict:
    import torch

    from llm.alignment.ppo.build import trainer_for_models
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
    from llm.alignment.ppo.trainer import Prompt
    from llm.utils.attention import PACKED_SDPA
    from tests.helpers import tokenizer

    torch.set_num_threads(a.threads)
    tok = tokenizer()
    policy, ref, critic, reward = build_models(PACKED_SDPA, len(tok), a.hidden, a.layers, a.eos_bias, tok.eos_token_id)
    mb = a.batch // 2
    config = PPOConfig(
        training=TrainingSection(
            seed=a.seed,
            learning_rate=1e-5,
            max_grad_norm=0.0,
            max_steps=a.steps,
            micro_batch_size=a.batch,
            report_to="none",
        ),
        actor_rollout=ActorRolloutSection(
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_response_length=a.response_len,
            ppo_mini_batch_size=mb,
            ppo_epochs=1,
            shuffle_minibatch=True,
            ignore_eos=a.mode == "fixed",
            rollout_log_probs=not a.recompute_logprobs,
        ),
        critic=CriticSection(critic_mini_batch_size=mb, critic_update_epochs=1, value_loss_coef=0.1),
        ref=RefSection(),
        reward=RewardSection(type="orm"),
        algorithm=AlgorithmSection(kl_ctrl=KLCtrlSection(kl_coef=0.05)),
        data=DataSection(rollout_batch_size=a.batch),
        resource_pool=ResourcePool(),
    )
    prompts = [Prompt(p, "", None) for p in prompt_ids(a, tok)]
    trainer = trainer_for_models(config, prompts, tok, policy, ref, critic, reward)
    timers = Timers()
    timers.wrap(trainer.actor, "log_probs", "score/actor_logprobs")
    timers.wrap(trainer.ref, "log_probs", "score/ref_logprobs")
    timers.wrap(trainer.critic, "values", "score/values")
    timers.wrap(trainer.reward, "score", "score/reward")
    timers.wrap(trainer, "update_actor", "update/actor")
    timers.wrap(trainer, "update_critic", "update/critic")
    steps = []
    for _ in range(a.steps):
        c0 = time.process_time()
        m = trainer.train_step()
        steps.append({**m, **timers.take(), "time/step_cpu": time.process_time() - c0})
    steps = steps[1:]  # first step is warm-up
    med = {k: statistics.median(s[k] for s in steps) for k in steps[0] if k.startswith(("time/", "score/", "update/"))}
    return {
        "rollout": med["time/rollout"],
        "score": med["time/score"] + med["time/advantages"],
        "update": med["time/update"],
        "step": med["time/step"],
        "step_cpu": med["time/step_cpu"],
        **{k: v for k, v in med.items() if not k.startswith("time/")},
        "response_tokens": statistics.median(s["response_length"] for s in steps),
        "padded_width": statistics.median(s["response_length"] for s in steps),  # ours packs: no padding
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
    tok.padding_side = "left"  # TRL's collator pads the variable-length prompts; generation needs left
    policy, ref, critic, reward = build_models("sdpa", len(tok), a.hidden, a.layers, a.eos_bias, tok.eos_token_id)
    marks: dict[str, list] = {"gen": [], "whiten": [], "end": [], "start": [], "tokens": [], "width": [], "sub": []}
    marks.update(cpu0=[], cpu1=[])
    original_gen = trl_module.batch_generation
    timers = Timers()

    def timed_gen(model, queries, *args, **kwargs):
        timers.take()
        t0, c0 = time.perf_counter(), time.process_time()
        out = original_gen(model, queries, *args, **kwargs)
        marks["start"].append(t0)
        marks["cpu0"].append(c0)
        marks["gen"].append(time.perf_counter() - t0)
        marks["whiten"].append(None)
        resp = out[0][:, queries.shape[1] :]
        lengths = [r.index(tok.eos_token_id) + 1 if tok.eos_token_id in r else len(r) for r in resp.tolist()]
        marks["tokens"].append(sum(lengths) / len(lengths))
        marks["width"].append(resp.shape[1])
        return out

    original_whiten = trl_module.masked_whiten

    def mark_whiten(*w_args, **w_kwargs):  # the advantages' whitening: the update loop starts right after
        out = original_whiten(*w_args, **w_kwargs)
        marks["whiten"][-1] = time.perf_counter()
        marks["sub"].append(timers.take())
        return out

    trl_module.batch_generation = timed_gen
    trl_module.masked_whiten = mark_whiten
    timers.wrap(trl_module, "forward", "score/ref_logprobs")  # before the update: the reference forward
    timers.wrap(trl_module, "get_reward", "score/values+reward")
    timers.wrap(trl_module, "selective_log_softmax", "score/actor_logprobs")  # from generation's logits

    class EndOfStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks["end"].append(time.perf_counter())
            marks["cpu1"].append(time.process_time())

    with tempfile.TemporaryDirectory() as tmp:
        args = TRLConfig(
            output_dir=tmp,
            report_to="none",
            use_cpu=True,
            seed=a.seed,
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
            stop_token=None if a.mode == "fixed" else "eos",
            missing_eos_penalty=None,
            local_rollout_forward_batch_size=a.batch,
            save_strategy="no",
            disable_tqdm=True,
            logging_steps=10_000,
        )
        # TRL's batch is per_device_train_batch_size x gradient_accumulation x num_mini_batches: make it a.batch
        args.per_device_train_batch_size = a.batch
        args.num_mini_batches = 2
        args.total_episodes = a.batch * a.steps
        dataset = Dataset.from_dict({"input_ids": prompt_ids(a, tok)})
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
        np.random.seed(a.seed)
        trainer.train()
    rows = []
    for start, gen, whiten, end, tokens, width, sub, cpu0, cpu1 in zip(
        *(marks[k] for k in ("start", "gen", "whiten", "end", "tokens", "width", "sub", "cpu0", "cpu1"))
    ):
        rows.append(
            {
                "rollout": gen,
                "score": whiten - start - gen,
                "update": end - whiten,
                "step": end - start,
                "step_cpu": cpu1 - cpu0,
                **sub,
                "response_tokens": tokens,
                "padded_width": width,
            }
        )
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
    p.add_argument("--response-len", type=int, help="response length cap (default: fixed 32, realistic 64)")
    p.add_argument(
        "--mode",
        choices=["realistic", "fixed"],
        default="realistic",
        help="realistic: sample prompts of 18..42 tokens, responses stop at EOS (biased head); "
        "fixed: equal random prompts, exactly --response-len tokens (EOS ignored)",
    )
    p.add_argument("--eos-bias", type=float, help="EOS logit bias of the actor head (default: realistic 3.0, fixed 0)")
    p.add_argument(
        "--recompute-logprobs",
        action="store_true",
        help="ours: old log-probs by a packed forward after generation (rollout_log_probs false) instead of "
        "from the generation's logits (TRL's way, the default here)",
    )
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="sampling seed of one run (the driver gives repeat k seed k on both sides, so that the sampled "
        "response lengths, which set the work, average out over repeats instead of favouring one side)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out")
    a = p.parse_args()
    if a.response_len is None:
        a.response_len = 32 if a.mode == "fixed" else 64
    if a.eos_bias is None:
        a.eos_bias = 0.0 if a.mode == "fixed" else 3.0
    if a.side:
        return side(a)
    if a.quick:
        a.batch, a.response_len, a.steps, a.repeats, a.hidden = 8, 16, 2, 1, 128
    results: dict[str, list[dict]] = {"ours": [], "trl": []}
    for rep in range(a.repeats):
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
                "--mode",
                a.mode,
                "--eos-bias",
                str(a.eos_bias),
                *(["--recompute-logprobs"] if a.recompute_logprobs else []),
                "--seed",
                str(a.seed + rep),
            ]
            env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": str(a.threads)}
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            if proc.returncode:
                sys.exit(f"{name} failed:\n{proc.stderr[-4000:]}")
            results[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    med = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in results.items()}
    prompts = "18..42-token sample prompts" if a.mode == "realistic" else f"prompts x {a.prompt_len} tokens"
    cap = "stop at EOS" if a.mode == "realistic" else "EOS ignored"
    print(
        f"PPO step ({a.mode}), B={a.batch} {prompts}, responses <= {a.response_len} tokens ({cap}, EOS bias "
        f"{a.eos_bias}), llama hidden {a.hidden} x {a.layers} layers, {a.threads} threads, "
        f"median of {a.repeats} runs x {a.steps - 1} steps; ours' old log-probs "
        + ("recomputed by a forward" if a.recompute_logprobs else "from the generation's logits")
    )
    print("| phase | ours (s) | TRL (s) | ours / TRL |\n|---|---|---|---|")
    keys = ["rollout", "score", "update", "step", "step_cpu"]
    keys[2:2] = sorted(k for k in set(med["ours"]) | set(med["trl"]) if k.startswith(("score/", "update/")))
    for k in keys:
        o, t = med["ours"].get(k), med["trl"].get(k)
        ratio = f"{o / t:.2f}" if o is not None and t else ""
        print(f"| {k} | {'' if o is None else f'{o:.3f}'} | {'' if t is None else f'{t:.3f}'} | {ratio} |")
    for k in ("response_tokens", "padded_width"):
        print(f"| {k} (mean / width) | {med['ours'][k]:.1f} | {med['trl'][k]:.1f} | |")
    print(
        f"| peak RSS (MB) | {med['ours']['peak_rss_mb']:.0f} | {med['trl']['peak_rss_mb']:.0f} | "
        f"{med['ours']['peak_rss_mb'] / med['trl']['peak_rss_mb']:.2f} |"
    )
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump({"args": vars(a), "runs": results, "median": med}, f, indent=1)


if __name__ == "__main__":
    main()
