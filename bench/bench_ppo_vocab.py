"""PPO at a large vocabulary: peak RSS and step time of ours, with the LM head chunked over readouts and
not, against TRL 1.12 ``PPOTrainer``, on a Qwen2-shaped tiny model (vocabulary 151,936) (CPU).

The step is ``bench_ppo.py``'s fixed mode (its phases, timers, configs and TRL side, reused): ``--batch``
random prompts of ``--prompt-len`` tokens, exactly ``--response-len`` sampled response tokens on both sides
(EOS ignored), one PPO epoch over 2 mini-batches, AdamW, k1 KL in the reward; only the models differ: a
random Qwen2 (``tiny_config("qwen2", 151936)``, ``--hidden`` x ``--layers``, untied head) for actor,
reference, critic and reward. Sides, each in its own subprocess, interleaved over ``--repeats``:

- ``trl``: TRL's ``PPOTrainer`` (its forwards return ``(batch, T, V)`` logits);
- ``ours-unchunked``: ours with ``training.readout_chunk`` = 10**9, one LM-head block per packed row
  (all its readouts at once: the behaviour before the chunking);
- ``ours``: ours with ``--chunk`` readouts per block (log-probs, entropies, exact KL; checkpointed in backward).

``--kl full``: ours with the exact KL (``algorithm.kl_penalty: full``; TRL has no such estimator and stays k1).

    python bench/bench_ppo_vocab.py [--repeats 3] [--chunk 128] [--kl full] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import bench_ppo
from bench.harness import (
    add_worker_flags,
    environment,
    forward_flags,
    markdown_table,
    medians,
    num,
    rss_mib,
    run_interleaved,
    run_worker,
    worker_env,
    worker_result,
    write_report,
)
from bench.ppo_sides import four_models

SIDES = ("trl", "ours-unchunked", "ours")
QWEN2_VOCAB = 151_936
UNCHUNKED = 10**9
WORKER_SETTINGS = (
    "batch",
    "prompt_len",
    "response_len",
    "hidden",
    "layers",
    "steps",
    "threads",
    "chunk",
    "kl",
    "vocab",
)


def qwen2_models(a, attn: str, tok):
    """Actor, reference, critic, reward: Qwen2 of ``--vocab`` (151,936), ``--hidden`` x ``--layers``, 4 heads."""
    return four_models(
        attn,
        (1, 2, 3),
        a.vocab,
        model_type="qwen2",
        hidden_size=a.hidden,
        intermediate_size=a.hidden * 2,
        num_hidden_layers=a.layers,
        num_attention_heads=4,
        num_key_value_heads=4,
    )


def run_side(a) -> dict:
    """One side: ``bench_ppo``'s ``run_ours`` / ``run_trl`` over the Qwen2 models, with the RSS peak taken
    once the trainer is built (``train_added`` = the final peak minus it)."""
    built: dict = {}

    def after_build(make):
        def wrapped(*args, **kwargs):
            trainer = make(*args, **kwargs)
            built["rss"] = rss_mib()
            return trainer

        return wrapped

    a.mode, a.recompute_logprobs, a.eos_bias = "fixed", False, 0.0
    a.engine = "hf"  # bench_ppo.ours_config reads it (actor_rollout.rollout_engine)
    bench_ppo.build_models = qwen2_models
    bench_ppo.our_trainer = after_build(bench_ppo.our_trainer)
    bench_ppo.trl_trainer = after_build(bench_ppo.trl_trainer)
    if a.side == "trl":
        out = bench_ppo.run_trl(a)
    else:
        config = bench_ppo.ours_config

        def with_kl(args):
            c = config(args)
            c.algorithm.kl_penalty = a.kl
            c.training.readout_chunk = UNCHUNKED if a.side == "ours-unchunked" else a.chunk
            return c

        bench_ppo.ours_config = with_kl
        out = bench_ppo.run_ours(a)
    out["peak_rss_mb"] = rss_mib()
    out["train_added_mb"] = out["peak_rss_mb"] - built["rss"]
    return out


def fmt_table(med: dict) -> str:
    keys = ["rollout", "score", "update", "step", "step_cpu", "peak_rss_mb", "train_added_mb"]
    names = {"peak_rss_mb": "peak RSS (MB)", "train_added_mb": "train-added RSS (MB)"}
    rows = []
    for k in keys:
        t, u, c = (med[s].get(k) for s in SIDES)
        fmt = ".0f" if k.endswith("_mb") else ".3f"
        ratio = lambda x, y: f"{x / y:.2f}" if x is not None and y else ""
        rows.append([names.get(k, f"{k} (s)"), *(num(x, fmt, missing="") for x in (t, u, c))])
        rows[-1] += [ratio(c, t), ratio(u, t), ratio(c, u)]
    header = ["", "TRL", "ours unchunked", "ours chunked", "chunked / TRL", "unchunked / TRL", "chunked / unchunked"]
    return markdown_table(header, rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--response-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=QWEN2_VOCAB)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--chunk", type=int, default=128, help="ours: readouts per LM-head block")
    p.add_argument("--kl", default="kl", choices=["kl", "full"], help="ours' algorithm.kl_penalty (TRL: k1)")
    p.add_argument("--steps", type=int, default=3, help="steps per run; the first is a warm-up")
    p.add_argument("--seed", type=int, default=0, help="sampling seed; repeat k uses seed + k on every side")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out")
    add_worker_flags(p, sides=SIDES)
    a = p.parse_args()
    if a.side:
        worker_result(a.result, run_side(a))
        return
    if a.quick:
        a.batch, a.response_len, a.steps, a.repeats = 4, 16, 2, 1
    env = worker_env(a.threads)
    with tempfile.TemporaryDirectory(prefix="bench_ppo_vocab_") as workdir:

        def run(side, rep):
            return run_worker(__file__, side, workdir, forward_flags(a, *WORKER_SETTINGS, seed=a.seed + rep), env=env)

        results = run_interleaved(SIDES, a.repeats, run, rotate=True)
    med = {name: medians(runs) for name, runs in results.items()}
    print(
        f"PPO step, Qwen2 vocab {a.vocab}, hidden {a.hidden} x {a.layers} layers, B={a.batch} prompts x "
        f"{a.prompt_len} tokens, exactly {a.response_len} response tokens, ours' KL {a.kl!r} (TRL k1), ours' "
        f"chunk {a.chunk} readouts, {a.threads} thread(s), median of {a.repeats} runs x {a.steps - 1} steps"
    )
    table = fmt_table(med)
    print(table)
    report = {
        "args": vars(a),
        "runs": results,
        "median": med,
        "environment": environment("bench/bench_ppo_vocab.py", sys.argv[1:], a),
        "table_markdown": table,
    }
    write_report(a.out, report, indent=1)


if __name__ == "__main__":
    main()
