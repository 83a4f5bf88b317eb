"""This machine's matmul peak at our shapes, and each trainer's achieved FLOP/s as a fraction of it (the CPU's
model FLOP utilisation, MFU; issue 30 item 1).

1. **Peak.** ``torch.matmul`` at the shapes a SmolLM2-135M training step multiplies (a 1024-token block against
   each projection: hidden 576 x 576 / 192 (k, v with 3 KV heads) / 1536 (MLP) and back, the 49,152-row LM head),
   forward shapes and the two backward products of each, in fp32 and, where the CPU has AVX-512 BF16 (or AMX),
   in bf16; at ``--threads`` (default 1 and all cores). Each shape is timed ``--repeats`` times after a warm-up and
   the best time counts (a peak: the least disturbed run on a shared machine); the machine's peak for a dtype and
   thread count is the best shape's FLOP/s, and the FLOP-weighted mean over the step's shapes is reported beside it
   (what a step made only of these products could reach).
2. **Trainers.** Achieved FLOP/s = real (non-padding) tokens per second x training FLOPs per token, from the
   benchmark results of ``bench_sft_dpo.py`` / ``bench_reward.py`` (``--results``; ours and TRL's measured in one
   run there, at the thread count each result file records). FLOPs per token, the usual count (Kaplan et al. 2020;
   PaLM's appendix B): a matmul with P weights costs 2P per token forward and 4P backward; causal attention adds
   2 x layers x context x hidden forward (QK^T and AV over half the context on average), times 3 with backward.
   Per trainer: SFT trains the decoder and the LM head on every token (6 x (P_layers + P_head)); an ORM the decoder
   and a one-row score head (6 x P_layers); a PRM the decoder, with the LM head only at the step placeholders
   (6 x P_layers; the readout is a few rows); DPO the policy on both responses (6 x (P_layers + P_head)) plus the
   frozen reference's forward (2 x (P_layers + P_head)) unless its log-probs were precomputed (the result file's
   ``precompute_ref_log_probs``: then the timed steps do not run it). The LM head counts at every token (model
   FLOPs, as PaLM's MFU): our SFT and DPO compute it at the answer tokens only (the readout), so their hardware
   FLOPs are up to ~10% fewer than counted here. A LoRA side's frozen
   base has no weight gradients: 4P instead of 6P. The context is the mean example length the result file records,
   else ``--context``.

MFU = achieved / the fp32 peak at the same thread count (the figure that compares runs), and beside it achieved /
the peak of the run's own precision (a result file whose settings say ``bf16``: ours bf16 weights, TRL bf16
autocast; how close that run came to what its dtype allows). The result files are read, not re-run: their date,
command and threads are printed with every figure (re-measure them with the commands in bench/README.md).

    python bench/bench_mfu.py --threads 1 --out bench/results/bench_mfu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.harness import environment, markdown_table, write_report

# SmolLM2-135M-Instruct (models/SmolLM2-135M-Instruct/config.json)
SMOLLM2 = {"hidden": 576, "intermediate": 1536, "layers": 30, "heads": 9, "kv_heads": 3, "vocab": 49152}
RESULTS = (
    "bench/results/bench_sft_dpo_smollm2_sft.json",
    "bench/results/bench_sft_dpo_smollm2_dpo.json",
    "bench/results/bench_reward_smollm2.json",
    "bench/results/bench_sft_dpo_smollm2_prec_fp32.json",
    "bench/results/bench_sft_dpo_smollm2_prec_bf16.json",
)


def projections(m: dict) -> list[tuple[int, int]]:
    """(in, out) of each weight matrix of one decoder layer."""
    h, i, kv = m["hidden"], m["intermediate"], m["hidden"] // m["heads"] * m["kv_heads"]
    return [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]


def layer_weights(m: dict) -> int:
    return m["layers"] * sum(a * b for a, b in projections(m))


def head_weights(m: dict) -> int:
    return m["hidden"] * m["vocab"]


def step_shapes(m: dict, tokens: int) -> list[tuple[int, int, int]]:
    """(m, k, n) of the products of a training step on a ``tokens`` block: forward x @ W, and backward's
    grad @ W^T and x^T @ grad, for every projection and the LM head."""
    out = []
    for k, n in [*projections(m), (m["hidden"], m["vocab"])]:
        out += [(tokens, k, n), (tokens, n, k), (k, tokens, n)]
    return out


def time_matmul(shape: tuple[int, int, int], dtype: torch.dtype, repeats: int) -> float:
    m, k, n = shape
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    torch.matmul(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * m * k * n / best


def has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def measure_peak(threads: int, dtypes: list[str], tokens: int, repeats: int) -> dict:
    torch.set_num_threads(threads)
    out = {}
    for name in dtypes:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
        shapes = step_shapes(SMOLLM2, tokens)
        flops = [time_matmul(s, dtype, repeats) for s in shapes]
        work = [2 * m * k * n for m, k, n in shapes]
        out[name] = {
            "peak_flops": max(flops),
            "step_mix_flops": sum(work) / sum(w / f for w, f in zip(work, flops)),
            "shapes": [{"shape": list(s), "flops": f} for s, f in zip(shapes, flops)],
        }
    return out


def flops_per_token(task: str, m: dict, context: float, lora: bool = False, reference: bool = True) -> float:
    """Training FLOPs per token (module docstring). ``lora``: the frozen base computes no weight gradients, so its
    backward is the input gradients only (2P, not 4P); the rank-r adapters' own products are left out (< 1%)."""
    layers, head = layer_weights(m), head_weights(m)
    attention = 2 * m["layers"] * context * m["hidden"]  # forward, causal
    train = 4 if lora else 6
    if task == "sft":
        return train * (layers + head) + 3 * attention
    if task == "dpo":  # the reference's forward unless its log-probs were precomputed before the timed steps
        return train * (layers + head) + 3 * attention + (2 * (layers + head) + attention if reference else 0)
    if task in ("orm", "prm"):
        return train * layers + 3 * attention
    raise ValueError(task)


