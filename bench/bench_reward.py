"""Reward-model training throughput on CPU: our RewardTrainer (packed rows) vs TRL, ORM and PRM.

Run from the repository root::

    python bench/bench_reward.py --out bench_reward.json            # full: 256 pairs / 512 PRM solutions, 3 repeats
    python bench/bench_reward.py --repeats 5 --out bench_reward.json  # the run in bench/README.md (~8 min idle)
    python bench/bench_reward.py --quick                            # smoke test: 32 / 64, 1 repeat (~1-2 min)
    python bench/bench_reward.py --tasks prm --profile 8            # op-level profile of 8 steps per side

Compared, on the same randomly initialised Llama config (``tiny_config("llama", hidden_size=256,
intermediate_size=688, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4)``, vocab of
``llm/assets/tiny_tokenizer``), the same records (the first N of the sample files), fp32, AdamW (the
``transformers.Trainer`` default optimizer on both sides), the same lr / schedule / seed, one epoch:

  orm/ours  ``llm.alignment.rm.build.build_reward_trainer`` with process_reward=False: each pair is one
            example [prompt | chosen | rejected] (prompt computed once), greedy-packed into rows of
            ``--max-seq-len`` (1024), 1 row per optimizer step, ``packed_sdpa`` attention,
            AutoModelForSequenceClassification (score head read at the last chosen / rejected token);
            the last decoder layer runs at the readout positions only (``llm/alignment/rm/readout.py``:
            keys and values at every position, the rest at the readouts; same numbers).
  orm/trl   ``trl.RewardTrainer``: AutoModelForSequenceClassification (sdpa), padded batches of
            ``--trl-batch`` pairs = 2x sequences (chosen + rejected, prompt computed twice).
  prm/ours  process_reward=True: causal LM, logits of the reward tokens '+'/'-' at each step
            placeholder 'ки', packed rows and readout-only last layer as above.
  prm/trl   ``trl.experimental.prm.PRMTrainer``: AutoModelForTokenClassification (num_labels=2, sdpa),
            its own tokenisation (step_separator "\\n" after every step, label on its last token),
            padded batches of ``--trl-batch`` solutions.

``--trl-batch auto`` (default) sets TRL's examples per step to our mean examples per packed row
(rounded), so both sides take about the same number of examples per optimizer step.

Each (task, side) run is its own subprocess (this script with ``--side``), so memory and
allocator state of one side never pollute the other; both import the same modules (torch,
transformers, trl, datasets, llm) so their base RSS is alike. Runs are interleaved
(ours, trl, trl, ours, ...) and repeated; the table quotes medians.

Threads: 1 by default. On a shared 2-core machine, 2 OpenMP threads per run turned out 4-5x *slower*
per token than 1 (threads spin at every op's barrier while the other core is taken by someone else),
and the result then measures the neighbours, not the trainers. With 1 thread the CPU time of a run
(``time.process_time``) is its own compute, so "real tokens per CPU-second" is a noise-robust
companion to the wall-clock rate. ``--threads 2`` on an idle machine is the other sensible setting.
Columns for a shared machine: *on CPU* = CPU time / wall time of the timed steps (median; < 100%: the run
was preempted); *runs >= 95% on CPU* = the median wall-clock rate of the runs that had a core to
themselves (count in brackets); *fastest of each step* = real tokens / the sum over steps of each step's
fastest time in any repeat (every run takes the same batches in the same order; checked, else n/a).

Timing: a TrainerCallback stamps ``on_step_end``; the first ``--warmup-steps`` steps are not timed.
Timed = data collation + forward + backward + optimizer + scheduler, i.e. the whole training step.
Real tokens are the non-pad tokens of the batches actually collated (counted by wrapping the
collator), pad ratio = 1 - real / elements of ``input_ids``. Peak RSS = ``ru_maxrss`` of the
subprocess at the end; "pre-train" is ``ru_maxrss`` right before ``trainer.train()`` (setup,
tokenisation, model), so "train peak - pre-train" is what training added.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import (
    CALM,
    add_profiler,
    add_step_clock,
    add_worker_flags,
    environment,
    on_cpu,
    profile_summary,
    rss_mib,
    run_worker,
    start_worker,
    summarize_runs,
    timed_window,
    worker_result,
    write_report,
)

TOKENIZER = os.path.join(ROOT, "llm/assets/tiny_tokenizer")
DATA = {
    "orm": os.path.join(ROOT, "llm/data/sample/pairs_train.jsonl"),
    "prm": os.path.join(ROOT, "llm/data/sample/prm_train.jsonl"),
}
SIDES = ("ours", "trl")
GOALS = {"orm": 1.5, "prm": 1.3}
# medians over a side's runs; the first five are also quoted as ours / TRL, with the shared-machine rates
MEDIAN_KEYS = (
    "tokens_per_second",
    "tokens_per_cpu_second",
    "examples_per_second",
    "peak_rss_mib",
    "train_added_rss_mib",
    "pre_train_rss_mib",
    "timed_seconds",
)
RATIO_KEYS = (*MEDIAN_KEYS[:5], "calm_tokens_per_second", "fastest_steps_tokens_per_second")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke test: 32 pairs / 64 PRM solutions, 1 repeat")
    p.add_argument("--out", default=None, help="write the results as JSON to this path")
    p.add_argument("--tasks", default="orm,prm", help="comma-separated subset of orm,prm")
    p.add_argument("--pairs", type=int, default=None, help="ORM training pairs (default 256, quick 32)")
    p.add_argument("--prm-examples", type=int, default=None, help="PRM training solutions (default 512, quick 64)")
    p.add_argument("--repeats", type=int, default=None, help="runs per (task, side) (default 3, quick 1)")
    p.add_argument("--max-seq-len", type=int, default=1024, help="our packed row length")
    p.add_argument("--max-prompt-len", type=int, default=256)
    p.add_argument("--trl-batch", default="auto", help="TRL examples per step: an int or 'auto' (match ours)")
    p.add_argument("--warmup-steps", type=int, default=2, help="untimed first steps of each run")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per run (1: see the docstring)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4)
    add_worker_flags(p, "torch.profiler over this many steps (after warm-up) of each run; print the top ops (1 repeat)")
    args = p.parse_args(argv)
    if args.pairs is None:
        args.pairs = 32 if args.quick else 256
    if args.prm_examples is None:
        args.prm_examples = 64 if args.quick else 512
    if args.repeats is None:
        args.repeats = 1 if args.quick or args.profile else 3
    return args


# ----------------------------------------------------------------------------------------------- worker


class Counting:
    """Wraps a collator; records (real tokens, input_ids elements, examples) of every batch built."""

    def __init__(self, collate, kind: str):
        self.collate, self.kind, self.batches = collate, kind, []

    def __call__(self, features):
        batch = self.collate(features)
        if self.kind == "ours":
            self.batches.append((batch.num_real_tokens, batch.input_ids.numel(), batch.num_examples))
        else:
            ids, mask = batch["input_ids"], batch["attention_mask"]
            n = ids.shape[0] // 2 if self.kind == "trl_pairs" else ids.shape[0]
            self.batches.append((int(mask.sum()), ids.numel(), n))
        return batch


def run_side(args) -> dict:
    start_worker(args.threads)
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoModelForTokenClassification
    from trl.experimental.prm import PRMConfig, PRMTrainer

    from llm.alignment.rm.build import build_reward_trainer
    from llm.data.readers import load_dataset_records
    from llm.utils.arguments import DataArgument, ModelArgument, TrainingArguments
    from llm.utils.modeling import load_tokenizer

    task, side = args.side.split(":")
    model_dir = os.path.join(args.workdir, "model")
    data_path = os.path.join(args.workdir, f"{task}.jsonl")
    out_dir = tempfile.mkdtemp(prefix=f"{task}_{side}_", dir=args.workdir)
    common = {
        "output_dir": out_dir,
        "num_train_epochs": 1,
        "learning_rate": args.lr,
        "weight_decay": 0.0,
        "lr_scheduler_type": "linear",
        "warmup_steps": 0,
        "seed": args.seed,
        "do_train": True,
        "do_eval": False,
        "eval_strategy": "no",
        "save_strategy": "no",
        "logging_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "use_cpu": True,
        "bf16": False,
        "fp16": False,
        "gradient_accumulation_steps": 1,
    }

    if side == "ours":
        model_args = ModelArgument(
            model_name_or_path=model_dir, tokenizer_name_or_path=TOKENIZER, init_from_config=True
        )
        data_args = DataArgument(
            train_dataset_path=data_path,
            max_seq_len=args.max_seq_len,
            max_prompt_len=args.max_prompt_len,
            zero_padding=True,
            greedy_zero_padding=True,
        )
        training_args = TrainingArguments(per_device_train_batch_size=1, process_reward=(task == "prm"), **common)
        trainer, train, _ = build_reward_trainer(model_args, data_args, training_args)
        counter = Counting(trainer.data_collator, "ours")
        pack_pad = train.stats.pad_ratio
        n_examples = train.stats.examples
    else:
        tokenizer = load_tokenizer(TOKENIZER)
        cfg = AutoConfig.from_pretrained(model_dir)
        cfg.pad_token_id = tokenizer.pad_token_id
        records = list(load_dataset_records(data_path, "pair" if task == "orm" else "prm"))

        def prompt_text(rec) -> str:  # = llm.data.tokenize.render_prompt without chat template
            return "\n".join(m["content"] for m in rec.prompt) + "\n"

        def _with_labels(config, n: int):  # deep copy: transformers writes attn_implementation into it
            config = copy.deepcopy(config)
            config.num_labels = n
            return config

        transformers.set_seed(args.seed)
        if task == "orm":
            rows = [{"prompt": prompt_text(r), "chosen": r.chosen, "rejected": r.rejected} for r in records]
            model = AutoModelForSequenceClassification.from_config(
                _with_labels(cfg, 1), attn_implementation="sdpa", dtype=torch.float32
            )
            config = trl.RewardConfig(
                per_device_train_batch_size=int(args.trl_batch),
                activation_checkpointing=False,
                max_length=args.max_seq_len,
                center_rewards_coefficient=None,
                **common,
            )
            trainer = trl.RewardTrainer(
                model=model, args=config, train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer
            )
            counter = Counting(trainer.data_collator, "trl_pairs")
        else:
            rows = [
                {"prompt": prompt_text(r), "completions": list(r.steps), "labels": [lab == "+" for lab in r.labels]}
                for r in records
            ]
            model = AutoModelForTokenClassification.from_config(
                _with_labels(cfg, 2), attn_implementation="sdpa", dtype=torch.float32
            )
            config = PRMConfig(
                per_device_train_batch_size=int(args.trl_batch),
                activation_checkpointing=False,
                max_length=args.max_seq_len,
                step_separator="\n",
                **common,
            )
            trainer = PRMTrainer(
                model=model, args=config, train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer
            )
            counter = Counting(trainer.data_collator, "trl_tokens")
        pack_pad = None
        n_examples = len(rows)

    trainer.data_collator = counter
    stamps, cpu_stamps = add_step_clock(trainer)
    # torch.profiler (op level, with Python stacks) over steps warmup+1 .. warmup+N
    prof = add_profiler(trainer, args.warmup_steps, args.profile) if args.profile else None

    n_params = sum(p.numel() for p in trainer.model.parameters())
    pre_train_rss = rss_mib()
    t0, c0 = time.perf_counter(), time.process_time()
    trainer.train()
    total = time.perf_counter() - t0
    peak_rss = rss_mib()

    clock = timed_window(stamps, cpu_stamps, t0, c0, args.warmup_steps)
    steps, w = clock["steps"], clock["warmup"]
    seconds, cpu_seconds, step_times = clock["seconds"], clock["cpu_seconds"], clock["step_times"]
    timed = counter.batches[w:steps]
    real = sum(b[0] for b in timed)
    examples = sum(b[2] for b in timed)
    all_real = sum(b[0] for b in counter.batches[:steps])
    result = {
        "task": task,
        "side": side,
        "steps": steps,
        "timed_steps": steps - w,
        "timed_seconds": seconds,
        "train_seconds_total": total,
        "examples": n_examples,
        "examples_per_step": sum(b[2] for b in counter.batches[:steps]) / steps,
        "real_tokens_epoch": all_real,
        "real_tokens_per_example": all_real / max(n_examples, 1),
        "timed_cpu_seconds": cpu_seconds,
        "timed_real_tokens": real,
        "step_real_tokens": [b[0] for b in timed],
        "tokens_per_second": real / seconds,
        "tokens_per_cpu_second": real / cpu_seconds,
        "step_seconds": step_times,
        "examples_per_second": examples / seconds,
        "pad_ratio": 1.0 - sum(b[0] for b in counter.batches[:steps]) / sum(b[1] for b in counter.batches[:steps]),
        "pack_stats_pad_ratio": pack_pad,
        "slots_per_step": sum(b[1] for b in counter.batches[:steps]) / steps,
        "peak_rss_mib": peak_rss,
        "pre_train_rss_mib": pre_train_rss,
        "train_added_rss_mib": peak_rss - pre_train_rss,
        "parameters": n_params,
        "optimizer": str(trainer.args.optim),
        "activation_checkpointing": bool(trainer.args.activation_checkpointing),
        "attn_implementation": trainer.model.config._attn_implementation,
        "threads": torch.get_num_threads(),
    }
    if prof is not None:
        w0 = args.warmup_steps
        result["profile"] = profile_summary(
            prof,
            args.profile,
            real_tokens=sum(b[0] for b in counter.batches[w0 : w0 + args.profile]),
            slots=sum(b[1] for b in counter.batches[w0 : w0 + args.profile]),
        )
    return result


# ----------------------------------------------------------------------------------------------- driver


def prepare(args, workdir: str) -> dict:
    """Model config dir, data subsets, and the examples per packed row (for --trl-batch auto)."""
    from llm.alignment.rm.build import build_reward_data
    from llm.utils.arguments import DataArgument, ModelArgument
    from llm.utils.modeling import load_tokenizer, tiny_config

    tokenizer = load_tokenizer(TOKENIZER)
    cfg = tiny_config(
        "llama",
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(4096, args.max_seq_len),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    cfg.save_pretrained(os.path.join(workdir, "model"))
    info = {}
    for task in args.tasks:
        n = args.pairs if task == "orm" else args.prm_examples
        with open(DATA[task], encoding="utf-8") as f:
            lines = [line for line in f if line.strip()][:n]
        if len(lines) < n:
            print(f"warning: {DATA[task]} has only {len(lines)} records (asked {n})", file=sys.stderr)
        path = os.path.join(workdir, f"{task}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(lines)
        data = build_reward_data(
            path,
            tokenizer,
            ModelArgument(model_name_or_path=workdir),
            DataArgument(
                max_seq_len=args.max_seq_len,
                max_prompt_len=args.max_prompt_len,
                zero_padding=True,
                greedy_zero_padding=True,
            ),
            task == "prm",
            1,
            args.seed,
        )
        per_row = data.stats.examples / data.stats.rows
        batch = max(1, round(per_row)) if args.trl_batch == "auto" else int(args.trl_batch)
        info[task] = {
            "records": len(lines),
            "our_rows": data.stats.rows,
            "our_examples_per_row": per_row,
            "trl_batch": batch,
        }
    return info


def run_subprocess(args, task: str, side: str, workdir: str, trl_batch: int) -> dict:
    argv = [
        "--trl-batch",
        str(trl_batch),
        "--max-seq-len",
        str(args.max_seq_len),
        "--max-prompt-len",
        str(args.max_prompt_len),
        "--warmup-steps",
        str(args.warmup_steps),
        "--threads",
        str(args.threads),
        "--lr",
        str(args.lr),
        "--seed",
        str(args.seed),
        "--profile",
        str(args.profile),
    ]
    return run_worker(__file__, f"{task}:{side}", workdir, argv, ROOT, echo=bool(args.profile))


def fastest_steps_rate(runs: list[dict]) -> float:
    """Real tokens/s if every timed step had run as fast as in its fastest run. Every run of a side takes the
    same batches in the same order (seeded sampler), so step i is the same work in each; on a shared machine
    the fastest of a few repeats of a step is the nearest thing to its time on an idle core."""
    n = len(runs[0]["step_seconds"])
    if n == 0 or any(r["step_real_tokens"] != runs[0]["step_real_tokens"] for r in runs):
        return float("nan")  # not the same batches in the same order
    return runs[0]["timed_real_tokens"] / sum(min(r["step_seconds"][i] for r in runs) for i in range(n))


def _num(x: float, fmt: str, suffix: str = "") -> str:
    return "n/a" if math.isnan(x) else format(x, fmt) + suffix  # NaN: no run qualified


def fmt_table(summary: dict) -> str:
    lines = [
        (
            "| task | side | examples/step | real tok/example | pad ratio | real tokens/s | examples/s | "
            "real tokens/CPU-s | on CPU | real tokens/s, runs >= 95% on CPU | real tokens/s, fastest of each step | "
            "peak RSS MiB | train-added RSS MiB | runs |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for task, s in summary.items():
        for side in SIDES:
            m = s[side]
            lines.append(
                f"| {task.upper()} | {side} | {m['examples_per_step']:.1f} | {m['real_tokens_per_example']:.1f} | "
                f"{m['pad_ratio']:.1%} | {m['tokens_per_second']:.0f} | {m['examples_per_second']:.2f} | "
                f"{m['tokens_per_cpu_second']:.0f} | {m['on_cpu']:.0%} | "
                f"{_num(m['calm_tokens_per_second'], '.0f')} ({m['calm_runs']}) | "
                f"{_num(m['fastest_steps_tokens_per_second'], '.0f')} | {m['peak_rss_mib']:.0f} | "
                f"{m['train_added_rss_mib']:.0f} | {m['runs']} |"
            )
        r = s["ratio_ours_over_trl"]
        goal = GOALS[task]
        verdict = "met" if r["tokens_per_second"] >= goal else "NOT met"
        lines.append(
            f"| {task.upper()} | **ours/TRL** | | | | **{r['tokens_per_second']:.2f}x** (goal >= {goal}x: {verdict}) | "
            f"{r['examples_per_second']:.2f}x | {r['tokens_per_cpu_second']:.2f}x | | "
            f"{_num(r['calm_tokens_per_second'], '.2f', 'x')} | {_num(r['fastest_steps_tokens_per_second'], '.2f', 'x')} | "
            f"{r['peak_rss_mib']:.2f}x | {r['train_added_rss_mib']:.2f}x | |"
        )
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.side:
        return worker_result(args.result, run_side(args))
    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    assert all(t in DATA for t in args.tasks), args.tasks
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bench_reward_") as workdir:
        info = prepare(args, workdir)
        runs: dict = {t: {s: [] for s in SIDES} for t in args.tasks}
        for rep in range(args.repeats):
            for i, task in enumerate(args.tasks):
                order = SIDES if (rep + i) % 2 == 0 else SIDES[::-1]
                for side in order:
                    r = run_subprocess(args, task, side, workdir, info[task]["trl_batch"])
                    runs[task][side].append(r)
                    print(
                        f"[{time.time() - started:6.0f}s] rep {rep + 1}/{args.repeats} {task}/{side}: "
                        f"{r['tokens_per_second']:.0f} real tok/s ({r['tokens_per_cpu_second']:.0f}/CPU-s), "
                        f"{r['examples_per_second']:.2f} ex/s, {r['steps']} steps, pad {r['pad_ratio']:.1%}, "
                        f"on CPU {on_cpu(r):.0%} of the timed wall time, peak RSS {r['peak_rss_mib']:.0f} MiB",
                        flush=True,
                    )
    summary = {}
    for task in args.tasks:
        summary[task] = {}
        for side in SIDES:
            rs = runs[task][side]
            summary[task][side] = m = summarize_runs(
                rs,
                MEDIAN_KEYS,
                (
                    "examples_per_step",
                    "real_tokens_per_example",
                    "pad_ratio",
                    "pack_stats_pad_ratio",
                    "steps",
                    "examples",
                    "real_tokens_epoch",
                    "slots_per_step",
                    "parameters",
                    "optimizer",
                    "threads",
                    "activation_checkpointing",
                    "attn_implementation",
                ),
            )
            m["on_cpu"] = statistics.median(on_cpu(r) for r in rs)
            m["on_cpu_all"] = [on_cpu(r) for r in rs]
            calm = [r["tokens_per_second"] for r in rs if on_cpu(r) >= CALM]  # runs that had a core to themselves
            m["calm_runs"] = len(calm)
            m["calm_tokens_per_second"] = statistics.median(calm) if calm else float("nan")
            m["fastest_steps_tokens_per_second"] = fastest_steps_rate(rs)
        o, t = summary[task]["ours"], summary[task]["trl"]
        summary[task]["ratio_ours_over_trl"] = {k: o[k] / t[k] if t[k] else float("nan") for k in RATIO_KEYS}
        summary[task]["goal_tokens_per_second_ratio"] = GOALS[task]
    table = fmt_table(summary)
    print()
    print(table)
    report = {
        **environment("bench/bench_reward.py", argv or sys.argv[1:], args),
        "data": info,
        "summary": summary,
        "runs": runs,
        "table_markdown": table,
    }
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
