"""PPO step time with the roles on Ray against the same run in one process (CPU).

Same config, models, prompts and seeds in every mode; the run generates (``ignore_eos``: every
response has exactly ``--response-len`` tokens, so each step does the same work). Modes:

    local       every role in this process (the default ``resource_pool``)
    ray4        actor, reference, critic and reward each in its own Ray actor (0.5 CPU each)
    ray2        colocated: [actor_rollout + ref], [critic + reward] (two Ray actors)
    ray4+copy   ray4 plus a separate rollout copy (weights synced after every update)
    fsdp2       all four roles in one group of 2 Ray actors sharding every model with FSDP2 (gloo);
                each rank computes its half of every batch (data parallel), plus the all-gathers

Every process runs one thread (``OMP_NUM_THREADS=1``), so the Ray roles do the same arithmetic as
the local run and the difference is Ray's overhead: serialising arguments and results, the object
store, and the round trips (the independent calls of a phase overlap: `resource_pool.concurrent_roles`). The first step of each run
is a warm-up; the table reports medians over the remaining steps and over ``--repeats`` rounds
(modes interleaved per round, so load from other tenants falls on all of them).

    python bench/bench_ppo_ray.py [--steps 6] [--repeats 2] [--hidden 256] [--layers 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: Ray workers inherit it
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.harness import TOKENIZER, after_warmup, environment, markdown_table, medians, run_interleaved, write_report

PHASES = ("time/rollout", "time/score", "time/update", "time/step")
MODES = {
    "local": {},
    "ray4": {"use_ray": True, "actor_rollout": 0.5, "ref": 0.5, "critic": 0.5, "reward": 0.5},
    "ray2": {
        "use_ray": True,
        "actor_rollout": 0.5,
        "ref": 0.5,
        "critic": 0.5,
        "reward": 0.5,
        "colocate": [["actor_rollout", "ref"], ["critic", "reward"]],
    },
    "ray4+copy": {"use_ray": True, "actor_rollout": 0.4, "ref": 0.4, "critic": 0.4, "reward": 0.4, "rollout": 0.4},
    "fsdp2": {
        "use_ray": True,
        "actor_rollout": 2,
        "ref": 2,
        "critic": 2,
        "reward": 2,
        "colocate": [["actor_rollout", "ref", "critic", "reward"]],
    },
}


def model_dir(tmp: str, hidden: int, layers: int) -> str:
    """A copy of the tiny Llama config at the requested size (random weights, seeded, built in each role)."""
    with open(os.path.join(ROOT, "llm", "assets", "tiny-llama", "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg.update(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, head_dim=hidden // 4)
    path = os.path.join(tmp, "model")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    return path


def write_config(tmp: str, a, model: str, pool: dict) -> str:
    with open(os.path.join(ROOT, "llm", "config", "tiny", "ppo_argument.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    tok = TOKENIZER
    cfg["training"].update(output_dir=os.path.join(tmp, "out"), report_to="none", disable_tqdm=True, save_steps=0)
    cfg["training"]["micro_batch_size"] = a.batch * a.samples
    cfg["actor_rollout"].update(
        model_name_or_path=model,
        tokenizer_name_or_path=tok,
        max_response_length=a.response_len,
        num_samples_per_step=a.samples,
        ppo_mini_batch_size=a.batch * a.samples // 2,
        ppo_epochs=1,
        ignore_eos=True,
    )
    cfg["critic"].update(critic_mini_batch_size=a.batch * a.samples // 2, critic_update_epochs=1)
    cfg["reward"] = {
        "type": "orm",
        "model_name_or_path": model,
        "tokenizer_name_or_path": tok,
        "init_from_config": True,
    }
    cfg["data"].update(
        train_dataset_path=os.path.join(ROOT, "llm/data/sample/prompts.jsonl"), rollout_batch_size=a.batch
    )
    cfg["resource_pool"] = {**cfg["resource_pool"], **pool}
    path = os.path.join(tmp, f"ppo_{len(os.listdir(tmp))}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    return path


def run_mode(path: str, steps: int) -> dict:
    from llm.alignment.ppo.build import ppo_trainer
    from llm.settings.load import parse_ppo_config

    c = parse_ppo_config([path])
    t0 = time.perf_counter()
    with ppo_trainer(c) as trainer:
        setup = time.perf_counter() - t0
        metrics = after_warmup([trainer.train_step() for _ in range(steps)], 1)  # the first step is a warm-up
    return {"setup": setup, "steps": [{k: m[k] for k in PHASES} for m in metrics]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--steps", type=int, default=6, help="PPO steps per run (the first is a warm-up)")
    p.add_argument("--repeats", type=int, default=2, help="rounds over the modes")
    p.add_argument("--batch", type=int, default=8, help="prompts per step")
    p.add_argument("--samples", type=int, default=2, help="responses per prompt")
    p.add_argument("--response-len", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--json", help="also write the raw timings here")
    a = p.parse_args()
    modes = a.modes.split(",")
    import logging

    import ray
    import torch

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024**2, log_to_driver=False)
    ray_init = time.perf_counter() - t0
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model = model_dir(tmp, a.hidden, a.layers)

            def run(mode, rep):  # the modes in the same order every round: all of them share this process's Ray
                return run_mode(write_config(tmp, a, model, MODES[mode]), a.steps)

            describe = lambda r: f"setup {r['setup']:.1f} s"
            results = run_interleaved(modes, a.repeats, run, rotate=False, describe=describe, stream=sys.stderr)
    finally:
        ray.shutdown()
    print(f"\nray.init: {ray_init:.1f} s; {a.batch} prompts x {a.samples} samples x {a.response_len} tokens; ", end="")
    print(f"Llama hidden {a.hidden}, {a.layers} layers; {a.repeats} x {a.steps - 1} timed steps per mode\n")
    rows, base = [], None
    for mode in modes:
        med = medians([s for run in results[mode] for s in run["steps"]], PHASES)
        setup = statistics.median(run["setup"] for run in results[mode])
        base = med["time/step"] if mode == "local" else base
        ratio = f"{med['time/step'] / base:.2f}x ({(med['time/step'] - base) * 1000:+.0f} ms)" if base else "-"
        rows.append([mode, f"{setup:.1f}", *(f"{med[k]:.3f}" for k in PHASES), ratio])
    header = ["mode", "setup s", "rollout s", "score s", "update s", "step s", "step vs local"]
    table = markdown_table(header, rows)
    print(table)
    report = {
        "args": vars(a),
        "ray_init_s": ray_init,
        "results": results,
        "environment": environment("bench/bench_ppo_ray.py", sys.argv[1:], a, libs=("torch", "transformers", "ray")),
        "table_markdown": table,
    }
    write_report(a.json, report, indent=1)


if __name__ == "__main__":
    main()
