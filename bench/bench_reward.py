"""Reward-model training throughput on CPU: our RewardTrainer (packed rows) vs TRL, ORM and PRM.

Run from the repository root::

    python bench/bench_reward.py --out bench_reward.json            # full: 256 pairs / 512 PRM solutions, 3 repeats
    python bench/bench_reward.py --repeats 5 --out bench_reward.json  # the run in bench/README.md (~8 min idle)
    python bench/bench_reward.py --quick                            # smoke test: 32 / 64, 1 repeat (~1-2 min)
    python bench/bench_reward.py --tasks prm --profile 8            # op-level profile of 8 steps per side
    python bench/bench_reward.py --model smollm2 --out bench/results/bench_reward_smollm2.json  # the real model

``--model smollm2`` (or ``--model-dir DIR``, any HF causal-LM directory with weights and tokenizer) runs the same
sides on a real model: its pretrained weights on both sides (the score / token-classification heads new,
seeded alike), its tokenizer (PRM placeholder ``--placeholder``, default the smollm2 config's one-token ``§``),
and shorter runs (``--pairs 36 --prm-examples 60 --warmup-steps 1 --repeats 2`` unless given: ~6 packed rows
of 1024 per task, 1 warm-up step), goal >= 2x TRL on both tasks.

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
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.harness import (
    TOKENIZER,
    Counting,
    add_worker_flags,
    counts,
    data_subset,
    environment,
    forward_flags,
    markdown_table,
    matched_batch,
    measure_training,
    num,
    on_cpu,
    profile_summary,
    ratios,
    run_interleaved,
    run_worker,
    start_worker,
    summarize_runs,
    throughput,
    trainer_facts,
    worker_result,
    write_report,
)

DATA = {
    "orm": os.path.join(ROOT, "llm/data/sample/pairs_train.jsonl"),
    "prm": os.path.join(ROOT, "llm/data/sample/prm_train.jsonl"),
}
SIDES = ("ours", "trl")
GOALS = {"orm": 1.5, "prm": 1.3}
REAL_GOALS = {"orm": 2.0, "prm": 2.0}  # issue 19: on the real model (--model smollm2 / --model-dir)
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
SAME_IN_EVERY_RUN = (
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
)
# the settings a worker gets from the driver (besides --trl-batch, set per task)
WORKER_SETTINGS = (
    *("max_seq_len", "max_prompt_len", "warmup_steps", "threads", "lr", "seed", "profile"),
    *("model_dir", "placeholder"),
)


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
    p.add_argument("--warmup-steps", type=int, default=None, help="untimed first steps of each run (2; real model 1)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per run (1: see the docstring)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument(
        "--model",
        choices=("tiny", "smollm2"),
        default="tiny",
        help="tiny: a random Llama of --hidden/--layers... on the tiny tokenizer; smollm2: SmolLM2-135M-Instruct "
        "(llm.utils.gguf.smollm2_dir), pretrained weights and its tokenizer",
    )
    p.add_argument("--model-dir", default=None, help="a real HF model directory (weights + tokenizer); implies it")
    p.add_argument("--placeholder", default=None, help="PRM step placeholder token (default: tiny 'ки', real '§')")
    add_worker_flags(p, "torch.profiler over this many steps (after warm-up) of each run; print the top ops (1 repeat)")
    args = p.parse_args(argv)
    real = real_model(args)
    if args.pairs is None:
        args.pairs = 32 if args.quick else 36 if real else 256
    if args.prm_examples is None:
        args.prm_examples = 64 if args.quick else 60 if real else 512
    if args.repeats is None:
        args.repeats = 1 if args.quick or args.profile else 2 if real else 3
    if args.warmup_steps is None:
        args.warmup_steps = 1 if real else 2
    if args.placeholder is None:
        args.placeholder = "§" if real else "ки"
    return args


def real_model(args) -> bool:
    """A real (pretrained) model: ``--model smollm2`` or ``--model-dir``."""
    return args.model_dir is not None or args.model == "smollm2"


def goals(args) -> dict:
    return REAL_GOALS if real_model(args) else GOALS


# ----------------------------------------------------------------------------------------------- worker


def our_counts(batch) -> tuple:
    """``counts`` of one of our packed batches."""
    return counts(batch.num_real_tokens, batch.input_ids.numel(), batch.num_examples)


def trl_counts(pairs: bool):
    """``counts`` of a TRL batch (padded; ``pairs``: chosen + rejected rows, two per example)."""

    def trl(batch) -> tuple:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        return counts(int(mask.sum()), ids.numel(), ids.shape[0] // 2 if pairs else ids.shape[0])

    return trl


def training_settings(args, out_dir: str) -> dict:
    """The Trainer settings both sides share."""
    return {
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


def build_ours(args, task: str, model_dir: str, data_path: str, common: dict):
    """orm/ours, prm/ours: ``build_reward_trainer``; returns (trainer, counter, pack pad ratio, examples)."""
    from llm.alignment.context import RunContext
    from llm.alignment.rm.build import build_reward_trainer
    from llm.settings.flat import DataArgument
    from llm.settings.reward import RewardModelArgument, RewardTrainingArguments

    real = args.model_dir is not None
    model_args = RewardModelArgument(
        model_name_or_path=model_dir,
        tokenizer_name_or_path=model_dir if real else TOKENIZER,
        init_from_config=not real,
        placeholder_token=args.placeholder,
    )
    data_args = DataArgument(
        train_dataset_path=data_path,
        max_seq_len=args.max_seq_len,
        max_prompt_len=args.max_prompt_len,
        zero_padding=True,
        greedy_zero_padding=True,
        use_chat_template=False,  # TRL gets the same plain prompt text (prompt_text)
    )
    training_args = RewardTrainingArguments(per_device_train_batch_size=1, process_reward=(task == "prm"), **common)
    trainer, train, _ = build_reward_trainer(RunContext.load(model_args, data_args, training_args))
    return trainer, Counting(trainer.data_collator, our_counts), train.stats.pad_ratio, train.stats.examples


def build_trl(args, task: str, model_dir: str, data_path: str, common: dict):
    """orm/trl: ``trl.RewardTrainer``; prm/trl: ``PRMTrainer``; returns (trainer, counter, None, examples)."""
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoModelForTokenClassification
    from trl.experimental.prm import PRMConfig, PRMTrainer

    from llm.data.readers import load_dataset_records
    from llm.utils.modeling import load_tokenizer

    real = args.model_dir is not None
    tokenizer = load_tokenizer(model_dir if real else TOKENIZER)
    cfg = AutoConfig.from_pretrained(model_dir)
    cfg.pad_token_id = tokenizer.pad_token_id

    def new_model(auto_class, n: int):
        """Random weights from the config (tiny), or the real model's weights with a new head of ``n`` labels."""
        if real:
            return auto_class.from_pretrained(
                model_dir,
                num_labels=n,
                pad_token_id=tokenizer.pad_token_id,
                attn_implementation="sdpa",
                dtype=torch.float32,
            )
        return auto_class.from_config(_with_labels(cfg, n), attn_implementation="sdpa", dtype=torch.float32)

    records = list(load_dataset_records(data_path, "pair" if task == "orm" else "prm"))

    def prompt_text(rec) -> str:  # = llm.data.encoding.render_prompt without chat template
        return "\n".join(m["content"] for m in rec.prompt) + "\n"

    def _with_labels(config, n: int):  # deep copy: transformers writes attn_implementation into it
        config = copy.deepcopy(config)
        config.num_labels = n
        return config

    transformers.set_seed(args.seed)
    if task == "orm":
        rows = [{"prompt": prompt_text(r), "chosen": r.chosen, "rejected": r.rejected} for r in records]
        model = new_model(AutoModelForSequenceClassification, 1)
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
    else:
        rows = [
            {"prompt": prompt_text(r), "completions": list(r.steps), "labels": [lab == "+" for lab in r.labels]}
            for r in records
        ]
        model = new_model(AutoModelForTokenClassification, 2)
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
    return trainer, Counting(trainer.data_collator, trl_counts(task == "orm")), None, len(rows)


