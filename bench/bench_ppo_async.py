"""PPO step time, synchronous vs one-step-off asynchronous rollouts (``actor_rollout.async_rollout``), with the
rollout and update phases timed; on the tiny model or the real one (``--model smollm2``).

Sides (each in its own subprocess, interleaved, repeated; medians over the timed steps, then over the runs):

* ``sync``: the plain loop at ``--threads`` torch threads (rollout, then scoring and update, one after another);
* ``async``: ``async_rollout: true, max_staleness: 1`` in one process: a deep copy of the actor generates step
  n+1 in a background thread while the main thread scores and updates step n. Each of the two Python threads
  runs torch at ``--threads`` threads, so this side can use twice the cores of ``sync``;
* ``sync_2x``: the plain loop at 2 x ``--threads`` torch threads: the same core budget as ``async``.

The models, prompts and PPO settings are ``bench_ppo.py``'s (its ``ours_config``: one epoch over 2 mini-batches,
old log-probs from the generation's logits) with ``--ppo-epochs`` to balance the update against generation.
Logged per step by the trainer: ``time/step``, ``time/rollout`` (sync: generation; async: waiting for the
rollout in flight + weight sync), and under async ``timing/rollout_s`` (the background rollout's own time),
``timing/wait_s``, ``timing/sync_s``, ``timing/update_s`` (scoring + advantages + update). The first
``--warmup-steps`` steps are not timed (async: the first step generates at once, staleness 0), nor the last (async
launches no rollout beside it, so it would run alone and flatter async).

    python bench/bench_ppo_async.py --threads 1 --out bench/results/bench_ppo_async_tiny.json
    python bench/bench_ppo_async.py --model smollm2 --threads 1 --out bench/results/bench_ppo_async_smollm2.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.bench_ppo import build_models, ours_config, prompt_ids, side_tokenizer
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
from bench.ppo_sides import our_trainer

SIDES = ("sync", "async", "sync_2x")
WORKER_SETTINGS = (
    *("batch", "prompt_len", "response_len", "hidden", "layers", "steps", "threads", "mode", "eos_bias"),
    *("recompute_logprobs", "engine", "model_dir", "ppo_epochs", "warmup_steps", "bf16"),
)


def side_threads(a, side: str) -> int:
    return 2 * a.threads if side == "sync_2x" else a.threads


def run_side(a) -> dict:
    """One run of ``a.side``: ``trainer.train()`` over ``--steps`` steps; per-step phases from its log."""
    import torch

    from llm.utils.attention import PACKED_SDPA

    threads = side_threads(a, a.side)
    torch.set_num_threads(threads)
    tok = side_tokenizer(a)
    c = ours_config(a)
    c.actor_rollout.ppo_epochs = a.ppo_epochs
    c.actor_rollout.async_rollout = a.side == "async"
    training = {"output_dir": os.path.join(a.workdir, f"out_{a.side}_{time.time_ns()}"), "logging_steps": 1}
    training.update(disable_tqdm=True, log_samples=0, save_steps=0)
    for name, value in training.items():
        setattr(c.training, name, value)
    trainer = our_trainer(c, prompt_ids(a, tok), tok, build_models(a, PACKED_SDPA, tok))
    trainer.save_final = lambda: None  # nothing to keep
    w0, c0 = time.perf_counter(), time.process_time()
    log = trainer.train()
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    rows = []
    for m in log[a.warmup_steps : -1]:  # not the last step: under async no rollout runs beside it
        row = {"step": m["time/step"], "rollout": m["time/rollout"], "update": m["time/step"] - m["time/rollout"]}
        if a.side == "async":
            row.update(
                wait=m["timing/wait_s"],
                rollout_bg=m["timing/rollout_s"],
                sync=m["timing/sync_s"],
                staleness=m["staleness"],
            )
        rows.append(row)
    out = medians(rows)
    out.update(
        threads=threads,
        cores_busy=cpu / wall,  # CPU time / wall time of the whole train() (warm-up included)
        response_tokens=statistics.median(m["response_length"] for m in log),
        peak_rss_mb=rss_mib(),
        steps=[{k: round(v, 4) for k, v in r.items()} for r in rows],
    )
    return out


def fmt_table(med: dict) -> str:
    rows = []
    labels = {
        "step": "step (s)",
        "rollout": "rollout phase in the step (s): sync generation / async wait + sync",
        "rollout_bg": "async: the background rollout's own time (s)",
        "wait": "async: waited for the rollout (s)",
        "update": "scoring + advantages + update (s)",
        "cores_busy": "CPU time / wall (cores busy)",
        "response_tokens": "response tokens (median)",
        "peak_rss_mb": "peak RSS (MB)",
    }
    for k, label in labels.items():
        rows.append([label, *(num(med[s].get(k), ".3f" if k != "peak_rss_mb" else ".0f", missing="") for s in med)])
    sync = med["sync"]["step"]
    rows.append(["step / sync step", *(f"{med[s]['step'] / sync:.2f}x" for s in med)])
    header = ["", *(f"{s} ({med[s]['threads']:.0f} thr{' x 2' if s == 'async' else ''})" for s in med)]
    return markdown_table(header, rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--model-dir", help="a real HF causal-LM directory (weights + tokenizer) instead of --model")
    p.add_argument("--batch", type=int, help="prompts per step (default 16; real model 4)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--response-len", type=int, help="response tokens (default 32; real model 16)")
    p.add_argument("--mode", choices=["realistic", "fixed"], default="fixed", help="as bench_ppo.py (default fixed)")
    p.add_argument("--eos-bias", type=float, default=0.0)
    p.add_argument("--recompute-logprobs", action="store_true", help="old log-probs by a forward (async: the copy's)")
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    p.add_argument("--bf16", action="store_true", help="training.bf16 (bench_ppo.py's ours_config reads it)")
    p.add_argument("--ppo-epochs", type=int, help="actor epochs per step (default: tiny 4, real model 1)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, help="steps per run, warm-up and last included (default: tiny 6, real 4)")
    p.add_argument("--warmup-steps", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per Python thread (sync_2x: twice)")
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--out")
    add_worker_flags(p, sides=SIDES)
    a = p.parse_args()
    if a.model == "smollm2" and not a.model_dir and not a.side:
        from llm.utils.gguf import smollm2_dir

        a.model_dir = smollm2_dir()
    real = bool(a.model_dir)
    a.batch = a.batch or (4 if real else 16)
    a.response_len = a.response_len or (16 if real else 32)
    a.ppo_epochs = a.ppo_epochs or (1 if real else 4)
    a.steps = a.steps or (4 if real else 6)
    if a.side:
        worker_result(a.result, run_side(a))
        return
    sides = tuple(s for s in a.sides.split(",") if s)
    with tempfile.TemporaryDirectory(prefix="bench_ppo_async_") as workdir:

        def run(side, rep):
            env = worker_env(side_threads(a, side))
            flags = forward_flags(a, *WORKER_SETTINGS, seed=a.seed + rep)
            return run_worker(__file__, side, workdir, flags, env=env)

        def describe(r):
            return f"step {r['step']:.3f} s, rollout {r['rollout']:.3f}, update {r['update']:.3f}"

        results = run_interleaved(sides, a.repeats, run, rotate=False, describe=describe)
    med = {s: medians(runs, [k for k in runs[0] if k != "steps"]) for s, runs in results.items()}
    model = a.model_dir or f"llama hidden {a.hidden} x {a.layers} layers"
    print(
        f"PPO step, sync vs async rollouts: B={a.batch} x {a.prompt_len}-token prompts ({a.mode}), {a.response_len} "
        f"response tokens, {a.ppo_epochs} actor epoch(s), {model}; {a.threads} torch thread(s) per Python thread; "
        f"median of {a.repeats} runs x {a.steps - a.warmup_steps - 1} timed steps (warm-up and last untimed)"
    )
    table = fmt_table(med) if "sync" in med else ""
    print(table)
    report = {
        "args": vars(a),
        "runs": results,
        "median": med,
        "environment": environment("bench/bench_ppo_async.py", sys.argv[1:], a),
        "table_markdown": table,
    }
    write_report(a.out, report, indent=1)


if __name__ == "__main__":
    main()
