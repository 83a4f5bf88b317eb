"""SFT and DPO training throughput on CPU: our trainers (packed rows) vs TRL 1.12 ``SFTTrainer`` / ``DPOTrainer``.

Run from the repository root::

    python bench/bench_sft_dpo.py --out /tmp/bench_sft_dpo.json   # 800 pairs / 800 SFT examples, 3 repeats
    python bench/bench_sft_dpo.py --quick                          # smoke test (< 2 min)
    python bench/bench_sft_dpo.py --profile 5 --tasks dpo          # op-level profile of 5 steps per side
    python bench/bench_sft_dpo.py --tasks dpo --lora --dpo-ref online --hidden 640 --layers 9 \
        --intermediate 1728 --heads 8 --kv-heads 8                 # DPO LoRA vs full, ours and TRL, 45M model
    python bench/bench_sft_dpo.py --model smollm2 --tasks dpo --sides ours,trl,ours_lora --lora --lora-rank 16 \
        --lora-dropout 0                                           # the real model (see below)

``--model smollm2`` (or ``--model-dir DIR``: an HF directory with weights and tokenizer) runs the same sides on
SmolLM2-135M-Instruct: the argument files ``llm/config/smollm2/{dpo,sft}_argument.json`` (pretrained weights,
its tokenizer and chat template, max_seq_len 1024) instead of the tiny ones, TRL loading the same weights, and
shorter runs unless given (``--pairs 36 --sft-examples 48 --warmup-steps 1 --repeats 2``: ~5-7 packed rows).
With ``--lora``, SFT also gets the ``ours_lora`` side (LoRA vs full fine-tuning memory: goal peak RSS <= 0.6x
full on the real model); DPO's goals there: ours >= 1.5x TRL's tokens/s at <= 0.6x its peak RSS.

Both sides take their settings from the same tiny configs, ``llm/config/tiny/dpo_argument.json`` and
``llm/config/tiny/sft_argument.json`` (model, max_seq_len 1024, max_prompt_len 256, greedy packing,
lr, schedule, warmup, weight decay, seed, DPO loss/beta/precompute_ref_log_probs), with the benchmark
overrides: one epoch over the first N training records, no evaluation, no saving, no logging, fp32,
activation checkpointing off, 1 thread. Same random weights on both sides (``load_model`` with the
config's seed; an initial-weights checksum is compared), the Trainer's AdamW (``adamw_torch_fused``)
on both, and the *same token ids*: TRL gets our tokenisation of every record (prompt / chosen /
rejected ids split back from our pair examples, as ``tests/test_dpo.py`` does; SFT ``input_ids``
with ``labels`` = the token at every response position, -100 elsewhere), so both sides train on
identical examples and targets.

  dpo/ours           ``build_dpo_trainer`` (``llm/run_dpo.py``): each pair is one example
                     [prompt | chosen | rejected] (prompt computed once), greedy-packed into rows of
                     1024, 1 row per optimizer step, ``packed_sdpa``; LM head at answer tokens only.
  dpo/trl            ``trl.DPOTrainer``: batches of ``--trl-batch`` pairs = 2x sequences
                     (prompt + chosen, prompt + rejected: the prompt computed twice), right-padded,
                     sdpa + 2-D mask, logits at every position. (``padding_free`` is disabled for DPO
                     in TRL 1.12: it warns and falls back to padding.)
  dpo/ours_lora      (``--lora``) ``dpo/ours`` with our LoRA fields (``lora: true``, ``lora_rank``,
                     ``lora_alpha``, ``lora_dropout``, the default targets: every attention and MLP
                     projection; ``llm/utils/lora.py``): adapters trained, the reference is the base with
                     the adapter disabled (no copy).
  dpo/trl_lora       (``--lora``) ``dpo/trl`` with ``peft_config=LoraConfig(...)`` (same rank, alpha,
                     dropout, targets), ``ref_model=None``: TRL's reference is then the adapter-disabled
                     base. ``disable_dropout`` is off on this side so that the LoRA dropout is the same as
                     ours (the model itself has no dropout).
  sft/ours           ``build_sft_trainer`` (``llm/run_finetune.py``): greedy-packed rows of 1024, 1 per step.
  sft/trl            ``trl.SFTTrainer``, packing=False: batches of ``--trl-batch`` examples, right-padded.
  sft/trl_packed     packing=True (strategy "bfd", best-fit decreasing into rows of 1024; TRL then
                     turns padding_free on): 1 row per step, position_ids restart per example and
                     transformers' sdpa mask builder makes the (exact) block-diagonal causal mask.
  sft/trl_padfree    padding_free=True, packing=False: ``--trl-batch`` examples flattened into one
                     sequence per step, the same mask mechanism.

``--trl-batch auto`` (default) sets TRL's examples per step (unpacked modes) to our mean examples per
packed row, rounded, so each optimizer step covers about the same number of pairs / examples.

Token count convention (the same for every side): **real tokens = the tokens of each example counted
once**: for a pair, prompt + chosen + rejected; for SFT, the conversation. TRL's DPO batch holds
2 x prompt + chosen + rejected non-pad tokens; those are reported as "computed tokens". pairs/s (or
examples/s) is convention-free. Pad ratio = 1 - computed non-pad tokens / elements of ``input_ids``.

Each (task, side) run is its own subprocess (this script with ``--side``), importing the same modules
(torch, transformers, trl, datasets, llm), so peak RSS (``ru_maxrss`` at the end) is per side.
Runs are interleaved (the starting side rotates every repeat) and repeated; tables quote medians.
Timing: a TrainerCallback stamps ``on_step_end``; the first ``--warmup-steps`` steps are not timed.
Timed = data collation + forward + backward + optimizer + scheduler (the whole training step).
Setup (tokenisation, packing, model, and the DPO reference log-probs precomputed on both sides) is
reported apart as "setup s". With 1 thread, real tokens per CPU-second (``time.process_time``) is a
load-robust companion to the wall-clock rate on a shared machine; "on CPU" is CPU time / wall time of
the timed steps (below 100%: the run was preempted by other jobs), and the median over the runs that
were at least 95% on CPU (their count in brackets) is the nearest thing to an idle-core wall-clock rate.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import sys
import tempfile
import time

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
    worker_env,
    worker_result,
    write_report,
)

CONFIGS = {
    "dpo": os.path.join(ROOT, "llm/config/tiny/dpo_argument.json"),
    "sft": os.path.join(ROOT, "llm/config/tiny/sft_argument.json"),
}
REAL_CONFIGS = {  # --model smollm2 / --model-dir (the model path replaced by --model-dir)
    "dpo": os.path.join(ROOT, "llm/config/smollm2/dpo_argument.json"),
    "sft": os.path.join(ROOT, "llm/config/smollm2/sft_argument.json"),
}
SIDES = {"dpo": ("ours", "trl"), "sft": ("ours", "trl", "trl_packed", "trl_padfree")}
LORA_SIDES = ("ours", "ours_lora", "trl", "trl_lora")  # DPO with --lora
SFT_LORA_SIDES = ("ours", "ours_lora", "trl", "trl_packed", "trl_padfree")  # SFT with --lora
# (numerator, denominator) of the ratio rows; ours / this TRL side on real tokens/s must reach the factor
# (issue #5; with --lora, issue #15: ours LoRA at least TRL LoRA)
GOALS = {"dpo": ("trl", 1.5), "sft": ("trl_packed", 1.0)}
LORA_GOAL = (("ours_lora", "trl_lora"), 1.0)
LORA_RATIOS = (("ours", "trl"), ("ours_lora", "trl_lora"), ("ours_lora", "ours"), ("trl_lora", "trl"))
MODEL_FLAGS = ("hidden", "intermediate", "layers", "heads", "kv_heads")
# on the real model (issue 19): DPO peak RSS ours / TRL at most this; LoRA peak RSS / full fine-tuning at most this
REAL_DPO_RSS_GOAL, REAL_LORA_RSS_GOAL = 0.6, 0.6


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke test: 96 pairs / 128 SFT examples, 1 repeat")
    p.add_argument("--out", default=None, help="write the results as JSON to this path")
    p.add_argument("--tasks", default="dpo,sft", help="comma-separated subset of dpo,sft")
    p.add_argument(
        "--sides", default=None, help="comma-separated subset of the sides (default all: ours,trl,trl_packed,...)"
    )
    p.add_argument("--pairs", type=int, default=None, help="DPO training pairs (default 800 = all, quick 96, real 36)")
    p.add_argument(
        "--sft-examples", type=int, default=None, help="SFT training examples (default 800, quick 128, real 48)"
    )
    p.add_argument("--repeats", type=int, default=None, help="runs per (task, side) (default 3, quick 1, real 2)")
    p.add_argument("--trl-batch", default="auto", help="TRL examples per step (unpacked): an int or 'auto'")
    p.add_argument("--warmup-steps", type=int, default=None, help="untimed first steps of each run (2; real 1)")
    p.add_argument(
        "--model",
        choices=("tiny", "smollm2"),
        default="tiny",
        help="tiny: llm/config/tiny (random weights); smollm2: llm/config/smollm2 (SmolLM2-135M-Instruct, pretrained)",
    )
    p.add_argument(
        "--model-dir", default=None, help="a real HF model directory (weights + tokenizer), with the smollm2 configs"
    )
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (and OMP_NUM_THREADS) per run")
    p.add_argument(
        "--dpo-ref",
        choices=("precompute", "online"),
        default=None,
        help="DPO reference log-probs: precomputed before training (the config's default) or a frozen "
        "reference model run in every step, on both sides",
    )
    p.add_argument(
        "--lora",
        action="store_true",
        help="DPO: also the LoRA sides ours_lora (our lora fields) and trl_lora (TRL's peft_config); the reference "
        "is the adapter-disabled base on both",
    )
    p.add_argument(
        "--recompute",
        action="store_true",
        help="activation checkpointing on every side (ours: recompute true; TRL: activation_checkpointing)",
    )
    p.add_argument(
        "--bf16",
        action="store_true",
        help="bf16 mixed precision on every side (fp32 weights, torch.autocast(cpu, bfloat16); ours: bf16 true, "
        "TRL: bf16=True)",
    )
    p.add_argument("--lora-rank", type=int, default=8, help="with --lora: lora_rank / LoraConfig r (default 8)")
    p.add_argument("--lora-alpha", type=float, default=16.0, help="with --lora: lora_alpha (default 16)")
    p.add_argument("--lora-dropout", type=float, default=0.05, help="with --lora: lora_dropout (default 0.05)")
    for flag in MODEL_FLAGS:
        p.add_argument(
            f"--{flag.replace('_', '-')}",
            type=int,
            default=None,
            help="model size override (default: the config's llm/assets/tiny-llama as is)",
        )
    add_worker_flags(
        p, "profile this many steps (after warm-up) of one run per side instead of timing; print the top ops"
    )
    args = p.parse_args(argv)
    real = args.model_dir is not None or args.model == "smollm2"
    if real and any(getattr(args, flag) is not None for flag in MODEL_FLAGS):
        p.error("--hidden/--layers/... resize the tiny model only")
    if args.pairs is None:
        args.pairs = 96 if args.quick else 36 if real else 800
    if args.sft_examples is None:
        args.sft_examples = 128 if args.quick else 48 if real else 800
    if args.repeats is None:
        args.repeats = 1 if args.quick or args.profile else 2 if real else 3
    if args.warmup_steps is None:
        args.warmup_steps = 1 if real else 2
    return args


# ----------------------------------------------------------------------------------------------- worker


def our_arguments(
    task: str,
    workdir: str,
    out_dir: str,
    dpo_ref: str | None,
    lora: tuple | None = None,
    model_dir: str | None = None,
    recompute: bool = False,
    bf16: bool = False,
):
    """The tiny config of ``task`` parsed as ``run_dpo.py`` / ``run_finetune.py`` do, with the benchmark overrides;
    ``lora``: (rank, alpha, dropout) to set our LoRA fields (default targets), or None (full fine-tuning);
    ``model_dir``: a real model (the smollm2 config of ``task``, this model and its tokenizer)."""
    from llm.settings.dpo import DPO_ARGUMENT_TYPES
    from llm.settings.flat import ARGUMENT_TYPES, validate_arguments
    from llm.settings.load import parse_arguments

    cli = [
        (REAL_CONFIGS if model_dir else CONFIGS)[task],
        "--model_name_or_path",
        model_dir or os.path.join(workdir, "model"),
        "--tokenizer_name_or_path",
        model_dir or TOKENIZER,
        "--train_dataset_path",
        os.path.join(workdir, f"{task}.jsonl"),
        "--output_dir",
        out_dir,
        "--num_train_epochs",
        "1",
        "--benchmark",
        "true",  # no evaluation, no saving
        "--do_eval",
        "false",
        "--logging_strategy",
        "no",
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
        "--use_cpu",
        "true",
        "--bf16",
        str(bf16).lower(),
    ]
    if task == "dpo" and dpo_ref is not None:
        cli += ["--precompute_ref_log_probs", str(dpo_ref == "precompute").lower()]
    if recompute:
        cli += ["--recompute", "true"]
    if lora is not None:
        rank, alpha, dropout = lora
        cli += ["--lora", "true", "--lora_rank", str(rank), "--lora_alpha", str(alpha), "--lora_dropout", str(dropout)]
    model_args, data_args, training_args = parse_arguments(cli, DPO_ARGUMENT_TYPES if task == "dpo" else ARGUMENT_TYPES)
    validate_arguments(model_args, data_args, training_args)
    return model_args, data_args, training_args


def encoded_examples(task: str, path: str, tokenizer, cfg) -> list:
    """Our ``Example`` of every record (unpacked), exactly as our data pipeline encodes them (``cfg``: the run's
    ``RunContext.encoding``)."""
    from llm.data.encode_lm import encode_pair_for_lm, encode_sft
    from llm.data.encoding import encode_all
    from llm.data.readers import load_dataset_records

    if task == "dpo":
        encode = functools.partial(encode_pair_for_lm, tokenizer=tokenizer, cfg=cfg)  # sigmoid: no prompt targets
    else:
        encode = functools.partial(encode_sft, tokenizer=tokenizer, cfg=cfg)
    records = list(load_dataset_records(path, "pair" if task == "dpo" else "sft"))
    return encode_all(records, encode, path)[0]


def split_pair(ex) -> dict:
    """A packed pair example [prompt | chosen | rejected] back into TRL's three id lists."""
    p = ex.blocks[1].kv[0][1]
    c = ex.blocks[0].q_end - p
    return {
        "prompt_ids": ex.input_ids[:p],
        "chosen_ids": ex.input_ids[p : p + c],
        "rejected_ids": ex.input_ids[p + c :],
    }


