"""GRPO at step 0: our rollout's completions vs TRL's current ``GRPOTrainer``'s on the same prompts and seed.

No training: one sampling call per side on a fixed batch, the completion length distribution and the fraction of
completions that stopped at EOS compared. Both sides run in this process on their own copy of the model:

- ``ours``: the PPO config a GRPO run of ``bench/bench_grpo.py`` / ``bench/bench_real_learning.py`` writes,
  parsed by ``parse_ppo_config``; its tokenizer and prompts as ``run_ppo.py`` loads them (``PPOContext``,
  ``load_prompts``), the actor loaded by the role loader, and step 0's rollout (``rollout.generate``: the
  sampling settings and the seed our trainer uses);
- ``trl``: a ``GRPOTrainer`` of TRL's current release (``.trl-current``, or ``TRL_CURRENT_PATH``) built on the
  same prompts and settings, and its own generation code: ``_tokenize_prompts`` (chat template or plain text)
  and ``_generate_single_turn`` (its ``GenerationConfig``, left padding, the cut after its first EOS id), on
  the prompts repeated ``--samples`` times as its sampler repeats them; torch's generator seeded with the seed
  our rollout uses.

Same prompt ids and same generate settings give token-for-token the same completions (the ``identical`` column);
a difference in the prompt text or in what is passed to ``generate`` shows in the lengths and the EOS fraction.

Cases (``--cases``):

- ``arith``: the arithmetic task of ``bench_real_learning.py`` (llm/data/sample_arith/arith_train.jsonl),
  chat template on both sides, temperature 0.7;
- ``plain``: the plain-text prompts of ``bench_grpo.py`` (llm/data/sample/prompts.jsonl), temperature 1, each
  side rendering the record as it does: ours "text\\n" (``llm.data.encoding.render_prompt``), TRL the string;
- ``plain-same``: as ``plain``, but TRL is given our text ("text\\n"): what is left when the text is equal.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python bench/bench_grpo_eos.py --threads 1 \\
        --out bench/results/bench_grpo_eos_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CASES = {
    "arith": {"data": "llm/data/sample_arith/arith_train.jsonl", "chat": True, "temperature": 0.7},
    "plain": {"data": "llm/data/sample/prompts.jsonl", "chat": False, "temperature": 1.0},
    "plain-same": {"data": "llm/data/sample/prompts.jsonl", "chat": False, "temperature": 1.0, "same_text": True},
}


def trl_path() -> str:
    path = os.environ.get("TRL_CURRENT_PATH") or os.path.join(ROOT, ".trl-current")
    if not os.path.isdir(os.path.join(path, "trl")):
        sys.exit(f"TRL's current release is not in {path} (bash scripts/setup.sh installs it; or TRL_CURRENT_PATH)")
    return path


def ours_config(model_dir: str, rows: list[dict], workdir: str, *, samples, new_tokens, temperature, chat, seed) -> str:
    """The GRPO config of the learning benchmark (its generation settings) on the prompt records ``rows``."""
    data = os.path.join(workdir, "prompts.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    batch = len(rows) * samples
    cfg = {
        "training": {"output_dir": os.path.join(workdir, "ours"), "seed": seed, "max_steps": 1, "report_to": "none"},
        "actor_rollout": {
            "model_name_or_path": model_dir,
            "do_sample": True,
            "temperature": temperature,
            "max_prompt_length": 256,
            "max_response_length": new_tokens,
            "num_samples_per_step": samples,
            "ppo_mini_batch_size": batch,
        },
        "ref": {},
        "critic": {},
        "reward": {"type": "rule", "rule": "llm.alignment.ppo.rewards.rule_functions:math_exact_match"},
        "algorithm": {"adv_estimator": "grpo", "kl_penalty": "k3", "kl_loss_coef": 0.04, "use_kl_in_reward": False},
        "data": {"train_dataset_path": data, "rollout_batch_size": len(rows), "use_chat_template": chat},
    }
    path = os.path.join(workdir, "grpo.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    return path


def run_ours(config_path: str) -> dict:
    """Step 0's rollout of our trainer: prompts, tokenizer, actor and sampling settings as a run builds them."""
    from transformers import AutoModelForCausalLM

    from llm.alignment.ppo import rollout
    from llm.alignment.ppo.build import PPOContext, load_prompts
    from llm.alignment.ppo.loading import Place, load
    from llm.alignment.ppo.roles import PolicyModel
    from llm.settings.load import parse_ppo_config

    c = parse_ppo_config([config_path])
    run = PPOContext.load(c)
    prompts = load_prompts(c, run)
    model = load(c, AutoModelForCausalLM, c.actor_rollout.model_name_or_path, False, run.tokenizer, Place(), True)
    policy = PolicyModel(model, run.tokenizer, c.actor_rollout.temperature, len(prompts))
    t = time.perf_counter()
    responses, _ = rollout.generate(policy, c, [p.ids for p in prompts], step=0, stop_ids=run.stop_ids)
    seconds = time.perf_counter() - t
    tok = run.tokenizer
    return {
        "prompt_ids": [p.ids for p in prompts],
        "completions": responses,
        "stop_ids": list(run.stop_ids),
        "seed": rollout.sampling(c, 0)["seed"],
        "texts": [tok.decode(r) for r in responses],
        "generate_s": seconds,
    }