def run_side(args) -> dict:
    """One (task, side) run in this process: build, train one epoch, count and time it."""
    start_worker(args.threads)
    task, side = args.side.split(":")
    data_path = os.path.join(args.workdir, f"{task}.jsonl")
    common = training_settings(args, tempfile.mkdtemp(prefix=f"{task}_{side}_", dir=args.workdir))
    build = build_ours if side == "ours" else build_trl
    model_dir = args.model_dir or os.path.join(args.workdir, "model")
    trainer, counter, pack_pad, n_examples = build(args, task, model_dir, data_path, common)
    trainer.data_collator = counter
    facts = trainer_facts(trainer)
    m = measure_training(trainer, args.warmup_steps, args.profile)
    result = {
        "task": task,
        "side": side,
        "examples": n_examples,
        **throughput(m, counter.batches),
        "pack_stats_pad_ratio": pack_pad,
        **facts,
    }
    result["real_tokens_per_example"] = result["real_tokens_epoch"] / max(n_examples, 1)
    if m["profiler"] is not None:
        profiled = counter.batches[args.warmup_steps : args.warmup_steps + args.profile]
        real, slots = (sum(b[i] for b in profiled) for i in (0, 2))
        result["profile"] = profile_summary(m["profiler"], args.profile, real_tokens=real, slots=slots)
    return result


