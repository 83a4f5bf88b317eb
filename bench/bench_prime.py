"""GRPO with PRIME against GRPO with the outcome reward alone: held-out accuracy against training wall time.

Not a test: a benchmark (issue 28 item 5). Two sides, the same GRPO run of ours on the arithmetic prompts
(llm/data/sample_arith/arith_train.jsonl, rule reward ``math_exact_match``, ``algorithm.adv_estimator: rloo`` as
PRIME requires) that differ only in the ``prime`` section (docs/ppo.md, "PRIME"):

- ``outcome``: the verifier's outcome alone (RLOO advantages of the 0/1 score);
- ``prime``: the same plus PRIME's implicit PRM, trained online on every step's rollouts against the outcomes,
  its dense process rewards added to the advantages (``prime.outcome_coef`` / ``prime.process_coef``).

Same model, prompts, group size, lengths, sampling, learning rate, KL loss, seed. By default both sides train at
once, one thread each (``--threads``), for ``--minutes`` of training wall time (a shared machine's load falls
on both alike; ``--sequential``: one after the other). Each saves its policy every ``--minutes / --evals``
minutes of training (``Budget`` of bench_real_learning.py, checkpoint saving not counted). Afterwards ONE
evaluator (bench_real_learning's ``arith_accuracy``: greedy, chat template, ``--eval-new-tokens`` tokens,
math_exact_match against ``tgt``) scores the base model and every checkpoint of both sides on the first
``--eval-n`` of llm/data/sample_arith/arith_dev.jsonl. The prime side's log keeps its PRM's ``prime/accuracy``
and ``prime/loss`` (and ``prime/implicit_reward``, ``prime/process_reward``) per step. ``--seeds N`` repeats the
pair with seeds ``--seed``, ``--seed + 1``, ...

Usage (from the repository root)::

    OMP_NUM_THREADS=1 python bench/bench_prime.py --quick --model tiny   # the pipeline, a random tiny Llama
    OMP_NUM_THREADS=1 python bench/bench_prime.py --quick                # 2 steps a side on SmolLM2-135M
    OMP_NUM_THREADS=1 python bench/bench_prime.py --minutes 30 --evals 5 # the measurement (about 50 min)

Writes ``--out`` (default bench/results/prime_smollm2.json; ``--quick``: output/prime_<model>_quick.json) and a
PNG beside it: held-out accuracy against training wall minutes, both sides, and the training reward with the
PRM's accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import harness
from bench.bench_real_learning import (
    ARITH_DEV,
    ARITH_TRAIN,
    RULE,
    env,
    eval_worker,
    grpo_settings,
    model_dir,
    ours_grpo_config,
    train_on_budget,
)

SIDES = ("outcome", "prime")
PRIME_KEYS = ("prime/accuracy", "prime/loss", "prime/implicit_reward", "prime/process_reward")
# flags a worker needs (argparse dests); the worker flags and --seed are added per run
FORWARD = [
    "model_dir",
    "minutes",
    "evals",
    "max_steps",
    "prompts",
    "group",
    "new_tokens",
    "temperature",
    "micro_batch",
    "lr",
    "beta",
    "threads",
    "prime_beta",
    "prime_lr",
    "prime_coef",
    "outcome_coef",
    "prime_update",
    "prime_granularity",
    "filter_groups",
    "eval_n",
    "eval_new_tokens",
    "keep_checkpoints",
]


def prime_section(a) -> dict:
    return {
        "update": a.prime_update,
        "beta": a.prime_beta,
        "granularity": a.prime_granularity,
        "norm": "batch_norm",
        "outcome_coef": a.outcome_coef,
        "process_coef": a.prime_coef,
        "learning_rate": a.prime_lr,
        "max_grad_norm": 10.0,
    }


def side_config(a, side: str) -> dict:
    """bench_real_learning's GRPO config with RLOO advantages (no critic); ``prime`` adds the PRIME section."""
    cfg = ours_grpo_config(a)
    cfg["training"]["output_dir"] = os.path.join(a.workdir, f"{side}_run")
    cfg.pop("critic", None)
    cfg["algorithm"]["adv_estimator"] = "rloo"
    if side == "prime":
        cfg["prime"] = prime_section(a)
    if a.filter_groups:  # both sides: the PRIME paper's online prompt filtering, as DAPO's dynamic sampling
        cfg["algorithm"]["filter_groups"] = True
    return cfg


