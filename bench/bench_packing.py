"""Training throughput on CPU: padded batches vs packed rows (block-wise SDPA) vs packed rows (dense mask).

Run from the repository root::

    python bench/bench_packing.py            # full: 200 examples, 3 interleaved repeats (~15-25 min on 2 idle cores)
    python bench/bench_packing.py --quick    # smoke test: 60 examples, 1 repeat, smaller model (~1 min idle)
    python bench/bench_packing.py --bf16     # the same under torch.autocast(bfloat16)

Every method trains (forward + backward, no optimizer step) the same randomly initialised Llama on
the same examples (random token ids, lengths uniform in [32, 512], fixed seed), with the loss on
every real token (position t predicts token t+1 inside its example). To keep full-vocabulary logits
out of every method alike, the model runs with ``output_hidden_states=True, logits_to_keep=1`` and
``lm_head`` is applied only at the readout positions (``batch.readout_index`` for packed rows, the
same flat gather for padded batches).

Methods (interleaved A B C A B C ..., one untimed warm-up pass over a few batches of each first):
  padded      batches of ``--batch-size`` examples in data order, right-padded to the longest in the
              batch, stock ``attn_implementation="sdpa"`` with a 2-D attention mask.
  packed      ``pack(..., strategy="greedy")`` into rows of ``--max-len`` + ``collate``,
              ``attn_implementation="packed_sdpa"`` (block-wise SDPA), ``model(**batch.model_inputs())``.
  dense_mask  the same packed rows on stock ``sdpa`` with the dense 4-D bool mask
              (``batch.attention.dense_mask()``), built before timing.

Reported: real tokens/s (median over repeats), pad ratio (of the tensors actually computed),
seconds per epoch, model FLOP/s = 6 x non-embedding params x real tokens / s and its fraction of
the measured fp32 matmul peak (2048^3, median of several, measured before and after the runs), plus
a "full" FLOP/s that adds useful causal attention FLOPs (12 x hidden x layers x query-key pairs
within each example) and the lm_head FLOPs at the readouts (6 x hidden x vocab per readout).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import statistics
import sys
import time
from contextlib import nullcontext

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from bench.harness import environment, markdown_table, rotated, write_report
from llm.data.packing import causal_example, collate, pack
from llm.utils.attention import PACKED_SDPA
from llm.utils.modeling import tiny_config

PAD_ID = 0


# ----------------------------------------------------------------------------------------------- setup


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke test: 60 examples, 1 repeat")
    p.add_argument("--bf16", action="store_true", help="run the model under torch.autocast(cpu, bfloat16)")
    p.add_argument("--examples", type=int, default=None, help="number of examples (default 200, quick 60)")
    p.add_argument("--repeats", type=int, default=None, help="timed epochs per method (default 5, quick 1)")
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-example-len", type=int, default=512)
    p.add_argument("--max-len", type=int, default=2048, help="packed row length")
    p.add_argument("--batch-size", type=int, default=8, help="examples per padded batch")
    p.add_argument("--rows-per-batch", type=int, default=1, help="packed rows per step")
    p.add_argument("--chunks", type=int, default=5, help="interleaved chunks per epoch (default 5, quick 2)")
    p.add_argument("--warmup-batches", type=int, default=2, help="untimed batches per method before timing")
    p.add_argument("--no-dense", action="store_true", help="skip the dense-mask method")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=None, help="default 512")
    p.add_argument("--layers", type=int, default=None, help="default 8")
    p.add_argument("--heads", type=int, default=None, help="default 8")
    p.add_argument("--kv-heads", type=int, default=None, help="default 8")
    p.add_argument("--intermediate", type=int, default=None, help="default 1408")
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--verbose", action="store_true", help="print every timed chunk")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    if args.examples is None:
        args.examples = 60 if args.quick else 200
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    # --quick: a model ~8x cheaper per token, so that the smoke test stays under two minutes.
    small = {"hidden": 256, "layers": 4, "heads": 4, "kv_heads": 4, "intermediate": 704}
    model = small if args.quick else {"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 8, "intermediate": 1408}
    for key, value in model.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.quick:
        args.chunks = min(args.chunks, 2)
    return args


def make_examples(n: int, lo: int, hi: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    examples = []
    for i, length in enumerate(lengths):
        ids = torch.randint(1, vocab, (length,), generator=g).tolist()
        # LM readouts: position t predicts token t + 1 within the example.
        examples.append(causal_example(ids, list(range(length - 1)), ids[1:], record=i))
    return examples


def build_models(args, methods):
    cfg = tiny_config(
        "llama",
        args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        pad_token_id=PAD_ID,
    )
    impl = {"padded": "sdpa", "packed": PACKED_SDPA, "dense_mask": "sdpa"}
    models, state = {}, None
    for name in methods:
        torch.manual_seed(args.seed)
        # from_config writes attn_implementation into the config object: one deep copy per model.
        model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl[name])
        if state is None:
            state = model.state_dict()
        else:
            model.load_state_dict(state)  # identical weights across methods
        model.train()
        models[name] = model
    return cfg, models


def non_embedding_params(model) -> int:
    skip = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)


def matmul_peak(dtype: torch.dtype, n: int = 2048, reps: int = 7) -> float:
    """FLOP/s of an n^3 matmul, median of ``reps`` after one warm-up."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    torch.mm(a, b)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