# ----------------------------------------------------------------------------------------------- driver


def prepare(args, workdir: str) -> dict:
    """Model config dir (tiny; a real model is used in place), data subsets, and the examples per packed row."""
    from llm.settings.reward import RewardModelArgument
    from llm.utils.modeling import load_tokenizer, tiny_config

    if args.model_dir is not None:
        return prepare_data(args, workdir, load_tokenizer(args.model_dir), RewardModelArgument)
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
    return prepare_data(args, workdir, tokenizer, RewardModelArgument)


def prepare_data(args, workdir: str, tokenizer, model_argument) -> dict:
    """Data subsets and the examples per packed row (for --trl-batch auto)."""
    from llm.alignment.rm.data import build_reward_data
    from llm.data.encoding import EncodeConfig
    from llm.settings.flat import DataArgument

    info = {}
    for task in args.tasks:
        n = args.pairs if task == "orm" else args.prm_examples
        path = os.path.join(workdir, f"{task}.jsonl")
        records = data_subset(DATA[task], n, path)
        data_args = DataArgument(
            max_seq_len=args.max_seq_len,
            max_prompt_len=args.max_prompt_len,
            zero_padding=True,
            greedy_zero_padding=True,
            use_chat_template=False,
        )
        data = build_reward_data(
            path,
            "train",
            tokenizer,
            model_argument(model_name_or_path=workdir, placeholder_token=args.placeholder),
            data_args,
            EncodeConfig(data_args.max_seq_len, data_args.max_prompt_len, data_args.overlong_policy, False),
            task == "prm",
            1,
            args.seed,
        )
        info[task] = {
            "records": records,
            "our_rows": data.stats.rows,
            "our_examples_per_row": data.stats.examples / data.stats.rows,
            "trl_batch": matched_batch(data.stats, args.trl_batch),
        }
    return info


def fastest_steps_rate(runs: list[dict]) -> float:
    """Real tokens/s if every timed step had run as fast as in its fastest run. Every run of a side takes the
    same batches in the same order (seeded sampler), so step i is the same work in each; on a shared machine
    the fastest of a few repeats of a step is the nearest thing to its time on an idle core."""
    n = len(runs[0]["step_seconds"])
    if n == 0 or any(r["step_real_tokens"] != runs[0]["step_real_tokens"] for r in runs):
        return float("nan")  # not the same batches in the same order
    return runs[0]["timed_real_tokens"] / sum(min(r["step_seconds"][i] for r in runs) for i in range(n))