def sft_row(ex) -> dict:
    """An SFT example as TRL's pre-tokenized form: input_ids, labels = the target token at every target position."""
    labels = [-100] * len(ex.input_ids)
    for pos, target in zip(ex.readout_position, ex.readout_target):
        labels[pos + 1] = target
    return {"input_ids": list(ex.input_ids), "labels": labels}


# ``counts`` of one batch, on every side. real = each example's tokens once (a pair: prompt + chosen +
# rejected); computed = non-pad tokens the model runs (TRL DPO: 2 x prompt + chosen + rejected); targets = loss
# tokens (answer tokens).


def our_counts(batch) -> tuple:
    return counts(
        batch.num_real_tokens, batch.input_ids.numel(), batch.num_examples, targets=batch.readout_index.numel()
    )


def trl_dpo_counts(batch) -> tuple:
    ids, mask, comp = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    pairs = ids.shape[0] // 2
    computed = int(mask.sum())
    prompts = int((mask[:pairs] - comp[:pairs]).sum())  # the prompt tokens of the chosen half
    return counts(computed - prompts, ids.numel(), pairs, computed, int(comp.sum()))


def trl_lm_counts(batch) -> tuple:
    """TRL SFT: padded (attention_mask) or padding-free (one flat sequence, position_ids)."""
    ids, labels = batch["input_ids"], batch["labels"]
    if "attention_mask" in batch:
        real, examples = int(batch["attention_mask"].sum()), ids.shape[0]
    else:
        real, examples = ids.numel(), int((batch["position_ids"] == 0).sum())
    return counts(real, ids.numel(), examples, targets=int((labels[:, 1:] != -100).sum()))