def tiny_base(a) -> str:
    """A seeded random tiny Llama (llm/assets/tiny-llama's shape) with the bundled tiny tokenizer, saved once, so
    both sides and the evaluator load the same weights and the same chat template."""
    out = os.path.join(a.workdir, "tiny_base")
    if not os.path.isfile(os.path.join(out, "config.json")):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(a.seed)
        config = AutoConfig.from_pretrained(os.path.join(ROOT, "llm/assets/tiny-llama"))
        AutoModelForCausalLM.from_config(config).save_pretrained(out)
        AutoTokenizer.from_pretrained(harness.TOKENIZER).save_pretrained(out)
    return out


def settings(a) -> dict:
    s = grpo_settings(a)
    s.pop("seed")
    s.update(
        model=a.model,
        adv_estimator="rloo (verl's compute_rloo_advantage_return: leave-one-out within each group), whitened",
        loss="token mean over the step's completions",
        sides="outcome: reward alone; prime: the same plus the prime section (the only difference)",
        filter_groups=(
            "both sides: groups whose completions all score the same (accuracy 0 or 1) dropped and more prompts "
            "drawn (algorithm.filter_groups; PRIME's online prompt filtering keeps accuracy in [0.2, 0.8])"
            if a.filter_groups
            else "no"
        ),
        prime=prime_section(a),
        schedule="one after the other" if a.sequential else "both sides at once, one process each",
        train_data=ARITH_TRAIN,
        reward=RULE,
        seeds=seeds(a),
        max_steps=a.max_steps,
    )
    s["eval"] = f"greedy, chat template, {a.eval_new_tokens} new tokens, first {a.eval_n} of {ARITH_DEV}"
    s["eval_n"] = a.eval_n
    return s


def seeds(a) -> list[int]:
    return [a.seed + i for i in range(a.seeds)]


# --------------------------------------------------------------------------------------------------------------
# Workers: a training side, or the evaluator.
# --------------------------------------------------------------------------------------------------------------
def worker(a) -> None:
    if a.side == "eval":
        eval_worker(a)  # writes a.result itself
        return
    t = time.perf_counter()
    out = train_on_budget(a, side_config(a, a.side), a.side, PRIME_KEYS if a.side == "prime" else ())
    out.update(total_s=time.perf_counter() - t, peak_rss_mib=harness.rss_mib())
    harness.worker_result(a.result, out)


def run_side(a, side: str, seed: int) -> dict:
    workdir = os.path.join(a.workdir, f"seed{seed}")
    os.makedirs(workdir, exist_ok=True)
    argv = harness.forward_flags(a, *FORWARD, seed=seed)
    try:
        return harness.run_worker(__file__, side, workdir, argv, env=env(a.threads), echo=True)
    except SystemExit as e:  # the worker's output is on stderr already; keep the other side's results
        return {"error": str(e), "log": [], "points": []}


def train(a) -> dict:
    """Both sides for every seed: {seed: {side: worker result}}."""
    runs = {}
    for seed in seeds(a):
        if a.sequential:
            runs[seed] = {side: run_side(a, side, seed) for side in SIDES}
        else:
            with ThreadPoolExecutor(len(SIDES)) as pool:
                futures = {side: pool.submit(run_side, a, side, seed) for side in SIDES}
                runs[seed] = {side: f.result() for side, f in futures.items()}
    return runs


def evaluate(a, runs: dict) -> list[dict]:
    """One evaluator process: the base model, then every checkpoint of every side and seed."""
    points = [{"side": "base", "seed": None, "step": 0, "wall_s": 0.0, "path": a.model_dir}]
    for seed, sides in runs.items():
        points += [{**p, "seed": seed} for side in SIDES for p in sides[side].get("points", [])]
    listing = os.path.join(a.workdir, "eval.list.json")
    with open(listing, "w", encoding="utf-8") as f:
        json.dump(points, f)
    argv = harness.forward_flags(a, *FORWARD, seed=a.seed, eval_list=listing)
    return harness.run_worker(__file__, "eval", a.workdir, argv, env=env(a.threads), echo=True)