HEADER = (
    "task | side | examples/step | real tok/example | pad ratio | real tokens/s | examples/s | real tokens/CPU-s | "
    "on CPU | real tokens/s, runs >= 95% on CPU | real tokens/s, fastest of each step | peak RSS MiB | "
    "train-added RSS MiB | runs"
)


def fmt_table(summary: dict, goal_of: dict = GOALS) -> str:
    rows = []
    for task, s in summary.items():
        for side in SIDES:
            m = s[side]
            rows.append(
                f"{task.upper()} | {side} | {m['examples_per_step']:.1f} | {m['real_tokens_per_example']:.1f} | "
                f"{m['pad_ratio']:.1%} | {m['tokens_per_second']:.0f} | {m['examples_per_second']:.2f} | "
                f"{m['tokens_per_cpu_second']:.0f} | {m['on_cpu']:.0%} | "
                f"{num(m['calm_tokens_per_second'], '.0f')} ({m['calm_runs']}) | "
                f"{num(m['fastest_steps_tokens_per_second'], '.0f')} | {m['peak_rss_mib']:.0f} | "
                f"{m['train_added_rss_mib']:.0f} | {m['runs']}"
            )
        r, goal = s["ratio_ours_over_trl"], goal_of[task]
        verdict = "met" if r["tokens_per_second"] >= goal else "NOT met"
        rows.append(
            f"{task.upper()} | **ours/TRL** | | | | **{r['tokens_per_second']:.2f}x** (goal >= {goal}x: {verdict}) | "
            f"{r['examples_per_second']:.2f}x | {r['tokens_per_cpu_second']:.2f}x | | "
            f"{num(r['calm_tokens_per_second'], '.2f', 'x')} | {num(r['fastest_steps_tokens_per_second'], '.2f', 'x')} | "
            f"{r['peak_rss_mib']:.2f}x | {r['train_added_rss_mib']:.2f}x |"
        )
    return markdown_table(HEADER, rows)


def describe(r: dict) -> str:
    return (
        f"{r['tokens_per_second']:.0f} real tok/s ({r['tokens_per_cpu_second']:.0f}/CPU-s), "
        f"{r['examples_per_second']:.2f} ex/s, {r['steps']} steps, pad {r['pad_ratio']:.1%}, "
        f"on CPU {on_cpu(r):.0%} of the timed wall time, peak RSS {r['peak_rss_mib']:.0f} MiB"
    )


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.side:
        return worker_result(args.result, run_side(args))
    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    assert all(t in DATA for t in args.tasks), args.tasks
    if args.model_dir is None and args.model == "smollm2":
        from llm.utils.gguf import smollm2_dir

        args.model_dir = smollm2_dir()
    with tempfile.TemporaryDirectory(prefix="bench_reward_") as workdir:
        info = prepare(args, workdir)

        def run(task, side, rep):
            argv = forward_flags(args, *WORKER_SETTINGS, trl_batch=info[task]["trl_batch"])
            return run_worker(__file__, f"{task}:{side}", workdir, argv, ROOT, echo=bool(args.profile))

        runs = run_interleaved({t: SIDES for t in args.tasks}, args.repeats, run, describe=describe)
    summary = {}
    for task in args.tasks:
        summary[task] = {}
        for side in SIDES:
            rs = runs[task][side]
            summary[task][side] = m = summarize_runs(rs, MEDIAN_KEYS, SAME_IN_EVERY_RUN)
            m["fastest_steps_tokens_per_second"] = fastest_steps_rate(rs)
        summary[task]["ratio_ours_over_trl"] = ratios(summary[task]["ours"], summary[task]["trl"], RATIO_KEYS)
        summary[task]["goal_tokens_per_second_ratio"] = goals(args)[task]
    table = fmt_table(summary, goals(args))
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