def trl_common(training_args, out_dir: str) -> dict:
    """TRL config fields copied from our parsed arguments, so both sides train alike."""
    same = (
        "num_train_epochs",
        "learning_rate",
        "weight_decay",
        "lr_scheduler_type",
        "warmup_steps",
        "seed",
        "gradient_accumulation_steps",
        "max_grad_norm",
        "optim",
        "adam_beta1",
        "adam_beta2",
        "adam_epsilon",
        "dataloader_num_workers",
    )
    return {
        **{k: getattr(training_args, k) for k in same},
        "output_dir": out_dir,
        "do_train": True,
        "do_eval": False,
        "eval_strategy": "no",
        "save_strategy": "no",
        "logging_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "use_cpu": True,
        "bf16": bool(training_args.bf16),  # off unless --bf16
        "fp16": False,
        "activation_checkpointing": bool(training_args.activation_checkpointing),  # off unless --recompute
    }


def build_trl(task: str, side: str, args, model_args, data_args, training_args, out_dir: str):
    """The TRL trainer of ``side`` on our token ids; returns (trainer, its batch counts, examples)."""
    import datasets
    import trl
    from transformers import AutoModelForCausalLM

    from llm.alignment.context import RunContext
    from llm.utils.modeling import load_model

    run = RunContext.load(model_args, data_args, training_args)  # the tokenizer and encoding our side uses
    tokenizer = run.tokenizer
    model = load_model(
        AutoModelForCausalLM,
        model_args.model_name_or_path,
        init_from_config=model_args.init_from_config,
        seed=training_args.seed,
        attn_implementation="sdpa",
        pad_token_id=tokenizer.pad_token_id,
    )
    examples = encoded_examples(task, data_args.train_dataset_path, tokenizer, run.encoding)
    common = trl_common(training_args, out_dir)
    batch = int(args.trl_batch)
    if task == "dpo":
        ta = training_args
        if ta.loss_type != "sigmoid" or ta.sft_loss_weight or ta.reference_free:
            raise SystemExit("bench_sft_dpo: the DPO comparison is for loss_type sigmoid with a reference")

        class TokenizedDPOTrainer(trl.DPOTrainer):
            """TRL's DPOTrainer fed our token ids: its text preparation (tokenising, adding EOS) is skipped."""

            def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
                return dataset

        peft_config = None
        if side == "trl_lora":
            from peft import LoraConfig

            from llm.utils.lora import DEFAULT_TARGETS

            peft_config = LoraConfig(
                r=args.lora_rank,
                lora_alpha=args.lora_alpha,
                lora_dropout=args.lora_dropout,
                target_modules=list(DEFAULT_TARGETS),  # ours: target_modules unset = these
                bias="none",
                task_type="CAUSAL_LM",
            )
        config = trl.DPOConfig(
            per_device_train_batch_size=batch,
            max_length=data_args.max_seq_len,
            beta=ta.beta,
            loss_type=["sigmoid"],
            label_smoothing=ta.label_smoothing,
            precompute_ref_log_probs=ta.precompute_ref_log_probs,
            # TRL zeroes every nn.Dropout by default, LoRA's too; ours keeps lora_dropout (the model has none)
            disable_dropout=peft_config is None,
            **common,
        )
        # with peft_config TRL's reference is the adapter-disabled base: no copy
        ref = None if ta.precompute_ref_log_probs or peft_config is not None else copy.deepcopy(model)
        trainer = TokenizedDPOTrainer(
            model=model,
            ref_model=ref,
            args=config,
            train_dataset=datasets.Dataset.from_list([split_pair(ex) for ex in examples]),
            processing_class=tokenizer,
            peft_config=peft_config,
        )
        return trainer, trl_dpo_counts, len(examples)
    packed = side == "trl_packed"
    config = trl.SFTConfig(
        per_device_train_batch_size=1 if packed else batch,
        # padding-free without packing refuses a max_length it cannot enforce; our examples are already cut to it
        max_length=None if side == "trl_padfree" else data_args.max_seq_len,
        packing=packed,
        packing_strategy="bfd",
        padding_free=side == "trl_padfree",
        **common,
    )
    trainer = trl.SFTTrainer(
        model=model,
        args=config,
        train_dataset=datasets.Dataset.from_list([sft_row(ex) for ex in examples]),
        processing_class=tokenizer,
    )
    return trainer, trl_lm_counts, len(examples)