# --------------------------------------------------------------------------------------------- batches


class Step:
    """One training step's inputs: model kwargs, flat readout index and targets, bookkeeping."""

    def __init__(self, inputs: dict, readout_index, readout_target, real_tokens: int, computed_tokens: int):
        self.inputs = inputs
        self.readout_index = readout_index
        self.readout_target = readout_target
        self.real_tokens = real_tokens
        self.computed_tokens = computed_tokens


def padded_steps(examples, batch_size: int) -> list[Step]:
    steps = []
    for s in range(0, len(examples), batch_size):
        chunk = examples[s : s + batch_size]
        length = max(len(e) for e in chunk)
        ids = torch.full((len(chunk), length), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(chunk), length), dtype=torch.long)
        index, target = [], []
        for r, e in enumerate(chunk):
            ids[r, : len(e)] = torch.tensor(e.input_ids)
            mask[r, : len(e)] = 1
            index += [r * length + p for p in e.readout_position]
            target += e.readout_target
        # Same gather trick as the packed path: the loss reads only real positions (labels -100 on
        # pad, expressed as "not gathered").
        steps.append(
            Step(
                {"input_ids": ids, "attention_mask": mask, "use_cache": False},
                torch.tensor(index),
                torch.tensor(target),
                sum(len(e) for e in chunk),
                ids.numel(),
            )
        )
    return steps


def packed_steps(examples, max_len: int, rows_per_batch: int, dense: bool):
    rows, stats = pack(examples, max_len, "greedy")
    steps = []
    for s in range(0, len(rows), rows_per_batch):
        batch = collate(rows[s : s + rows_per_batch], PAD_ID)
        if dense:
            inputs = {
                "input_ids": batch.input_ids,
                "position_ids": batch.position_ids,
                "attention_mask": batch.attention.dense_mask(),
                "use_cache": False,
            }
        else:
            inputs = batch.model_inputs()
        steps.append(
            Step(inputs, batch.readout_index, batch.readout_target, batch.num_real_tokens, batch.input_ids.numel())
        )
    return steps, stats


# ------------------------------------------------------------------------------------------------ timing


def train_step(model, step: Step, autocast) -> tuple[float, int]:
    model.zero_grad(set_to_none=True)
    with autocast():
        out = model(**step.inputs, output_hidden_states=True, logits_to_keep=1)
        hidden = out.hidden_states[-1]  # final-norm output, (B, L, H)
        flat = hidden.reshape(-1, hidden.shape[-1]).index_select(0, step.readout_index)
        logits = model.lm_head(flat).float()
        loss_sum = F.cross_entropy(logits, step.readout_target, reduction="sum")
    (loss_sum / step.readout_target.numel()).backward()
    return loss_sum.item(), step.readout_target.numel()


