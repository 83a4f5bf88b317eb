"""Peak RSS of LoRA against full fine-tuning, each run as a user runs it: the run script itself
(``llm/run_finetune.py``, ``llm/run_dpo.py``, ``llm/run_ppo.py``) in its own process, the shipped config with a
few overrides, ``lora: true`` + ``lora_rank`` the only difference between the sides (issue 30).

    python bench/bench_lora_memory.py --model smollm2 --tasks sft,dpo,grpo --repeats 2 \\
        --out bench/results/lora_memory_smollm2.json                    # the LoRA defaults against full
    python bench/bench_lora_memory.py --model llama44m --tasks dpo,sft --batch 4 --repeats 2 \\
        --out bench/results/lora_memory_llama44m.json                   # the 44M case of issue 30
    python bench/bench_lora_memory.py --model llama44m --tasks sft --batch 4 --sides full,lora,full_recompute,lora_no_recompute

Models: ``smollm2`` (SmolLM2-135M-Instruct via ``llm.utils.gguf.smollm2_dir()``, the configs of ``llm/config/smollm2``, pretrained weights);
``llama44m`` (the tiny configs of ``llm/config/tiny`` with a seeded random Llama of hidden 640 x 9 layers,
intermediate 1728, 8 heads, vocab 648: 45.4M parameters, 44.6M of them in the decoder layers; the tiny tokenizer).

Sides: ``full``; ``lora`` (``lora: true``, ``lora_rank`` ``--rank``, everything else the LoRA defaults: alpha
2 x rank, dropout 0, the seven projections, activation checkpointing on); ``full_recompute`` (full with
``recompute`` / ``training.gradient_checkpointing`` true); ``lora_no_recompute`` (LoRA with it false): the pairs
that show whether LoRA stays under full with the same checkpointing setting on both.

Each run: ``--steps`` optimizer steps (flat: ``benchmark true``, so no evaluation and no saving; GRPO: the final
save of the actor included), 1 thread (``OMP_NUM_THREADS``), peak RSS = ``ru_maxrss`` of that process
(``os.wait4``), CPU seconds = its user + system time. Runs are interleaved (the side order rotates every repeat);
the table quotes medians. Memory, not speed, is the point; CPU seconds are given for the cost of checkpointing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.harness import environment, markdown_table, write_report

SCRIPTS = {"sft": "llm/run_finetune.py", "dpo": "llm/run_dpo.py", "grpo": "llm/run_ppo.py"}
CONFIGS = {
    "smollm2": {t: f"llm/config/smollm2/{t}_argument.json" for t in SCRIPTS},
    "llama44m": {"sft": "llm/config/tiny/sft_argument.json", "dpo": "llm/config/tiny/dpo_argument.json"},
}
SIDES = ("full", "lora", "full_recompute", "lora_no_recompute")
LLAMA44M = {"hidden_size": 640, "num_hidden_layers": 9, "intermediate_size": 1728, "num_attention_heads": 8,
            "num_key_value_heads": 8, "head_dim": 80}  # fmt: skip
GOAL = 0.6  # issue 30: LoRA's peak RSS at most this share of full fine-tuning's, with the LoRA defaults


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=tuple(CONFIGS), default="smollm2")
    p.add_argument("--tasks", default="sft,dpo,grpo", help="comma-separated subset of sft,dpo,grpo")
    p.add_argument("--sides", default="full,lora", help=f"comma-separated subset of {','.join(SIDES)}")
    p.add_argument("--rank", type=int, default=16, help="lora_rank of the LoRA sides")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per run (GRPO: PPO steps)")
    p.add_argument("--batch", type=int, default=None, help="flat: per_device_train_batch_size (default the config's)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--train_records",
        type=int,
        default=64,
        help="flat: train on the first N records of the config's training file (DPO precomputes the reference "
        "log-probs of every pair before its first step: 16 minutes for all 800 on one shared core; a step's peak "
        "does not depend on it); 0: the whole file",
    )
    p.add_argument("--out", default=None, help="write the report as JSON here")
    args = p.parse_args(argv)
    args.tasks = [t for t in args.tasks.split(",") if t]
    args.sides = [s for s in args.sides.split(",") if s]
    for task in args.tasks:
        if task not in CONFIGS[args.model]:
            p.error(f"--model {args.model} has no {task} config here ({', '.join(CONFIGS[args.model])})")
    if bad := [s for s in args.sides if s not in SIDES]:
        p.error(f"unknown side(s) {bad}; sides: {', '.join(SIDES)}")
    return args


def model_dir(args, workdir: str) -> str:
    """``smollm2``: the converted SmolLM2 (``llm.utils.gguf.smollm2_dir``); ``llama44m``: a config directory of the
    44M Llama (the tiny configs build it from its config, seeded)."""
    if args.model == "smollm2":
        from llm.utils.gguf import smollm2_dir

        return smollm2_dir()
    with open(os.path.join(ROOT, "llm/assets/tiny-llama/config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config.update(LLAMA44M)
    path = os.path.join(workdir, "llama44m")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return path


def subset(args, task: str, workdir: str) -> str:
    """The first ``--train_records`` lines of ``task``'s training file, written once under ``workdir``."""
    with open(os.path.join(ROOT, CONFIGS[args.model][task]), encoding="utf-8") as f:
        source = os.path.join(ROOT, json.load(f)["train_dataset_path"])
    path = os.path.join(workdir, f"{task}_train_{args.train_records}.jsonl")
    if not os.path.exists(path):
        with open(source, encoding="utf-8") as f, open(path, "w", encoding="utf-8") as out:
            out.writelines(line for _, line in zip(range(args.train_records), f))
    return path


