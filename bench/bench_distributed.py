"""Step time and peak memory per process of the parallel layouts of ``run_reward.py`` (PRM) under torchrun.

    python bench/bench_distributed.py                 # 2 processes: DDP, FSDP2 stage1/2/3, stage3 offload, TP 2
    python bench/bench_distributed.py --quick         # smoke run (< 2 min)
    python bench/bench_distributed.py --json out.json --repeats 3

Every layout trains the same random Llama (``--hidden``/``--layers``; 34M parameters by default, so that
parameters, gradients and AdamW state -- 16 bytes per parameter -- dominate a process's memory) on the
same packed PRM rows with the same global batch, for ``--steps`` optimizer steps. Each launch is its own
``torchrun`` (gloo, one thread per process); launches are interleaved layout by layout and repeated, and
the table gives medians. Step time is the median wall time of the steps after the first two (HF
Trainer callback); peak RSS is ``ru_maxrss`` of each process, the larger of the two reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.harness import (
    add_step_clock,
    add_worker_flags,
    after_warmup,
    environment,
    markdown_table,
    medians,
    rank_result,
    rss_mib,
    run_interleaved,
    run_worker,
    worker_env,
    worker_result,
    write_report,
)

LAYOUTS = {
    "ddp": [],
    "fsdp2 stage1": ["--sharding", "stage1"],
    "fsdp2 stage2": ["--sharding", "stage2"],
    "fsdp2 stage3": ["--sharding", "stage3"],
    "fsdp2 stage3 offload": ["--sharding", "stage3 offload"],
    "tensor parallel 2": ["--tensor_parallel_degree", "2"],
}


def write_model(directory: str, hidden: int, layers: int) -> None:
    from llm.utils.modeling import tiny_config

    config = tiny_config(
        "llama",
        648,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    config.save_pretrained(directory)


def write_config(directory: str, model_dir: str, steps: int, batch: int) -> str:
    with open(os.path.join(ROOT, "llm", "config", "tiny", "prm_argument.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    for key in ("tokenizer_name_or_path", "train_dataset_path"):
        cfg[key] = os.path.join(ROOT, cfg[key])
    cfg.update(
        model_name_or_path=model_dir,
        output_dir=os.path.join(directory, "out"),
        max_steps=steps,
        per_device_train_batch_size=batch,
        max_seq_len=1024,
        benchmark=True,
        report_to="none",
        disable_tqdm=True,
        logging_steps=1000,
        optim="adamw_torch",
        dataloader_num_workers=0,
    )
    cfg.pop("dev_dataset_path")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "bench.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    return path


def config_path(workdir: str, layout: str) -> str:
    """The run's config: batch rows on each of 2 data-parallel ranks ("dp"), or 2 x batch on one TP group ("tp")."""
    return os.path.join(workdir, "tp" if layout.startswith("tensor") else "dp", "bench.json")


def worker(args) -> None:
    """One torchrun process of layout ``--side``: build the PRM trainer, train, write step times and peak RSS."""
    import torch

    from llm.alignment.context import RunContext
    from llm.alignment.rm.build import build_reward_trainer
    from llm.settings.flat import validate_arguments
    from llm.settings.load import parse_arguments
    from llm.settings.reward import REWARD_ARGUMENT_TYPES
    from llm.utils.logging import setup_logging

    torch.set_num_threads(1)
    argv = [config_path(args.workdir, args.side), *LAYOUTS[args.side]]
    model_args, data_args, training_args = parse_arguments(argv, REWARD_ARGUMENT_TYPES)
    validate_arguments(model_args, data_args, training_args)
    setup_logging(training_args)
    trainer, _, _ = build_reward_trainer(RunContext.load(model_args, data_args, training_args))
    clock = add_step_clock(trainer)
    trainer.train()
    worker_result(rank_result(args.result), {"step_s": clock.durations, "peak_rss_mb": rss_mib()})


def launch(name: str, workdir: str, nproc: int, timeout: int) -> dict:
    """One ``torchrun`` of layout ``name``: the median step time after the first two (a step ends when the
    slowest rank does) and the larger peak RSS of the ranks."""
    launcher = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc))
    env = worker_env(1, HF_HUB_OFFLINE="1")
    ranks = run_worker(__file__, name, workdir, [], env=env, launcher=launcher, ranks=nproc, timeout=timeout)
    steps = [max(values) for values in zip(*(r["step_s"] for r in ranks))]
    return {"step_s": statistics.median(after_warmup(steps, 2)), "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2, help="packed rows per data-parallel rank and step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated subset of: " + ", ".join(LAYOUTS))
    parser.add_argument("--quick", action="store_true", help="small model, 4 steps, 1 repeat, 3 layouts")
    parser.add_argument("--json", help="also write the results here")
    add_worker_flags(parser, sides=tuple(LAYOUTS))
    args = parser.parse_args()
    if args.side:
        worker(args)
        return
    if args.quick:
        args.hidden, args.layers, args.steps, args.repeats = 128, 2, 4, 1
        args.layouts = "ddp,fsdp2 stage3,tensor parallel 2"
    names = [n.strip() for n in args.layouts.split(",")]
    with tempfile.TemporaryDirectory() as workdir:
        model_dir = os.path.join(workdir, "model")
        write_model(model_dir, args.hidden, args.layers)
        from transformers import AutoConfig, AutoModelForCausalLM

        n_params = sum(
            p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).parameters()
        )
        # the same global batch: batch rows on each of 2 data-parallel ranks, or 2 x batch on one TP group
        write_config(os.path.join(workdir, "dp"), model_dir, args.steps, args.batch)
        write_config(os.path.join(workdir, "tp"), model_dir, args.steps, 2 * args.batch)
        results = run_interleaved(
            names, args.repeats, lambda name, rep: launch(name, workdir, 2, 1200), describe=str, stream=sys.stderr
        )
    table = {name: {**medians(results[name]), "runs": results[name]} for name in names}
    base = table[names[0]]
    print(f"\n{n_params / 1e6:.1f}M parameters, 2 processes x 1 thread, {args.steps} steps, medians of {args.repeats}")
    rows = [
        [name, f"{t['step_s']:.3f}", f"{t['step_s'] / base['step_s']:.2f}x", f"{t['peak_rss_mb']:.0f}"]
        + [f"{t['peak_rss_mb'] / base['peak_rss_mb']:.2f}x"]
        for name, t in table.items()
    ]
    header = ["layout", "step (s)", f"vs {names[0]}", "peak RSS per process (MB)", f"vs {names[0]}"]
    markdown = markdown_table(header, rows)
    print(markdown)
    report = {
        "parameters": n_params,
        "args": vars(args),
        "layouts": table,
        "environment": environment("bench/bench_distributed.py", sys.argv[1:], args, libs=("torch", "transformers")),
        "table_markdown": markdown,
    }
    write_report(args.json, report)


if __name__ == "__main__":
    main()