def trainer_rows(paths: list[str], peaks: dict, default_context: float) -> list[dict]:
    rows = []
    for path in paths:
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            result = json.load(f)
        threads = result.get("settings", {}).get("threads") or 1
        dtype = "bf16" if result.get("settings", {}).get("bf16") else "fp32"
        for task, sides in result.get("summary", {}).items():
            data = result.get("data", {}).get(task, {})
            context = default_context
            if data.get("our_examples_per_row") and data.get("max_seq_len"):
                context = data["max_seq_len"] / data["our_examples_per_row"]
            for side, figures in sides.items():
                if not isinstance(figures, dict) or "tokens_per_second" not in figures or side.startswith("ratio"):
                    continue
                reference = not data.get("precompute_ref_log_probs", False)
                per_token = flops_per_token(task, SMOLLM2, context, lora="lora" in side, reference=reference)
                achieved = figures["tokens_per_second"] * per_token
                peak = peaks.get(threads, {}).get("fp32", {}).get("peak_flops")
                own_peak = peaks.get(threads, {}).get(dtype, {}).get("peak_flops")
                rows.append(
                    {
                        "task": task,
                        "side": side,
                        "threads": threads,
                        "precision": dtype,
                        "tokens_per_second": figures["tokens_per_second"],
                        "gflop_per_token": per_token / 1e9,
                        "achieved_gflops": achieved / 1e9,
                        "mfu_fp32": achieved / peak if peak else None,
                        "mfu_own_dtype": achieved / own_peak if own_peak else None,
                        "measured": result.get("date"),
                        "result": path,
                    }
                )
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", default=f"1,{os.cpu_count()}", help="comma-separated thread counts for the peak")
    p.add_argument("--dtypes", default="fp32,bf16", help="bf16 is measured only where the CPU has it")
    p.add_argument("--tokens", type=int, default=1024, help="rows of the activation block")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--results", default=",".join(RESULTS), help="benchmark result files to read the trainers from")
    p.add_argument("--context", type=float, default=128.0, help="mean attended length where a result has none")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    dtypes = [d for d in args.dtypes.split(",") if d != "bf16" or has_bf16()]
    threads = sorted({int(t) for t in args.threads.split(",")})
    peaks = {t: measure_peak(t, dtypes, args.tokens, args.repeats) for t in threads}
    rows = trainer_rows([p for p in args.results.split(",") if p], peaks, args.context)
    peak_rows = [
        {"threads": t, "dtype": d, "peak_gflops": v["peak_flops"] / 1e9, "step_mix_gflops": v["step_mix_flops"] / 1e9}
        for t, by_dtype in peaks.items()
        for d, v in by_dtype.items()
    ]
    for row in peak_rows:
        print(f"peak {row['dtype']} {row['threads']} thread(s): {row['peak_gflops']:.1f} GFLOP/s (step mix "
              f"{row['step_mix_gflops']:.1f})")  # fmt: skip
    for r in rows:
        mfu = "n/a" if r["mfu_fp32"] is None else f"{100 * r['mfu_fp32']:.1f}%"
        if r["precision"] != "fp32" and r["mfu_own_dtype"] is not None:
            mfu += f" ({100 * r['mfu_own_dtype']:.1f}% of the {r['precision']} peak)"
        print(f"{r['task']:4s} {r['side']:10s} {r['precision']} {r['threads']} thread(s): {r['achieved_gflops']:.1f} GFLOP/s, "
              f"MFU {mfu} (from {r['result']}, measured {r['measured']})")  # fmt: skip
    if args.out:
        write_report(
            args.out,
            {
                **environment("bench/bench_mfu.py", sys.argv[1:] if argv is None else argv, args),
                "bf16_in_cpu": has_bf16(),
                "peaks": peak_rows,
                "peak_shapes": {str(t): v for t, v in peaks.items()},
                "trainers": rows,
                "median_mfu_by_side": {
                    f"{side} {dtype}": statistics.median(
                        r["mfu_fp32"] for r in rows if (r["side"], r["precision"]) == (side, dtype) and r["mfu_fp32"]
                    )
                    for side, dtype in {(r["side"], r["precision"]) for r in rows if r["mfu_fp32"]}
                },
                "table_markdown": markdown_table(
                    "trainer | side | precision | threads | tokens/s | GFLOP/token | GFLOP/s | MFU (fp32 peak) | "
                    "MFU (own precision's peak)",
                    [
                        [
                            r["task"],
                            r["side"],
                            r["precision"],
                            r["threads"],
                            f"{r['tokens_per_second']:.1f}",
                            f"{r['gflop_per_token']:.3f}",
                            f"{r['achieved_gflops']:.1f}",
                            "n/a" if r["mfu_fp32"] is None else f"{100 * r['mfu_fp32']:.1f}%",
                            "n/a" if r["mfu_own_dtype"] is None else f"{100 * r['mfu_own_dtype']:.1f}%",
                        ]
                        for r in rows
                    ],
                ),
            },
        )


if __name__ == "__main__":
    main()