def weights_checksum(model) -> float:
    """Of the base weights (LoRA adapters left out: their random init is peft's, not the config's seed), so a
    LoRA side and a full side of the same model agree."""
    import torch

    base = [p for name, p in model.named_parameters() if "lora_" not in name]
    with torch.no_grad():
        return float(sum(p.double().sum() * (i + 1) for i, p in enumerate(base)))


def run_side(args) -> dict:
    """One (task, side) run in this process: build, train one epoch, count and time it."""
    start_worker(args.threads)
    from llm.alignment.context import RunContext
    from llm.alignment.dpo.build import build_dpo_trainer
    from llm.alignment.sft.build import build_sft_trainer

    task, side = args.side.split(":")
    out_dir = tempfile.mkdtemp(prefix=f"{task}_{side}_", dir=args.workdir)
    lora = (args.lora_rank, args.lora_alpha, args.lora_dropout) if side == "ours_lora" else None
    model_args, data_args, training_args = our_arguments(
        task, args.workdir, out_dir, args.dpo_ref, lora, args.model_dir, args.recompute, args.bf16
    )
    s0 = time.perf_counter()
    if side in ("ours", "ours_lora"):
        build = build_dpo_trainer if task == "dpo" else build_sft_trainer
        trainer, train, _ = build(RunContext.load(model_args, data_args, training_args))
        measure, n_examples = our_counts, train.stats.examples
    else:
        trainer, measure, n_examples = build_trl(task, side, args, model_args, data_args, training_args, out_dir)
    setup_seconds = time.perf_counter() - s0
    trainer.data_collator = counter = Counting(trainer.data_collator, measure)
    facts = trainer_facts(trainer)
    facts["trainable_parameters"] = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    checksum = weights_checksum(trainer.model)
    m = measure_training(trainer, args.warmup_steps, args.profile)
    result = {
        "task": task,
        "side": side,
        "setup_seconds": setup_seconds,
        "train_loss": m["output"].training_loss,
        "examples": n_examples,
        **throughput(m, counter.batches),
        **facts,
        "initial_weights_checksum": checksum,
        "learning_rate": trainer.args.learning_rate,
        "batch_size": trainer.args.per_device_train_batch_size,
    }
    if m["profiler"] is not None:
        profiled = counter.batches[args.warmup_steps : args.warmup_steps + args.profile]
        result["profile"] = profile_summary(m["profiler"], args.profile, real_tokens=sum(b[0] for b in profiled))
    return result