# --------------------------------------------------------------------------------------------------------------
# Report and plot.
# --------------------------------------------------------------------------------------------------------------
def side_report(run: dict, evals: list[dict], base_acc: float | None) -> dict:
    curve = [{"step": 0, "wall_s": 0.0, "accuracy": base_acc}] + [
        {k: e[k] for k in ("step", "wall_s", "accuracy", "samples")} for e in evals
    ]
    log = run.get("log", [])
    out = {
        "curve": curve,
        "final_accuracy": curve[-1]["accuracy"] if len(curve) > 1 else None,
        "best_accuracy": max((c["accuracy"] for c in curve[1:]), default=None),
        "steps": log[-1]["step"] if log else 0,
        "train_wall_s": log[-1]["wall_s"] if log else 0.0,
        "median_step_s": statistics.median(r["step_s"] for r in log) if log else None,
        "train_log": log,
        **{k: run[k] for k in ("peak_rss_mib", "total_s", "error") if k in run},
    }
    if out["final_accuracy"] is not None and base_acc is not None:
        out["gain_points"] = 100 * (out["final_accuracy"] - base_acc)
    return out


def report(a, runs: dict, evals: list[dict]) -> dict:
    base = next((e for e in evals if e["side"] == "base"), {})
    base_acc = base.get("accuracy")
    per_seed = {
        str(seed): {
            side: side_report(runs[seed][side], [e for e in evals if e["side"] == side and e["seed"] == seed], base_acc)
            for side in SIDES
        }
        for seed in runs
    }
    summary = {}
    for side in SIDES:
        finals = [r[side]["final_accuracy"] for r in per_seed.values() if r[side]["final_accuracy"] is not None]
        summary[side] = {
            "mean_final_accuracy": statistics.mean(finals) if finals else None,
            "final_accuracies": finals,
            "steps": [r[side]["steps"] for r in per_seed.values()],
        }
    return {
        "environment": harness.environment("bench/bench_prime.py", sys.argv[1:], a, libs=("torch", "transformers")),
        "quick": a.quick,
        "settings": settings(a),
        "base_accuracy": base_acc,
        "base_samples": base.get("samples"),
        "summary": summary,
        "seeds": per_seed,
    }


def plot(rep: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, rew) = plt.subplots(1, 2, figsize=(10, 4))
    colors = {"outcome": "tab:blue", "prime": "tab:orange"}
    for seed, sides in rep["seeds"].items():
        for side in SIDES:
            r = sides[side]
            c = [p for p in r["curve"] if p["accuracy"] is not None]
            label = f"{side}, seed {seed} ({r['steps']} steps)"
            acc.plot(
                [p["wall_s"] / 60 for p in c],
                [100 * p["accuracy"] for p in c],
                "o-",
                color=colors[side],
                label=label,
                alpha=0.9,
            )
            log = r["train_log"]
            rew.plot(
                [x["wall_s"] / 60 for x in log],
                [x["reward"] for x in log],
                ".-",
                color=colors[side],
                label=f"{side} training reward, seed {seed}",
            )
            if side == "prime":
                rew.plot(
                    [x["wall_s"] / 60 for x in log],
                    [x.get("prime/accuracy") for x in log],
                    "x:",
                    color="tab:red",
                    label=f"PRM prime/accuracy, seed {seed}",
                )
    s = rep["settings"]
    acc.set_xlabel(f"training wall time (min, {s['threads_per_side']} thread each)")
    acc.set_ylabel(f"arith_dev accuracy (%, greedy, first {s['eval_n']})")
    acc.set_title("held-out accuracy")
    acc.legend(fontsize=7)
    rew.set_xlabel("training wall time (min)")
    rew.set_ylabel("mean outcome of the step's rollouts / PRM accuracy")
    rew.set_ylim(-0.02, 1.02)
    rew.set_title("training")
    rew.legend(fontsize=7)
    budget = f"{s['max_steps']} steps a side (--quick: a smoke run, not a result)" if rep["quick"] else ""
    budget = budget or f"{s['minutes_per_side']:g} min a side"
    fig.suptitle(
        f"GRPO (RLOO) with PRIME vs the outcome reward alone, {s['model']}, {budget}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="smollm2, tiny (a random tiny Llama: the pipeline only) or a dir")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 steps a side, 16 held-out prompts")
    p.add_argument("--out", help="JSON report (default bench/results/prime_smollm2.json; --quick: under output/)")
    p.add_argument("--png", help="default: the --out path with .png")
    p.add_argument("--plot-only", action="store_true", help="redraw the PNG from the --out report, run nothing")
    p.add_argument("--minutes", type=float, default=30.0, help="training wall budget per side")
    p.add_argument("--evals", type=int, default=5, help="checkpoints per side (every --minutes / --evals)")
    p.add_argument("--max-steps", type=int, default=100000)
    p.add_argument("--seeds", type=int, default=1, help="pairs of runs, seeds --seed, --seed + 1, ...")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--sequential", action="store_true", help="the sides one after the other instead of at once")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--keep-checkpoints", action="store_true")
    g = p.add_argument_group("GRPO (both sides; bench_real_learning.py's GRPO defaults)")
    g.add_argument("--prompts", type=int, default=4, help="prompts per step")
    g.add_argument("--group", type=int, default=8, help="completions per prompt")
    g.add_argument("--new-tokens", type=int, default=16, help="completion cap in training")
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--micro-batch", type=int, default=8, help="completions per forward/backward")
    g.add_argument("--lr", type=float, default=1e-5)
    g.add_argument("--beta", type=float, default=0.04, help="k3 KL loss coefficient (algorithm.kl_loss_coef)")
    g = p.add_argument_group("PRIME (the prime side; llm/config/smollm2/grpo_prime_argument.json's values)")
    g.add_argument("--prime-beta", type=float, default=0.05, help="prime.beta")
    g.add_argument("--prime-lr", type=float, default=1e-6, help="prime.learning_rate (the PRM's)")
    g.add_argument("--prime-coef", type=float, default=5.0, help="prime.process_coef")
    g.add_argument("--outcome-coef", type=float, default=5.0, help="prime.outcome_coef")
    g.add_argument("--prime-update", default="before", choices=("before", "after", "none"))
    g.add_argument(
        "--filter-groups",
        action="store_true",
        help="both sides: algorithm.filter_groups (all-equal groups dropped, more prompts drawn), the PRIME "
        "paper's online prompt filtering in DAPO's form",
    )
    g.add_argument("--prime-granularity", default="token", choices=("token", "whole"))
    g = p.add_argument_group("evaluation")
    g.add_argument("--eval-n", type=int, default=128, help="the first N prompts of arith_dev.jsonl")
    g.add_argument("--eval-new-tokens", type=int, default=16)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--eval-list", help=argparse.SUPPRESS)
    harness.add_worker_flags(p, sides=(*SIDES, "eval"))
    p.set_defaults(lora=False, lora_rank=16, precision="fp32")  # bench_real_learning's helpers read these
    a = p.parse_args(argv)
    a.eval_prompts = a.eval_n
    return a