def command(args, task: str, side: str, out: str, model: str) -> list[str]:
    lora, recompute = side.startswith("lora"), {"full_recompute": "true", "lora_no_recompute": "false"}.get(side)
    cmd = [sys.executable, os.path.join(ROOT, SCRIPTS[task]), os.path.join(ROOT, CONFIGS[args.model][task])]
    if task == "grpo":
        cmd += ["--training.max_steps", str(args.steps), "--training.save_steps", "0", "--training.output_dir", out]
        cmd += ["--training.report_to", "none", "--training.disable_tqdm", "true"]
        cmd += ["--actor_rollout.model_name_or_path", model]
        if lora:
            cmd += ["--actor_rollout.lora", "true", "--actor_rollout.lora_rank", str(args.rank)]
        if recompute:
            cmd += ["--training.gradient_checkpointing", recompute]
        return cmd
    cmd += ["--max_steps", str(args.steps), "--output_dir", out, "--benchmark", "true", "--do_eval", "false"]
    cmd += ["--report_to", "none", "--logging_steps", "1", "--disable_tqdm", "true"]
    if args.batch is not None:
        cmd += ["--per_device_train_batch_size", str(args.batch)]
    cmd += ["--model_name_or_path", model]
    if args.train_records:
        cmd += ["--train_dataset_path", subset(args, task, os.path.dirname(out))]
    if lora:
        cmd += ["--lora", "true", "--lora_rank", str(args.rank)]
    if recompute:
        cmd += ["--recompute", recompute]
    return cmd


def run_once(cmd: list[str], log_path: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        with open(log_path, encoding="utf-8") as f:
            tail = f.read()[-3000:]
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{tail}")
    return {
        "peak_rss_mib": usage.ru_maxrss / 1024,  # KiB on Linux
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "wall_s": time.perf_counter() - start,
        "load_average": os.getloadavg()[0],
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    runs: dict[str, dict[str, list[dict]]] = {t: {s: [] for s in args.sides} for t in args.tasks}
    with tempfile.TemporaryDirectory(prefix="bench_lora_memory_") as workdir:
        model = model_dir(args, workdir)
        for repeat in range(args.repeats):
            for task in args.tasks:
                k = repeat % len(args.sides)
                for side in args.sides[k:] + args.sides[:k]:
                    out = os.path.join(workdir, f"{task}_{side}_{repeat}")
                    cmd = command(args, task, side, out, model)
                    result = run_once(cmd, out + ".log")
                    result["command"] = " ".join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd)
                    runs[task][side].append(result)
                    print(f"{task} {side} run {repeat + 1}: peak {result['peak_rss_mib']:.0f} MiB, "
                          f"{result['cpu_s']:.0f} CPU-s, load {result['load_average']:.1f}", flush=True)  # fmt: skip
    summary = {
        task: {
            side: {key: statistics.median(r[key] for r in rs) for key in ("peak_rss_mib", "cpu_s")}
            for side, rs in sides.items()
        }
        for task, sides in runs.items()
    }
    rows = []
    for task, sides in summary.items():
        full = sides.get("full")
        for side, m in sides.items():
            ratio = m["peak_rss_mib"] / full["peak_rss_mib"] if full else None
            peaks = ", ".join(f"{r['peak_rss_mib']:.0f}" for r in runs[task][side])
            rows.append([task, side, f"{m['peak_rss_mib']:.0f} ({peaks})", f"{m['cpu_s']:.0f}",
                         "" if ratio is None else f"{ratio:.2f}x"])  # fmt: skip
    table = markdown_table(["task", "side", "peak RSS MiB, median (runs)", "CPU s", "/ full"], rows)
    print("\n" + table)
    report = {"environment": environment("bench/bench_lora_memory.py", sys.argv[1:] if argv is None else argv, args),
              "goal_lora_over_full": GOAL, "runs": runs, "summary": summary, "table": table}  # fmt: skip
    write_report(args.out, report)


if __name__ == "__main__":
    main()