# ----------------------------------------------------------------------------------------------- driver


def prepare(args, workdir: str) -> dict:
    """Model config dir (the config's tiny model, optionally resized), data subsets, our examples per packed row."""
    from transformers import AutoConfig

    from llm.alignment.context import RunContext
    from llm.alignment.dpo.build import build_pair_data
    from llm.alignment.sft.build import build_sft_data

    configs = REAL_CONFIGS if args.model_dir else CONFIGS
    info: dict = {}
    model_path = None
    for task in args.tasks:
        with open(configs[task], encoding="utf-8") as f:
            cfg = json.load(f)
        path = args.model_dir or os.path.join(ROOT, cfg["model_name_or_path"])
        if model_path not in (None, path):
            raise SystemExit(f"the configs name different models ({model_path}, {path})")
        model_path = path
        n = args.pairs if task == "dpo" else args.sft_examples
        data_path = os.path.join(workdir, f"{task}.jsonl")
        records = data_subset(os.path.join(ROOT, cfg["train_dataset_path"]), n, data_path)
        info[task] = {"records": records, "config": os.path.relpath(configs[task], ROOT)}
    config = AutoConfig.from_pretrained(model_path)
    sizes = {
        "hidden": "hidden_size",
        "intermediate": "intermediate_size",
        "layers": "num_hidden_layers",
        "heads": "num_attention_heads",
        "kv_heads": "num_key_value_heads",
    }
    for flag, name in sizes.items():
        if getattr(args, flag) is not None:
            setattr(config, name, getattr(args, flag))
    if args.model_dir is None:  # the tiny model, resized, saved as a config (random weights)
        config.head_dim = config.hidden_size // config.num_attention_heads
        config.save_pretrained(os.path.join(workdir, "model"))
    info["model"] = {name: getattr(config, name) for name in sizes.values()} | {"vocab_size": config.vocab_size}
    info["model"]["path"] = args.model_dir or "random weights of " + os.path.relpath(model_path, ROOT)
    for task in args.tasks:
        probe = os.path.join(workdir, "probe")
        model_args, data_args, training_args = our_arguments(
            task, workdir, probe, args.dpo_ref, model_dir=args.model_dir
        )
        run = RunContext.load(model_args, data_args, training_args)  # as the run will encode its data
        data_path = os.path.join(workdir, f"{task}.jsonl")
        seed = training_args.seed
        if task == "dpo":
            data = build_pair_data(data_path, run.tokenizer, data_args, run.encoding, training_args.loss_type, 1, seed)
        else:
            data = build_sft_data(data_path, run.tokenizer, data_args, run.encoding, 1, seed)
        info[task].update(
            our_rows=data.stats.rows,
            our_examples_per_row=data.stats.examples / data.stats.rows,
            trl_batch=matched_batch(data.stats, args.trl_batch),
            max_seq_len=data_args.max_seq_len,
        )
        if task == "dpo":
            info[task]["precompute_ref_log_probs"] = training_args.precompute_ref_log_probs
    return info


