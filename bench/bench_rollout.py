"""Rollout engines side by side: Hugging Face ``generate`` (generation.py) vs vLLM (vllm_rollout.py) on the same
weights, generation throughput at batch 16 and 64, and the weight-sync time per step (CPU).

Each (model, side) runs in its own subprocess: the engine starts once (its start is reported, not timed in the
throughput), then every batch size is generated ``--calls`` times (the first is a warm-up) and the medians
kept; the sides are interleaved and repeated (hf vllm, vllm hf, ...). Every response is exactly ``--new-tokens``
tokens (EOS ignored on both), sampled at temperature 1, prompts of ``--prompt-len`` random tokens.
Weight sync: HF = ``PolicyModel.load_weights`` of the actor's full state dict (the rollout copy's path),
vLLM = ``VLLMRollout.load_weights`` (``reload_weights`` in place + prefix-cache reset).

Models: ``tiny`` (Llama, hidden 256 x 4 layers, vocab 648: bench_ppo.py's) and ``qwen2`` (Qwen2-shaped,
hidden 128 x 2 layers, vocabulary 151,936: the LM head dominates).

Needs vLLM: run it in the environment ``bash scripts/setup.sh --vllm`` makes:

    .venv-vllm/bin/python bench/bench_rollout.py [--repeats 3] [--threads 2] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.harness import (
    add_worker_flags,
    environment,
    forward_flags,
    markdown_table,
    num,
    rss_mib,
    run_interleaved,
    run_worker,
    tokenizer,
    worker_env,
    worker_result,
    write_report,
)

SIDES = ("hf", "vllm")
MODELS = {
    "tiny": {"model_type": "llama", "vocab": 648, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4},
    "qwen2": {
        "model_type": "qwen2",
        "vocab": 151_936,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
    },
}
WORKER_SETTINGS = ("model", "batches", "prompt_len", "new_tokens", "calls", "threads", "seed")


def build_model(name: str, seed: int):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from llm.utils.attention import PACKED_SDPA
    from llm.utils.modeling import tiny_config

    spec = dict(MODELS[name])
    kind, vocab = spec.pop("model_type"), spec.pop("vocab")
    config = tiny_config(kind, vocab, pad_token_id=0, num_attention_heads=4, num_key_value_heads=4, **spec)
    transformers.set_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=PACKED_SDPA, dtype=torch.float32)


def run_side(a) -> dict:
    import torch

    from llm.alignment.ppo.roles import PolicyModel

    torch.set_num_threads(a.threads)
    tok = tokenizer()
    model = build_model(a.model, 0)
    batches = [int(b) for b in a.batches.split(",")]
    gen = torch.Generator().manual_seed(a.seed)
    t0 = time.perf_counter()
    if a.side == "vllm":
        from llm.alignment.ppo.vllm_rollout import VLLMRollout

        role = VLLMRollout(
            model,
            tok,
            1.0,
            max_model_len=a.prompt_len + a.new_tokens,
            seed=a.seed,
            sync_timeout=600,
            max_num_seqs=max(batches),
        )
        role.load_weights(model.state_dict())
    else:
        role = PolicyModel(model, tok, 1.0, max(batches))
    start = time.perf_counter() - t0
    out: dict = {"start_s": start}
    for b in batches:
        times = []
        for call in range(a.calls):
            prompts = torch.randint(7, 600, (b, a.prompt_len), generator=gen).tolist()
            t = time.perf_counter()
            responses = role.generate(
                prompts,
                num_samples=1,
                max_new_tokens=a.new_tokens,
                do_sample=True,
                top_p=1.0,
                top_k=0,
                ignore_eos=True,
                seed=a.seed * 1000 + call,
            )
            times.append(time.perf_counter() - t)
            assert all(len(r) == a.new_tokens for r in responses)
        median = statistics.median(times[1:] if len(times) > 1 else times)
        out[f"gen_s@{b}"] = median
        out[f"tokens_per_s@{b}"] = b * a.new_tokens / median
    other = build_model(a.model, 1).state_dict()
    syncs = []
    for _ in range(3):
        t = time.perf_counter()
        role.load_weights(other)
        syncs.append(time.perf_counter() - t)
    out["sync_s"] = statistics.median(syncs)
    out["peak_rss_mb"] = rss_mib()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,qwen2")
    p.add_argument("--model", default="tiny", help=argparse.SUPPRESS)  # a worker's model
    p.add_argument("--batches", default="16,64")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--calls", type=int, default=3, help="generate calls per batch size (the first is a warm-up)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out")
    add_worker_flags(p, sides=SIDES)
    a = p.parse_args()
    if a.side:
        worker_result(a.result, run_side(a))
        return
    if a.quick:
        a.models, a.batches, a.new_tokens, a.calls, a.repeats = "tiny", "16", 16, 2, 1
    env = worker_env(a.threads, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    groups = {m: SIDES for m in a.models.split(",")}
    with tempfile.TemporaryDirectory(prefix="bench_rollout_") as workdir:

        def run(model, side, rep):
            flags = forward_flags(a, *WORKER_SETTINGS, model=model, seed=a.seed + rep)
            return run_worker(__file__, side, workdir, flags, env=env)

        results = run_interleaved(groups, a.repeats, run, rotate=True)
    batches = [int(b) for b in a.batches.split(",")]
    rows, median = [], {}
    for model, sides in results.items():
        med = {s: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for s, runs in sides.items()}
        median[model] = med
        hf, vl = med["hf"], med["vllm"]
        for b in batches:
            k = f"tokens_per_s@{b}"
            rows.append(
                [model, f"generate, batch {b} (tokens/s)", num(hf[k], ".0f"), num(vl[k], ".0f"), f"{vl[k] / hf[k]:.2f}"]
            )
        rows.append(
            [
                model,
                "weight sync (s)",
                num(hf["sync_s"], ".3f"),
                num(vl["sync_s"], ".3f"),
                f"{vl['sync_s'] / hf['sync_s']:.2f}",
            ]
        )
        rows.append([model, "engine start (s)", num(hf["start_s"], ".2f"), num(vl["start_s"], ".1f"), ""])
        rows.append(
            [
                model,
                "peak RSS (MB)",
                num(hf["peak_rss_mb"], ".0f"),
                num(vl["peak_rss_mb"], ".0f"),
                f"{vl['peak_rss_mb'] / hf['peak_rss_mb']:.2f}",
            ]
        )
    print(
        f"Rollout engines, {a.prompt_len}-token prompts, exactly {a.new_tokens} new tokens, temperature 1, "
        f"{a.threads} threads, median of {a.repeats} runs x {a.calls - 1} calls"
    )
    table = markdown_table(["model", "measure", "HF generate", "vLLM", "vLLM / HF"], rows)
    print(table)
    write_report(
        a.out,
        {
            "args": vars(a),
            "runs": results,
            "median": median,
            "environment": environment(
                "bench/bench_rollout.py", sys.argv[1:], a, libs=("torch", "transformers", "vllm")
            ),
            "table_markdown": table,
        },
        indent=1,
    )


if __name__ == "__main__":
    main()