def show(rep: dict) -> None:
    print(f"base accuracy {rep['base_accuracy']}")
    for seed, sides in rep["seeds"].items():
        for side in SIDES:
            r = sides[side]
            curve = [(round(c["wall_s"]), c["accuracy"]) for c in r["curve"]]
            prm = [(x["step"], x.get("prime/accuracy"), x.get("prime/loss")) for x in r["train_log"] if side == "prime"]
            print(f"seed {seed} {side}: {r['steps']} steps, curve {curve}" + (f", PRM {prm}" if prm else ""))


def main() -> None:
    a = parse()
    if a.side:
        worker(a)
        return
    tag = a.model if a.model in ("smollm2", "tiny") else os.path.basename(a.model.rstrip("/"))
    tag += "_filtered" if a.filter_groups else ""
    default = f"output/prime_{tag}_quick.json" if a.quick else f"bench/results/prime_{tag}.json"
    out = a.out or os.path.join(ROOT, default)
    png = a.png or os.path.splitext(out)[0] + ".png"
    if a.plot_only:
        with open(out, encoding="utf-8") as f:
            plot(json.load(f), png)
        print(f"plot: {png}")
        return
    os.environ.update({k: v for k, v in env(a.threads).items() if k != "PYTHONPATH"})
    a.workdir = os.path.join(ROOT, "output", f"prime_{tag}" + ("_quick" if a.quick else ""))
    os.makedirs(a.workdir, exist_ok=True)
    if a.quick:
        a.max_steps, a.evals, a.eval_n = 2, 1, min(a.eval_n, 16)
        a.eval_prompts = a.eval_n
    a.model_dir = {"smollm2": model_dir, "tiny": lambda: tiny_base(a)}.get(a.model, lambda: a.model)()
    t = time.perf_counter()
    runs = train(a)
    rep = report(a, runs, evaluate(a, runs))
    rep["total_wall_s"] = time.perf_counter() - t
    harness.write_report(out, rep, indent=1)
    plot(rep, png)
    print(f"plot: {png}")
    show(rep)


if __name__ == "__main__":
    main()