RATIO_KEYS = (
    "tokens_per_second",
    "tokens_per_cpu_second",
    "examples_per_second",
    "peak_rss_mib",
    "train_added_rss_mib",
    "calm_tokens_per_second",
)
MEDIAN_KEYS = (*RATIO_KEYS[:-1], "computed_tokens_per_second", "timed_seconds", "setup_seconds")
SAME_IN_EVERY_RUN = (
    "examples_per_step",
    "real_tokens_per_example",
    "pad_ratio",
    "steps",
    "examples",
    "real_tokens_epoch",
    "computed_tokens_epoch",
    "target_tokens_epoch",
    "slots_per_step",
    "batch_size",
    "parameters",
    "trainable_parameters",
    "optimizer",
    "learning_rate",
    "threads",
    "activation_checkpointing",
    "attn_implementation",
    "train_loss",
)


HEADER = (
    "task | side | examples/step | real tok/example | pad | real tokens/s | computed tokens/s | pairs or examples/s | "
    "real tokens/CPU-s | on CPU | real tokens/s, runs >= 95% on CPU | setup s | peak RSS MiB | train-added RSS MiB | runs"
)


def fmt_table(summary: dict, real: bool = False) -> str:
    rows = []
    for task, s in summary.items():
        for side in s["sides"]:
            m = s[side]
            rows.append(
                f"{task.upper()} | {side} | {m['examples_per_step']:.1f} | {m['real_tokens_per_example']:.1f} | "
                f"{m['pad_ratio']:.1%} | {m['tokens_per_second']:.0f} | {m['computed_tokens_per_second']:.0f} | "
                f"{m['examples_per_second']:.2f} | {m['tokens_per_cpu_second']:.0f} | {m['on_cpu']:.0%} | "
                f"{num(m['calm_tokens_per_second'], '.0f')} ({m['calm_runs']}) | {m['setup_seconds']:.1f} | "
                f"{m['peak_rss_mib']:.0f} | {m['train_added_rss_mib']:.0f} | {m['runs']}"
            )
        goals = {("ours", GOALS[task][0]): GOALS[task][1]}
        if "ours_lora" in s["sides"]:
            goals[LORA_GOAL[0]] = LORA_GOAL[1]
        rss_goals = {}  # at most
        if real:
            rss_goals = {("ours_lora", "ours"): REAL_LORA_RSS_GOAL}
            if task == "dpo":
                rss_goals[("ours", "trl")] = REAL_DPO_RSS_GOAL
        for name, r in s["ratios"].items():
            goal = goals.get(tuple(name.split(" / ")))
            verdict = rss_verdict = ""
            if goal is not None:
                verdict = f" (goal >= {goal}x: {'met' if r['tokens_per_second'] >= goal else 'NOT met'})"
            rss_goal = rss_goals.get(tuple(name.split(" / ")))
            if rss_goal is not None:
                rss_verdict = f" (goal <= {rss_goal}x: {'met' if r['peak_rss_mib'] <= rss_goal else 'NOT met'})"
            rows.append(
                f"{task.upper()} | **{name}** | | | | **{r['tokens_per_second']:.2f}x**{verdict} | | "
                f"{r['examples_per_second']:.2f}x | {r['tokens_per_cpu_second']:.2f}x | | "
                f"{num(r['calm_tokens_per_second'], '.2f', 'x')} | | **{r['peak_rss_mib']:.2f}x**{rss_verdict} | "
                f"{r['train_added_rss_mib']:.2f}x |"
            )
    return markdown_table(HEADER, rows)


