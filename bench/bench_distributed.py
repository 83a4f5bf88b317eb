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
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

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


def worker(config: str, result: str, flags: list[str]) -> None:
    """One torchrun process: build the PRM trainer, train, write step times and peak RSS."""
    import torch
    from transformers import TrainerCallback

    from llm.alignment.rm.build import build_reward_trainer
    from llm.utils.arguments import parse_arguments, validate_arguments
    from llm.utils.logging import setup_logging

    torch.set_num_threads(1)
    model_args, data_args, training_args = parse_arguments([config, *flags])
    validate_arguments(model_args, data_args, training_args)
    setup_logging(training_args)
    trainer, _, _ = build_reward_trainer(model_args, data_args, training_args)
    times: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.start)

    trainer.add_callback(StepTimes())
    trainer.train()
    rank = int(os.environ.get("RANK", "0"))
    with open(f"{result}.{rank}", "w", encoding="utf-8") as f:
        json.dump({"step_s": times, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}, f)


def launch(name: str, config: str, workdir: str, nproc: int, timeout: int) -> dict:
    result = os.path.join(workdir, name.replace(" ", "_"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    cmd += [os.path.abspath(__file__), "--worker", config, result, *LAYOUTS[name]]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    ranks = []
    for r in range(nproc):
        with open(f"{result}.{r}", encoding="utf-8") as f:
            ranks.append(json.load(f))
    steps = [max(values) for values in zip(*(r["step_s"] for r in ranks))]  # a step ends when the slowest rank does
    return {"step_s": statistics.median(steps[2:] or steps), "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2, help="packed rows per data-parallel rank and step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated subset of: " + ", ".join(LAYOUTS))
    parser.add_argument("--quick", action="store_true", help="small model, 4 steps, 1 repeat, 3 layouts")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.layers, args.steps, args.repeats = 128, 2, 4, 1
        args.layouts = "ddp,fsdp2 stage3,tensor parallel 2"
    names = [n.strip() for n in args.layouts.split(",")]
    results: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as workdir:
        model_dir = os.path.join(workdir, "model")
        write_model(model_dir, args.hidden, args.layers)
        from transformers import AutoConfig, AutoModelForCausalLM

        n_params = sum(
            p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).parameters()
        )
        configs = {
            # the same global batch: batch rows on each of 2 data-parallel ranks, or 2 x batch on one TP group
            "dp": write_config(os.path.join(workdir, "dp"), model_dir, args.steps, args.batch),
            "tp": write_config(os.path.join(workdir, "tp"), model_dir, args.steps, 2 * args.batch),
        }
        for repeat in range(args.repeats):
            order = names[repeat % len(names) :] + names[: repeat % len(names)]  # rotate who goes first
            for name in order:
                config = configs["tp" if name.startswith("tensor") else "dp"]
                results[name].append(launch(name, config, workdir, 2, 1200))
                print(f"repeat {repeat + 1}/{args.repeats} {name}: {results[name][-1]}", file=sys.stderr, flush=True)
    base = statistics.median(r["step_s"] for r in results[names[0]])
    base_rss = statistics.median(r["peak_rss_mb"] for r in results[names[0]])
    print(f"\n{n_params / 1e6:.1f}M parameters, 2 processes x 1 thread, {args.steps} steps, medians of {args.repeats}")
    print(f"| layout | step (s) | vs {names[0]} | peak RSS per process (MB) | vs {names[0]} |")
    print("|---|---|---|---|---|")
    table = {}
    for name in names:
        step = statistics.median(r["step_s"] for r in results[name])
        rss = statistics.median(r["peak_rss_mb"] for r in results[name])
        table[name] = {"step_s": step, "peak_rss_mb": rss, "runs": results[name]}
        print(f"| {name} | {step:.3f} | {step / base:.2f}x | {rss:.0f} | {rss / base_rss:.2f}x |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"parameters": n_params, "args": vars(args), "layouts": table}, f, indent=2)


if __name__ == "__main__":
    main()