def split_chunks(steps: list[Step], k: int) -> list[list[Step]]:
    """Cut an epoch into ``k`` contiguous chunks of roughly equal computed tokens."""
    k = max(1, min(k, len(steps)))
    total = sum(s.computed_tokens for s in steps)
    chunks, acc = [[] for _ in range(k)], 0
    for s in steps:
        chunks[min(k - 1, int(acc * k / total))].append(s)
        acc += s.computed_tokens
    return [c for c in chunks if c]


def run_chunk(model, steps, autocast) -> tuple[float, float, int]:
    """Seconds for ``steps``, summed loss and readout count (the loss is a cross-method sanity check)."""
    total, count = 0.0, 0
    t0 = time.perf_counter()
    for step in steps:
        s, n = train_step(model, step, autocast)
        total += s
        count += n
    return time.perf_counter() - t0, total, count


class Probe:
    """One 2048^3 fp32 matmul (~0.1 s) timed just before each chunk: how contended the CPUs are right now."""

    def __init__(self, n: int = 2048):
        self.a, self.b, self.n = torch.randn(n, n), torch.randn(n, n), n

    def __call__(self) -> float:
        t0 = time.perf_counter()
        torch.mm(self.a, self.b)
        return 2 * self.n**3 / (time.perf_counter() - t0)