def check_same_work(task: str, runs: dict) -> list[str]:
    """Warnings where the sides did not see the same weights, examples and tokens (and, LoRA sides against
    ``ours_lora``, the same number of parameters, trainable ones included)."""
    first = {side: rs[0] for side, rs in runs.items()}
    ours = first["ours"]
    warnings = []
    for side, r in first.items():
        keys = ["initial_weights_checksum", "examples_epoch", "real_tokens_epoch", "target_tokens_epoch"]
        for key in keys:
            if abs(r[key] - ours[key]) > 1e-9 * max(1.0, abs(ours[key])):
                warnings.append(f"{task}/{side}: {key} {r[key]} != ours {ours[key]}")
        anchor = "ours_lora" if side.endswith("_lora") else "ours"
        for key in ("parameters", "trainable_parameters"):
            if r[key] != first[anchor][key]:
                warnings.append(f"{task}/{side}: {key} {r[key]} != {anchor} {first[anchor][key]}")
        if (
            r["activation_checkpointing"] != ours["activation_checkpointing"]
            or r["threads"] != ours["threads"]
            or r["optimizer"] != ours["optimizer"]
        ):
            warnings.append(f"{task}/{side}: settings differ from ours ({r['optimizer']}, {r['threads']} threads)")
    return warnings