def run_trl(model_dir: str, texts: list, *, samples, new_tokens, temperature, seed, generator_seed, workdir) -> dict:
    """TRL's own generation code on the prompts ``texts`` (strings, or conversations for its chat template):
    ``_tokenize_prompts`` and ``_generate_single_turn``, torch's generator seeded with ``generator_seed``.
    Needs TRL's current release first on ``sys.path`` (``trl_path()``)."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = len(texts) * samples
    args = GRPOConfig(
        output_dir=os.path.join(workdir, "trl"),
        use_cpu=True,
        seed=seed,
        report_to="none",
        per_device_train_batch_size=batch,
        num_generations=samples,
        max_completion_length=new_tokens,
        temperature=temperature,
        top_p=1.0,
        beta=0.0,  # no reference model: generation only
        use_vllm=False,
        gradient_checkpointing=False,
        max_steps=1,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        args=args,
        processing_class=tok,
        train_dataset=Dataset.from_dict({"prompt": texts}),
    )
    prompts = [p for p in texts for _ in range(samples)]  # RepeatSampler: each prompt num_generations times
    prompt_ids, images, fields = trainer._tokenize_prompts(prompts)
    torch.manual_seed(generator_seed)
    t = time.perf_counter()
    completions, _ = trainer._generate_single_turn(prompt_ids, images, fields, samples)
    seconds = time.perf_counter() - t
    kwargs = {k: v for k, v in trainer.generation_kwargs.items() if v is not None}
    return {
        "prompt_ids": [list(p) for p in prompt_ids[::samples]],
        "completions": [list(c) for c in completions],
        "stop_ids": list(trainer.eos_token_ids),
        "texts": [tok.decode(c) for c in completions],
        "generate_s": seconds,
        "generation_kwargs": kwargs,
        "trl_version": trl.__version__,
    }


def describe(side: dict, cap: int) -> dict:
    lengths = [len(c) for c in side["completions"]]
    stopped = [bool(c) and c[-1] in side["stop_ids"] for c in side["completions"]]
    return {
        "mean_length": statistics.mean(lengths),
        "median_length": statistics.median(lengths),
        "eos_fraction": sum(stopped) / len(stopped),
        "at_cap_fraction": sum(n >= cap and not s for n, s in zip(lengths, stopped)) / len(lengths),
        "lengths": lengths,
    }


def run_case(a, name: str) -> dict:
    from llm.data.encoding import plain_prompt_text

    case = CASES[name]
    with open(os.path.join(ROOT, case["data"]), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()][: a.prompts]
    srcs = [r["src"] for r in rows]
    if case["chat"]:
        texts = [[{"role": "user", "content": s}] for s in srcs]
    elif case.get("same_text"):
        texts = [plain_prompt_text([{"role": "user", "content": s}]) for s in srcs]
    else:
        texts = srcs
    settings = {"samples": a.samples, "new_tokens": a.new_tokens, "temperature": case["temperature"]}
    with tempfile.TemporaryDirectory(prefix="bench_grpo_eos_") as workdir:
        ours = run_ours(ours_config(a.model_dir, rows, workdir, chat=case["chat"], seed=a.seed, **settings))
        trl = run_trl(a.model_dir, texts, seed=a.seed, generator_seed=ours["seed"], workdir=workdir, **settings)
    same_prompts = ours["prompt_ids"] == trl["prompt_ids"]
    identical = sum(x == y for x, y in zip(ours["completions"], trl["completions"])) / len(ours["completions"])
    out = {
        "settings": {**case, "prompts": a.prompts, "samples": a.samples, "max_new_tokens": a.new_tokens},
        "same_prompt_ids": same_prompts,
        "first_prompt_ids": {"ours": ours["prompt_ids"][0], "trl": trl["prompt_ids"][0]},
        "identical_completions": identical,
        "stop_ids": {"ours": ours["stop_ids"], "trl": trl["stop_ids"]},
        "trl_generation_kwargs": trl["generation_kwargs"],
        "trl_version": trl["trl_version"],
        "seed": ours["seed"],
        "ours": {**describe(ours, a.new_tokens), "generate_s": ours["generate_s"], "examples": ours["texts"][:4]},
        "trl": {**describe(trl, a.new_tokens), "generate_s": trl["generate_s"], "examples": trl["texts"][:4]},
    }
    o, t = out["ours"], out["trl"]
    print(
        f"{name}: same prompt ids {same_prompts}, identical completions {identical:.0%}; "
        f"mean length ours {o['mean_length']:.1f} / TRL {t['mean_length']:.1f}, "
        f"EOS ours {o['eos_fraction']:.0%} / TRL {t['eos_fraction']:.0%}",
        flush=True,
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ",".join(CASES))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=4, help="completions per prompt (GRPO group)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model-dir", help="a Hugging Face causal-LM directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out")
    p.add_argument(
        "--trl-worker",
        nargs=2,
        metavar=("SPEC", "RESULT"),
        help="only TRL's side: a list of run_trl's keyword arguments from the JSON file SPEC, their results into "
        "RESULT (tests)",
    )
    a = p.parse_args()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    sys.path.insert(0, trl_path())  # TRL's current release before any other TRL
    import torch

    torch.set_num_threads(a.threads)
    if a.trl_worker:
        with open(a.trl_worker[0], encoding="utf-8") as f:
            result = [run_trl(**spec) for spec in json.load(f)]
        with open(a.trl_worker[1], "w", encoding="utf-8") as f:
            json.dump(result, f)
        return
    if not a.model_dir:
        from llm.utils.gguf import smollm2_dir

        a.model_dir = smollm2_dir()
    names = [n.strip() for n in a.cases.split(",") if n.strip()]
    if not names or any(n not in CASES for n in names):
        p.error(f"--cases: a subset of {','.join(CASES)}")
    started = time.time()
    report = {"args": vars(a), "cases": {n: run_case(a, n) for n in names}}
    import transformers

    report["environment"] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": a.threads,
        "command": "python bench/bench_grpo_eos.py " + " ".join(sys.argv[1:]),
        "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)),
        "wall_s": time.time() - started,
        "load_average": os.getloadavg(),
    }
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