def attention_pairs(examples) -> int:
    """Useful (query, key) pairs of causal attention within each example."""
    return sum(len(e) * (len(e) + 1) // 2 for e in examples)


# -------------------------------------------------------------------------------------------------- main


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    methods = ["padded", "packed"] + ([] if args.no_dense else ["dense_mask"])
    labels = {
        "padded": f"padded batches of {args.batch_size}, sdpa + 2-D mask",
        "packed": f"packed to {args.max_len} (greedy), packed_sdpa block-wise",
        "dense_mask": f"packed to {args.max_len} (greedy), sdpa + dense 4-D bool mask",
    }

    t_start = time.perf_counter()
    load_before = os.getloadavg()[0]  # runnable processes before we start: other tenants of the CPUs
    peak_before = matmul_peak(torch.float32)
    peak_bf16 = matmul_peak(torch.bfloat16) if args.bf16 else None

    examples = make_examples(args.examples, args.min_len, args.max_example_len, args.vocab, args.seed)
    real_tokens = sum(len(e) for e in examples)
    cfg, models = build_models(args, methods)
    n_nonemb = non_embedding_params(models["padded"])
    n_total = sum(p.numel() for p in models["padded"].parameters())

    steps = {"padded": padded_steps(examples, args.batch_size)}
    steps["packed"], pstats = packed_steps(examples, args.max_len, args.rows_per_batch, dense=False)
    if "dense_mask" in methods:  # masks built here, outside the timing
        steps["dense_mask"], _ = packed_steps(examples, args.max_len, args.rows_per_batch, dense=True)
    for name in methods:
        assert sum(s.real_tokens for s in steps[name]) == real_tokens
    chunks = {name: split_chunks(steps[name], args.chunks) for name in methods}
    n_chunks = min(len(c) for c in chunks.values())
    chunks = {name: split_chunks(steps[name], n_chunks) for name in methods}

    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if args.bf16 else nullcontext
    print(
        f"# bench_packing  {datetime.datetime.now().isoformat(timespec='seconds')}  torch {torch.__version__}  "
        f"threads {torch.get_num_threads()}  dtype {'bf16 autocast' if args.bf16 else 'fp32'}"
        f"{'  (quick)' if args.quick else ''}",
        flush=True,
    )
    print(
        f"model: llama hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads "
        f"({cfg.num_key_value_heads} kv), intermediate {cfg.intermediate_size}, vocab {cfg.vocab_size}: "
        f"{n_nonemb / 1e6:.2f}M non-embedding params ({n_total / 1e6:.2f}M total)",
        flush=True,
    )
    print(
        f"data: {len(examples)} examples, lengths {args.min_len}-{args.max_example_len} (seed {args.seed}), "
        f"{real_tokens} real tokens; {pstats.summary('greedy', args.max_len)}; steps per epoch: "
        + ", ".join(f"{m} {len(steps[m])}" for m in methods)
        + f"; timed in {n_chunks} interleaved chunks per epoch",
        flush=True,
    )
    print(f"load average (1 min) before starting: {load_before:.2f} on {os.cpu_count()} CPUs", flush=True)
    print(
        f"fp32 matmul peak (2048^3, {args.threads} threads, median of 7): {peak_before / 1e9:.1f} GFLOP/s", flush=True
    )
    if peak_bf16:
        print(f"bf16 matmul peak: {peak_bf16 / 1e9:.1f} GFLOP/s", flush=True)

    # Warm-up, not timed: a few steps of each method plus its largest step (allocator, oneDNN
    # primitives, first-call overheads).
    for name in methods:
        largest = max(steps[name], key=lambda s: s.computed_tokens)
        for step in steps[name][: args.warmup_batches] + [largest]:
            train_step(models[name], step, autocast)

    # Timing: each repeat is one epoch of every method, cut into chunks and interleaved
    # (A1 B1 C1 A2 B2 C2 ..., the starting method rotating) so that load from other tenants of a
    # shared machine falls on all methods alike. A matmul probe before each chunk records the load.
    probe = Probe()
    chunk_sec = {m: [[0.0] * n_chunks for _ in range(args.repeats)] for m in methods}
    chunk_probe = {m: [] for m in methods}
    loss_sum = {m: 0.0 for m in methods}
    loss_count = {m: 0 for m in methods}
    for rep in range(args.repeats):
        for k in range(n_chunks):
            for name in rotated(methods, rep + k):
                chunk_probe[name].append(probe())
                sec, ls, lc = run_chunk(models[name], chunks[name][k], autocast)
                chunk_sec[name][rep][k] = sec
                if args.verbose:
                    print(
                        f"    rep {rep + 1} chunk {k + 1}/{n_chunks} {name:10s} {sec:6.1f} s "
                        f"(probe {chunk_probe[name][-1] / 1e9:.0f} GFLOP/s)",
                        flush=True,
                    )
                if rep == 0:
                    loss_sum[name] += ls
                    loss_count[name] += lc
        print(
            f"  repeat {rep + 1}/{args.repeats}: "
            + ", ".join(
                f"{m} {sum(chunk_sec[m][rep]):.1f} s ({real_tokens / sum(chunk_sec[m][rep]):,.0f} tok/s)"
                for m in methods
            )
            + f"; probe median {statistics.median([x for v in chunk_probe.values() for x in v]) / 1e9:.0f} GFLOP/s",
            flush=True,
        )
    peak_after = matmul_peak(torch.float32)
    peak = max(peak_before, peak_after)  # contention only ever lowers a measurement

    attn_flops = 12 * cfg.hidden_size * cfg.num_hidden_layers * attention_pairs(examples)
    readouts = sum(len(e.readout_position) for e in examples)
    head_flops = 6 * cfg.hidden_size * cfg.vocab_size * readouts
    model_flops = 6 * n_nonemb * real_tokens

    results = {}
    for name in methods:
        epochs = [sum(c) for c in chunk_sec[name]]
        sec = statistics.median(epochs)
        best = sum(min(chunk_sec[name][r][k] for r in range(args.repeats)) for k in range(n_chunks))
        probe_med = statistics.median(chunk_probe[name])
        computed = sum(s.computed_tokens for s in steps[name])
        results[name] = {
            "label": labels[name],
            "seconds_per_epoch": sec,
            "epoch_seconds_all": epochs,
            "best_chunks_seconds": best,
            "tokens_per_s": real_tokens / sec,
            "tokens_per_s_best_chunks": real_tokens / best,
            "pad_ratio": 1 - real_tokens / computed,
            "model_flops_per_s": model_flops / sec,
            "full_flops_per_s": (model_flops + attn_flops + head_flops) / sec,
            "probe_median_flops": probe_med,
            "loss": loss_sum[name] / loss_count[name],
        }
    base = results["padded"]
    for r in results.values():
        r["vs_padded"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["vs_padded_best_chunks"] = r["tokens_per_s_best_chunks"] / base["tokens_per_s_best_chunks"]
        r["mfu_fp32"] = r["model_flops_per_s"] / peak
        r["full_mfu_fp32"] = r["full_flops_per_s"] / peak
        r["mfu_vs_probe"] = r["model_flops_per_s"] / r["probe_median_flops"]
        if peak_bf16:
            r["mfu_bf16"] = r["model_flops_per_s"] / peak_bf16

    print()
    print(
        f"fp32 matmul peak: {peak_before / 1e9:.1f} GFLOP/s before, {peak_after / 1e9:.1f} after; using {peak / 1e9:.1f}"
    )
    spread = {
        m: "-".join(f"{x:.1f}" for x in (min(r["epoch_seconds_all"]), max(r["epoch_seconds_all"])))
        for m, r in results.items()
    }
    print(f"epoch seconds min-max over {args.repeats} repeats: {spread}")
    loss_gap = max(abs(results[m]["loss"] - results["padded"]["loss"]) for m in methods)
    print(
        f"mean loss per readout, same weights (must agree): "
        f"{ {m: round(r['loss'], 6) for m, r in results.items()} }, max gap {loss_gap:.1e}"
    )
    print()
    header = (
        "method | pad | real tokens/s | vs padded | s/epoch | model GFLOP/s (6N) | / fp32 peak | "
        "GFLOP/s incl. attn + lm_head | / fp32 peak | 6N / probe during run"
        + (" | model FLOP/s / bf16 peak" if peak_bf16 else "")
    )
    rows = [
        f"{r['label']} | {r['pad_ratio']:.0%} | {r['tokens_per_s']:,.0f} | {r['vs_padded']:.2f}x | "
        f"{r['seconds_per_epoch']:.1f} | {r['model_flops_per_s'] / 1e9:.1f} | {r['mfu_fp32']:.0%} | "
        f"{r['full_flops_per_s'] / 1e9:.1f} | {r['full_mfu_fp32']:.0%} | {r['mfu_vs_probe']:.0%}"
        + (f" | {r['mfu_bf16']:.0%}" if peak_bf16 else "")
        for r in results.values()
    ]
    table = markdown_table(header, rows)
    print(table)
    print()
    pk = results["packed"]
    print(
        f"packed / padded real tokens/s: {pk['vs_padded']:.2f}x median epochs"
        + (f", {pk['vs_padded_best_chunks']:.2f}x from the fastest repeat of each chunk" if args.repeats > 1 else "")
        + f" (goal >= 1.70x: {'met' if pk['vs_padded'] >= 1.7 else 'NOT met'})"
    )
    if "dense_mask" in results:
        dm = results["dense_mask"]
        print(
            f"dense_mask / padded: {dm['vs_padded']:.2f}x; packed / dense_mask: "
            f"{pk['tokens_per_s'] / dm['tokens_per_s']:.2f}x"
        )
    print(
        f"packed model FLOP/s (6N) / fp32 matmul peak: {pk['mfu_fp32']:.0%} "
        f"(goal >= 60%: {'met' if pk['mfu_fp32'] >= 0.6 else 'NOT met'}); "
        f"/ matmul probe during the run: {pk['mfu_vs_probe']:.0%}"
    )
    probe_all = statistics.median([x for v in chunk_probe.values() for x in v])
    if probe_all < 0.75 * peak or load_before > 0.5:
        print(
            f"WARNING: load average {load_before:.2f} before the run, matmul probe at {probe_all / peak:.0%} of the "
            f"peak during it: other processes were probably using these CPUs. With oversubscribed cores every "
            f"multi-threaded op waits for a descheduled thread, so step time follows the number of ops rather than the work; the numbers above are not "
            f"representative (try --threads 1, or an idle machine)."
        )
    print(f"total wall time {time.perf_counter() - t_start:.0f} s")

    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus",
        "torch": torch.__version__,
        "args": vars(args),
        "non_embedding_params": n_nonemb,
        "total_params": n_total,
        "real_tokens": real_tokens,
        "load_average_before": load_before,
        "fp32_peak_flops": peak,
        "fp32_peak_before_after": [peak_before, peak_after],
        "bf16_peak_flops": peak_bf16,
        "results": results,
    }
    report["environment"] = environment(
        "bench/bench_packing.py", sys.argv[1:] if argv is None else argv, args, libs=("torch", "transformers")
    )
    report["table_markdown"] = table
    write_report(args.json, report)
    return report


if __name__ == "__main__":
    main()