def describe(r: dict) -> str:
    return (
        f"{r['tokens_per_second']:.0f} real tok/s ({r['tokens_per_cpu_second']:.0f}/CPU-s), "
        f"{r['examples_per_second']:.2f} ex/s, {r['steps']} steps, pad {r['pad_ratio']:.1%}, "
        f"on CPU {on_cpu(r):.0%} of the timed wall time, "
        f"loss {r['train_loss']:.4f}, setup {r['setup_seconds']:.1f} s, "
        f"peak RSS {r['peak_rss_mib']:.0f} MiB"
    )


def lora_memory(s: dict) -> dict:
    """With the LoRA sides: the reference model's size (fp32 weights of the full model) and what LoRA saves in
    peak RSS, ours and TRL's, against the goal (saved >= the reference's size)."""
    ref_mib = s["ours"]["parameters"] * 4 / 2**20
    out = {"reference_model_mib": ref_mib}
    for family in ("ours", "trl"):
        if f"{family}_lora" in s["sides"] and family in s["sides"]:
            saved = s[family]["peak_rss_mib"] - s[f"{family}_lora"]["peak_rss_mib"]
            out[f"{family}_saved_mib"] = saved
            out[f"{family}_saved_over_reference"] = saved / ref_mib
    return out


def lora_memory_line(m: dict) -> str:
    parts = [f"reference model (fp32 weights) {m['reference_model_mib']:.0f} MiB"]
    for family in ("ours", "trl"):
        if f"{family}_saved_mib" in m:
            saved, x = m[f"{family}_saved_mib"], m[f"{family}_saved_over_reference"]
            verdict = "met" if x >= 1 else "NOT met"
            parts.append(f"{family}: LoRA saves {saved:.0f} MiB of peak RSS = {x:.2f}x it (goal >= 1x: {verdict})")
    return "DPO LoRA memory: " + "; ".join(parts)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.side:
        return worker_result(args.result, run_side(args))
    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    assert all(t in CONFIGS for t in args.tasks), args.tasks
    if args.model_dir is None and args.model == "smollm2":
        from llm.utils.gguf import smollm2_dir

        args.model_dir = smollm2_dir()
    wanted = None if args.sides is None else {s.strip() for s in args.sides.split(",")} | {"ours"}
    all_sides = dict(SIDES, dpo=LORA_SIDES, sft=SFT_LORA_SIDES) if args.lora else SIDES
    sides = {t: tuple(s for s in all_sides[t] if wanted is None or s in wanted) for t in args.tasks}
    env = worker_env(args.threads, TOKENIZERS_PARALLELISM="false")
    with tempfile.TemporaryDirectory(prefix="bench_sft_dpo_") as workdir:
        info = prepare(args, workdir)
        print(f"data and model: {json.dumps(info)}", flush=True)

        def run(task, side, rep):
            argv = forward_flags(
                args,
                "warmup_steps",
                "threads",
                "profile",
                "dpo_ref",
                "lora_rank",
                "lora_alpha",
                "lora_dropout",
                "model_dir",
                "recompute",
                "bf16",
                trl_batch=info[task]["trl_batch"],
            )
            return run_worker(__file__, f"{task}:{side}", workdir, argv, ROOT, env=env, echo=bool(args.profile))

        runs = run_interleaved(sides, args.repeats, run, describe=describe)
    summary: dict = {}
    warnings: list[str] = []
    for task in args.tasks:
        summary[task] = {"sides": list(sides[task])}
        for side in sides[task]:
            summary[task][side] = summarize_runs(runs[task][side], MEDIAN_KEYS, SAME_IN_EVERY_RUN)
        pairs = [("ours", side) for side in sides[task] if side not in ("ours", "ours_lora", "trl_lora")]
        if task == "dpo" and args.lora:
            pairs = [(a, b) for a, b in LORA_RATIOS if a in sides[task] and b in sides[task]]
        elif "ours_lora" in sides[task]:
            pairs.append(("ours_lora", "ours"))
        summary[task]["ratios"] = {
            f"{a} / {b}": ratios(summary[task][a], summary[task][b], RATIO_KEYS) for a, b in pairs
        }
        if task == "dpo" and args.lora:
            summary[task]["lora_memory"] = lora_memory(summary[task])
        warnings += check_same_work(task, runs[task])
    table = fmt_table(summary, real=args.model_dir is not None)
    print()
    print(table)
    if "lora_memory" in summary.get("dpo", {}):
        print(lora_memory_line(summary["dpo"]["lora_memory"]))
    for w in warnings:
        print(f"warning: {w}")
    report = {
        **environment("bench/bench_sft_dpo.py", argv or sys.argv[1:], args),
        "data": info,
        "summary": summary,
        "warnings": warnings,
        "runs": runs,
        "table_markdown": table,
    }
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
