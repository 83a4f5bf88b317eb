"""Learning on the real model (SmolLM2-135M-Instruct, fp32, CPU): a held-out evaluation before and after training.

Not a test: a benchmark that shows each trainer moves a real 135M model in the right direction within minutes on
a CPU, and writes a JSON report and a PNG of the curves (for the README). Tasks (``--tasks``, comma-separated):

- ``sft``: run_finetune.py on llm/data/sample_sft/sft_train.jsonl; the trainer's own eval_loss (answer tokens,
  chat template) on sft_dev.jsonl before (a ``do_train false`` run of the same config) and after.
- ``prm``: run_reward.py, process reward (placeholder ``§``) on llm/data/sample/prm_train.jsonl; step accuracy on
  prm_dev.jsonl and ProcessBench F1 on processbench_dev.jsonl, before (the untrained ``+``/``-`` readout) and after;
  the goal is the 2-layer tiny demo's 0.8405 step accuracy / 0.648 F1.
- ``orm``: run_reward.py, outcome reward (a new score head) on pairs_train.jsonl; pair accuracy on pairs_dev.jsonl.
- ``dpo``: run_dpo.py on pairs_train.jsonl; reward accuracy (the share of pairs_dev pairs whose implicit reward
  prefers the chosen answer) before and after.
- ``grpo``: GRPO with the rule reward ``math_exact_match`` on llm/data/sample_arith/arith_train.jsonl, ours
  (llm/alignment/ppo, ``adv_estimator: grpo``) and TRL's current ``GRPOTrainer`` (in its own environment,
  ``--trl-python``), the same model, prompts, reward, group size, lengths, learning rate and wall budget
  (``--minutes``), both at once, one thread each. Each side saves its policy every ``--minutes / --evals``
  minutes of training; afterwards ONE evaluator (``arith_accuracy``: the checkpoint in Hugging Face generate, chat
  template, greedy, ``--eval-new-tokens`` tokens, math_exact_match against tgt) scores every checkpoint of both
  sides on llm/data/sample_arith/arith_dev.jsonl, so the curves are accuracy against training wall time.

TRL's current GRPOTrainer needs a newer TRL than the project's pin; make its environment once::

    python3 -m venv /tmp/grpo && /tmp/grpo/bin/pip install torch==2.13.0
    /tmp/grpo/bin/pip install -r requirements.txt trl psutil

Usage (from the repository root; ``--quick`` is a smoke run of a minute or two per task; ``--tasks ""`` only
redraws the PNG from the report)::

    python bench/bench_real_learning.py [--tasks sft,prm,orm,dpo,grpo] [--quick] [--minutes 35]
        [--trl-python /tmp/grpo/bin/python] [--out bench/results/real_learning.json]

The JSON report is merged task by task (a run of ``--tasks sft`` keeps the other tasks' earlier results); the PNG
(``--png``, default next to the JSON) is drawn from the whole report.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TASKS = ("sft", "prm", "orm", "dpo", "grpo")
RULE = "llm.alignment.ppo.rewards.rule_functions:math_exact_match"
ARITH_TRAIN = "llm/data/sample_arith/arith_train.jsonl"
ARITH_DEV = "llm/data/sample_arith/arith_dev.jsonl"
CONFIGS = "llm/config/smollm2"
TRL_CURRENT = os.path.join(ROOT, ".trl-current")  # TRL's current release (scripts/setup.sh)
TINY_DEMO = {"prm_step_accuracy": 0.8405, "processbench_f1": 0.648}


def model_dir() -> str:
    from llm.utils.gguf import smollm2_dir

    return smollm2_dir()


def read_jsonl(path: str) -> list[dict]:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def env(threads: int) -> dict:
    e = dict(os.environ)
    e.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        TRL_EXPERIMENTAL_SILENCE="1",
        PYTHONPATH=ROOT,
    )
    return e


# --------------------------------------------------------------------------------------------------------------
# The one evaluator of held-out arithmetic accuracy (both GRPO sides, every checkpoint, the base model).
# --------------------------------------------------------------------------------------------------------------
def load_policy(path: str):
    """A saved policy: a full model directory, or a PEFT adapter directory (merged into its base)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        from peft import PeftModel

        with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as f:
            base = json.load(f)["base_model_name_or_path"]
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        model = PeftModel.from_pretrained(model, path).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok_dir = path if os.path.isfile(os.path.join(path, "tokenizer_config.json")) else model_dir()
    return model.eval(), AutoTokenizer.from_pretrained(tok_dir)


def arith_accuracy(path: str, rows: list[dict], new_tokens: int, batch: int = 32) -> dict:
    """Greedy answers of the policy at ``path`` to ``rows`` (chat template, generation prompt), scored with
    math_exact_match against ``tgt``: {"accuracy", "n", "seconds", "samples" (the first 8 answers)}."""
    import torch

    from llm.alignment.ppo.rewards.rule_functions import math_exact_match

    t = time.perf_counter()
    model, tok = load_policy(path)
    tok.padding_side = "left"
    correct, answers = 0.0, []
    for i in range(0, len(rows), batch):
        part = rows[i : i + batch]
        texts = [
            tok.apply_chat_template([{"role": "user", "content": r["src"]}], tokenize=False, add_generation_prompt=True)
            for r in part
        ]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(
                **enc,
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
                top_p=None,
                top_k=None,
                temperature=None,
            )
        for r, seq in zip(part, out[:, enc["input_ids"].shape[1] :]):
            text = tok.decode(seq, skip_special_tokens=True)
            correct += math_exact_match(r["src"], text, r["tgt"])
            answers.append(text)
    return {"accuracy": correct / len(rows), "n": len(rows), "seconds": time.perf_counter() - t, "samples": answers[:8]}


def eval_worker(a) -> None:
    """``--eval-list FILE``: score every checkpoint listed there (JSON list of {"path", ...}), deleting each
    checkpoint's weights afterwards unless --keep-checkpoints; results to --result."""
    import torch

    torch.set_num_threads(a.threads)
    with open(a.eval_list, encoding="utf-8") as f:
        points = json.load(f)
    rows = read_jsonl(ARITH_DEV)[: a.eval_prompts]
    out = []
    for p in points:
        r = arith_accuracy(p["path"], rows, a.eval_new_tokens)
        out.append({**p, **r})
        print(
            f"[eval] {p.get('side')} step {p.get('step')} wall {p.get('wall_s', 0):.0f}s: "
            f"accuracy {r['accuracy']:.3f} ({r['seconds']:.0f}s) {r['samples'][:3]}",
            flush=True,
        )
        if not a.keep_checkpoints and p.get("step", 0) > 0 and p["path"].startswith(a.workdir):
            shutil.rmtree(p["path"], ignore_errors=True)
        with open(a.result, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)


# --------------------------------------------------------------------------------------------------------------
# GRPO sides (each a subprocess; the TRL one in TRL's environment).
# --------------------------------------------------------------------------------------------------------------
def grpo_settings(a) -> dict:
    return {
        "prompts_per_step": a.prompts,
        "group": a.group,
        "completions_per_step": a.prompts * a.group,
        "max_new_tokens": a.new_tokens,
        "temperature": a.temperature,
        "learning_rate": a.lr,
        "lr_schedule": "constant, no warmup",
        "beta_kl_k3": a.beta,
        "clip_epsilon": 0.2,
        "max_grad_norm": 1.0,
        "optimizer": "AdamW (0.9, 0.999), weight decay 0",
        "loss": "token mean over the step's completions (ours; TRL loss_type dapo), advantages (r - mean_g) / std_g",
        "updates_per_generation": 1,
        "micro_batch": f"{a.micro_batch} completions per forward/backward (gradient accumulation to one step)",
        "lora": f"r {a.lora_rank}, alpha {2 * a.lora_rank}, all linear projections"
        if a.lora
        else "no (full fine-tuning)",
        "minutes_per_side": a.minutes,
        "threads_per_side": a.threads,
        "eval": f"greedy, chat template, {a.eval_new_tokens} new tokens, first {a.eval_prompts} of {ARITH_DEV}",
        "seed": a.seed,
        "precision": "bf16: ours training.bf16 (bf16 weights, fp32 AdamW masters), TRL bf16=True (autocast)"
        if a.precision == "bf16"
        else "fp32 on both sides (TRL bf16=False; its configs' default on a CPU is bf16 autocast)",
    }


class Budget:
    """Training wall time (checkpoint saving excluded) and when to save the next checkpoint."""

    def __init__(self, minutes: float, evals: int, max_steps: int) -> None:
        self.total = minutes * 60
        self.every = self.total / max(evals, 1)
        self.max_steps = max_steps
        self.train_s = 0.0
        self.next_save = self.every
        self.points: list[dict] = []

    def add(self, seconds: float) -> None:
        self.train_s += seconds

    def done(self, step: int) -> bool:
        return self.train_s >= self.total or step >= self.max_steps

    def due(self, step: int) -> bool:
        if self.done(step) or self.train_s >= self.next_save:
            while self.next_save <= self.train_s:
                self.next_save += self.every
            return True
        return False


def ours_grpo_config(a) -> dict:
    """Our GRPO side's PPO config (a dict, as a JSON argument file holds it); ``bench_prime.py`` builds on it."""
    batch = a.prompts * a.group
    return {
        "training": {
            "output_dir": os.path.join(a.workdir, "ours_run"),
            "seed": a.seed,
            "learning_rate": a.lr,
            "max_grad_norm": 1.0,
            "max_steps": 100000,
            "bf16": a.precision == "bf16",
            "micro_batch_size": a.micro_batch,
            "report_to": "none",
            "disable_tqdm": True,
        },
        "actor_rollout": {
            "model_name_or_path": a.model_dir,
            "do_sample": True,
            "temperature": a.temperature,
            "top_p": 1.0,
            "top_k": 0,
            "max_prompt_length": 128,
            "max_response_length": a.new_tokens,
            "num_samples_per_step": a.group,
            "ppo_mini_batch_size": batch,
            "ppo_epochs": 1,
            "clip_ratio": 0.2,
            "shuffle_minibatch": False,
            **({"lora": True, "lora_rank": a.lora_rank, "target_modules": "all-linear"} if a.lora else {}),
        },
        "ref": {},
        "critic": {},
        "reward": {"type": "rule", "rule": RULE},
        "algorithm": {
            "adv_estimator": "grpo",
            "kl_penalty": "k3",
            "kl_loss_coef": a.beta,
            "use_kl_in_reward": False,
            "kl_ctrl": {"type": "fixed", "kl_coef": 0.0},
        },
        "data": {
            "train_dataset_path": os.path.join(ROOT, ARITH_TRAIN),
            "rollout_batch_size": a.prompts,
            "use_chat_template": True,
        },
    }


def run_grpo_ours(a) -> dict:
    return train_on_budget(a, ours_grpo_config(a), "ours")


def train_on_budget(a, cfg: dict, side: str, keys: tuple[str, ...] = ()) -> dict:
    """Steps of our PPO trainer on ``cfg`` (written to ``a.workdir/{side}_grpo.json``) for ``a.minutes`` of
    training wall time (``Budget``), the policy saved to ``a.workdir/{side}_step{N}`` when a checkpoint is due;
    ``keys``: more of the step's metrics to log (e.g. ``prime/accuracy``). Returns {"log", "points"}."""
    import torch

    from llm.alignment.ppo.build import ppo_trainer
    from llm.settings.load import parse_ppo_config

    torch.set_num_threads(a.threads)
    path = os.path.join(a.workdir, f"{side}_grpo.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=1)
    c = parse_ppo_config([path])
    budget = Budget(a.minutes, a.evals, a.max_steps)
    log = []
    with ppo_trainer(c) as trainer:
        step = 0
        while not budget.done(step):
            t = time.perf_counter()
            m = trainer.train_step()
            budget.add(time.perf_counter() - t)
            step += 1
            log.append(
                {
                    "step": step,
                    "wall_s": budget.train_s,
                    "reward": m["score"],
                    "kl": m["kl"],
                    "response_length": m["response_length"],
                    "step_s": m["time/step"],
                    **{k: m[k] for k in keys if k in m},
                }
            )
            more = "".join(f" {k} {m[k]:.4f}" for k in keys if k in m)
            print(
                f"[{side}] step {step} wall {budget.train_s:.0f}s reward {m['score']:.3f} kl {m['kl']:.4f} "
                f"len {m['response_length']:.1f} step {m['time/step']:.1f}s{more}",
                flush=True,
            )
            if budget.due(step):
                d = os.path.join(a.workdir, f"{side}_step{step}")
                trainer.actor.save(d, False)
                budget.points.append({"side": side, "step": step, "wall_s": budget.train_s, "path": d})
                write_progress(a, log, budget.points)
    return {"log": log, "points": budget.points}


def run_grpo_trl(a) -> dict:
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from llm.alignment.ppo.rewards.rule_functions import math_exact_match

    torch.set_num_threads(a.threads)
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32)
    batch = a.prompts * a.group
    rows = read_jsonl(ARITH_TRAIN)
    # Ours draws a seeded permutation per pass; TRL shuffles with its own sampler: the same prompts, another order.
    data = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": r["src"]}] for r in rows], "tgt": [r["tgt"] for r in rows]}
    )

    def exact_match(prompts, completions, tgt, **kwargs):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [math_exact_match("", t, ref) for t, ref in zip(texts, tgt)]

    budget = Budget(a.minutes, a.evals, a.max_steps)
    log: list[dict] = []
    state = {"t": 0.0}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, st, control, **kwargs):
            state["t"] = time.perf_counter()

        def on_step_end(self, args, st, control, model=None, **kwargs):
            budget.add(time.perf_counter() - state["t"])
            step = st.global_step
            log.append({"step": step, "wall_s": budget.train_s})
            if budget.due(step):
                d = os.path.join(a.workdir, f"trl_step{step}")
                m = model
                if a.lora:
                    m.save_pretrained(d)
                else:
                    m.save_pretrained(d)
                tok.save_pretrained(d)
                budget.points.append({"side": "trl", "step": step, "wall_s": budget.train_s, "path": d})
                write_progress(a, log, budget.points)
            if budget.done(step):
                control.should_training_stop = True
            return control

        def on_log(self, args, st, control, logs=None, **kwargs):  # after on_step_end: fill in the step's numbers
            if logs and "reward" in logs and log:
                last = log[-1]
                last.update(
                    reward=logs.get("reward"),
                    kl=logs.get("kl"),
                    response_length=logs.get("completions/mean_length"),
                    step_s=logs.get("step_time"),
                )
                print(
                    f"[trl] step {last['step']} wall {last['wall_s']:.0f}s reward {last['reward']:.3f} "
                    f"kl {last['kl']} len {last['response_length']} step {last['step_s']}",
                    flush=True,
                )

    peft_config = None
    if a.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=a.lora_rank,
            lora_alpha=2 * a.lora_rank,
            target_modules="all-linear",
            lora_dropout=0.0,
            task_type="CAUSAL_LM",
        )
    kwargs = dict(  # noqa: C408 (GRPOConfig's keyword arguments)
        output_dir=os.path.join(a.workdir, "trl_run"),
        use_cpu=True,
        seed=a.seed,
        report_to="none",
        per_device_train_batch_size=a.micro_batch,  # TRL counts completions: one step = accumulation x this
        num_generations=a.group,
        gradient_accumulation_steps=batch // a.micro_batch,
        generation_batch_size=batch,
        max_completion_length=a.new_tokens,
        temperature=a.temperature,
        top_p=1.0,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        optim="adamw_torch",
        max_grad_norm=1.0,
        beta=a.beta,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        gradient_checkpointing=False,  # TRL's default is True; ours does not checkpoint
        bf16=a.precision == "bf16",  # TRL's default (None) means True, on a CPU too: say it
        max_steps=100000,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        use_vllm=False,
        dataloader_num_workers=0,
    )
    import inspect

    accepted = set(inspect.signature(GRPOConfig.__init__).parameters)
    dropped = sorted(k for k in kwargs if k not in accepted)
    args = GRPOConfig(**{k: v for k, v in kwargs.items() if k in accepted})
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[exact_match],
        args=args,
        processing_class=tok,
        train_dataset=data,
        callbacks=[Clock()],
        peft_config=peft_config,
    )
    trainer.train()
    return {"log": log, "points": budget.points, "trl_version": trl.__version__, "dropped_config_keys": dropped}


def write_progress(a, log, points) -> None:
    with open(a.result + ".progress", "w", encoding="utf-8") as f:
        json.dump({"log": log, "points": points}, f, indent=1)


def side_main(a) -> None:
    import transformers

    t = time.perf_counter()
    out = run_grpo_ours(a) if a.side == "grpo-ours" else run_grpo_trl(a)
    import resource

    out.update(
        total_s=time.perf_counter() - t,
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        python=sys.executable,
        transformers=transformers.__version__,
    )
    with open(a.result, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)


def worker_cmd(python: str, a, side: str, result: str, extra: list[str] | None = None) -> list[str]:
    flags = [
        "--side",
        side,
        "--workdir",
        a.workdir,
        "--result",
        result,
        "--model-dir",
        a.model_dir,
        "--threads",
        str(a.threads),
        "--minutes",
        str(a.minutes),
        "--evals",
        str(a.evals),
        "--max-steps",
        str(a.max_steps),
        "--prompts",
        str(a.prompts),
        "--group",
        str(a.group),
        "--new-tokens",
        str(a.new_tokens),
        "--micro-batch",
        str(a.micro_batch),
        "--temperature",
        str(a.temperature),
        "--lr",
        str(a.lr),
        "--beta",
        str(a.beta),
        "--seed",
        str(a.seed),
        "--lora-rank",
        str(a.lora_rank),
        "--eval-new-tokens",
        str(a.eval_new_tokens),
        "--eval-prompts",
        str(a.eval_prompts),
        "--precision",
        a.precision,
    ]
    if a.lora:
        flags.append("--lora")
    if a.keep_checkpoints:
        flags.append("--keep-checkpoints")
    return [python, os.path.abspath(__file__), *flags, *(extra or [])]


def task_grpo(a) -> dict:
    os.makedirs(a.workdir, exist_ok=True)
    sides = [s for s in a.grpo_sides.split(",") if s]
    python = {"ours": sys.executable, "trl": a.trl_python or sys.executable}
    procs = {}
    logs = {}
    for s in sides:
        logs[s] = open(os.path.join(a.workdir, f"grpo_{s}.log"), "w", encoding="utf-8")  # noqa: SIM115 (closed below)
        cmd = worker_cmd(python[s], a, f"grpo-{s}", os.path.join(a.workdir, f"grpo_{s}.json"))
        print("$", " ".join(cmd), flush=True)
        e = env(a.threads)
        if s == "trl" and not a.trl_python:
            e["PYTHONPATH"] = os.pathsep.join((TRL_CURRENT, ROOT))
        procs[s] = subprocess.Popen(cmd, stdout=logs[s], stderr=subprocess.STDOUT, env=e, cwd=ROOT)
    results = {}
    for s, p in procs.items():
        rc = p.wait()
        logs[s].close()
        path = os.path.join(a.workdir, f"grpo_{s}.json")
        if rc == 0 and os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                results[s] = json.load(f)
        else:
            tail = read_text(os.path.join(a.workdir, f"grpo_{s}.log"))[-3000:]
            print(f"GRPO side {s} failed (rc {rc}):\n{tail}", flush=True)
            progress = path + ".progress"
            results[s] = {"error": tail[-600:], "rc": rc}
            if os.path.isfile(progress):
                with open(progress, encoding="utf-8") as f:
                    results[s].update(json.load(f))
    # One evaluator for everything: the base model, then each side's checkpoints (a process per side, in parallel).
    base = [{"side": "base", "step": 0, "wall_s": 0.0, "path": a.model_dir}]
    lists = {"base": base, **{s: results[s].get("points", []) for s in sides}}
    eprocs = {}
    for name, points in lists.items():
        if not points:
            continue
        lst = os.path.join(a.workdir, f"eval_{name}.list.json")
        with open(lst, "w", encoding="utf-8") as f:
            json.dump(points, f)
        cmd = worker_cmd(sys.executable, a, "eval", os.path.join(a.workdir, f"eval_{name}.json"), ["--eval-list", lst])
        eprocs[name] = subprocess.Popen(cmd, env=env(a.threads), cwd=ROOT)
        if len(eprocs) >= a.eval_parallel:
            next(iter(eprocs.values())).wait()
    evals = {}
    for name, p in eprocs.items():
        p.wait()
        path = os.path.join(a.workdir, f"eval_{name}.json")
        evals[name] = json.loads(read_text(path)) if os.path.isfile(path) else []
    base_acc = evals.get("base", [{}])[0].get("accuracy")
    out = {
        "settings": grpo_settings(a),
        "base_accuracy": base_acc,
        "base_samples": evals.get("base", [{}])[0].get("samples"),
    }
    for s in sides:
        curve = [{"step": 0, "wall_s": 0.0, "accuracy": base_acc}] + [
            {k: e[k] for k in ("step", "wall_s", "accuracy", "samples")} for e in evals.get(s, [])
        ]
        r = results[s]
        final = curve[-1]["accuracy"] if len(curve) > 1 else None
        out[s] = {
            "curve": curve,
            "final_accuracy": final,
            "best_accuracy": max((c["accuracy"] for c in curve[1:]), default=None),
            "gain_points": None if final is None or base_acc is None else 100 * (final - base_acc),
            "steps": r["log"][-1]["step"] if r.get("log") else 0,
            "train_wall_s": r["log"][-1]["wall_s"] if r.get("log") else 0,
            "train_log": r.get("log", []),
            **{
                k: r[k]
                for k in ("trl_version", "dropped_config_keys", "peak_rss_mib", "total_s", "transformers", "error")
                if k in r
            },
        }
    if "ours" in out and out["ours"]["gain_points"] is not None:
        out["goal_+15_points_met"] = out["ours"]["gain_points"] >= 15
    return out


# --------------------------------------------------------------------------------------------------------------
# SFT / ORM / PRM / DPO: the project's entry points in subprocesses, evaluated by their trainers before and after.
# --------------------------------------------------------------------------------------------------------------
def run_entry(a, script: str, config: str, out_dir: str, flags: dict) -> tuple[dict, float]:
    cmd = [sys.executable, os.path.join(ROOT, "llm", script), os.path.join(ROOT, CONFIGS, config)]
    for k, v in {**flags, "output_dir": out_dir, "overwrite_output_dir": "true"}.items():
        cmd += [f"--{k}", str(v)]
    print("$", " ".join(cmd), flush=True)
    t = time.perf_counter()
    with open(out_dir + ".log", "w", encoding="utf-8") as log:
        rc = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env(a.threads), cwd=ROOT, check=False
        ).returncode
    seconds = time.perf_counter() - t
    if rc != 0:
        raise RuntimeError(f"{script} failed (rc {rc}); see {out_dir}.log")
    with open(os.path.join(out_dir, "eval_results.json"), encoding="utf-8") as f:
        return json.load(f), seconds


def remove_weights(directory: str) -> None:
    for name in os.listdir(directory):
        if name.endswith(".safetensors") or name.startswith("checkpoint-"):
            p = os.path.join(directory, name)
            shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)


def before_after(
    a, task: str, script: str, config: str, train_flags: dict, keys: dict, keep_model=False, before: dict | None = None
) -> dict:
    """A ``do_train false`` run (its eval is the "before"; ``before`` given: that instead, no run), then the
    training run with its own evaluation at the end (the "after")."""
    base = os.path.join(a.workdir, task)
    os.makedirs(os.path.dirname(base), exist_ok=True)
    common = {
        "save_strategy": "no",
        "report_to": "none",
        "seed": a.seed,
        "bf16": "true" if a.precision == "bf16" else "false",  # training and evaluation alike
        **train_flags.pop("common", {}),
    }
    if a.eval_samples:
        common.setdefault("max_eval_samples", a.eval_samples)
    before_s = 0.0
    if before is None:
        before, before_s = run_entry(a, script, config, base + "_before", {**common, "do_train": "false"})
    after, after_s = run_entry(a, script, config, base + "_after", {**common, **train_flags})
    all_path = os.path.join(base + "_after", "all_results.json")
    train_s = json.loads(read_text(all_path)).get("train_runtime") if os.path.isfile(all_path) else None
    if not a.keep_checkpoints and not keep_model:
        remove_weights(base + "_after")
    out = {
        "settings": {**common, **train_flags, "config": f"{CONFIGS}/{config}", "threads": a.threads},
        "before": {k: before.get(v) for k, v in keys.items()},
        "after": {k: after.get(v) for k, v in keys.items()},
        "eval_s_before": before_s,
        "train_and_eval_s": after_s,
        "train_runtime_s": train_s,
        "all_after": after,
        "all_before": before,
    }
    log_path = os.path.join(base + "_after", "trainer_state.json")
    if os.path.isfile(log_path):
        with open(log_path, encoding="utf-8") as f:
            out["log_history"] = json.load(f).get("log_history", [])
    return out


def task_sft(a) -> dict:
    steps = 4 if a.quick else a.sft_steps
    r = before_after(
        a,
        "sft",
        "run_finetune.py",
        "sft_argument.json",
        {
            "max_steps": steps,
            "learning_rate": a.sft_lr,
            "logging_steps": 5,
            "common": {"per_device_eval_batch_size": 8},
        },
        {"eval_loss": "eval_loss"},
    )
    r["goal"] = "held-out answer-token eval_loss below the pretrained model's"
    r["goal_met"] = r["after"]["eval_loss"] < r["before"]["eval_loss"]
    return r


def task_orm(a) -> dict:
    steps = 4 if a.quick else a.orm_steps
    r = before_after(
        a,
        "orm",
        "run_reward.py",
        "rm_argument.json",
        {
            "max_steps": steps,
            "learning_rate": a.orm_lr,
            **({"head_learning_rate": a.orm_head_lr} if a.orm_head_lr is not None else {}),
            "logging_steps": 5,
            "common": {"max_seq_len": a.seq_len, "max_prompt_len": 256},
        },
        {"accuracy": "eval_accuracy", "margin": "eval_margin"},
    )
    r["goal"] = "pairs_dev accuracy > 0.75"
    r["goal_met"] = (r["after"]["accuracy"] or 0) > 0.75
    return r


def task_dpo(a) -> dict:
    steps = 4 if a.quick else a.dpo_steps
    r = before_after(
        a,
        "dpo",
        "run_dpo.py",
        "dpo_argument.json",
        {
            "max_steps": steps,
            "learning_rate": a.dpo_lr,
            "logging_steps": 5,
            # the config precomputes the reference's log-probs of all 800 train pairs first (minutes
            # on a CPU for the few steps run here): the reference runs on each batch instead
            "common": {"max_seq_len": a.seq_len, "max_prompt_len": 256, "precompute_ref_log_probs": "false"},
        },
        {"reward_accuracy": "eval_rewards/accuracies", "margin": "eval_rewards/margins", "eval_loss": "eval_loss"},
        # policy == reference before training: every implicit reward is 0, no pair is preferred
        before=None
        if a.dpo_eval_before
        else {"eval_rewards/accuracies": 0.0, "eval_rewards/margins": 0.0, "eval_loss": math.log(2)},
    )
    r["before_note"] = (
        "measured (do_train false run)"
        if a.dpo_eval_before
        else "not run: at step 0 the policy is the reference, so every implicit reward is 0 (accuracy 0, "
        "margin 0, loss log 2)"
    )
    r["goal"] = "pairs_dev reward accuracy > 0.75"
    r["goal_met"] = (r["after"]["reward_accuracy"] or 0) > 0.75
    return r


def task_prm(a) -> dict:
    """Step accuracy on prm_dev (the training run's own evaluation) and ProcessBench F1 on processbench_dev
    (a do_train false run of the trained model), each also before training (the untrained +/- readout)."""
    steps = 4 if a.quick else a.prm_steps
    pb = "llm/data/sample/processbench_dev.jsonl"
    limit = {"max_eval_samples": a.eval_samples} if a.eval_samples else {}
    r = before_after(
        a,
        "prm",
        "run_reward.py",
        "prm_argument.json",
        {
            "max_steps": steps,
            "learning_rate": a.prm_lr,
            "logging_steps": 5,
            "common": {**limit, "max_seq_len": a.seq_len, "max_prompt_len": 256},
        },
        {
            "step_accuracy": "eval_step_accuracy",
            "solution_accuracy": "eval_solution_accuracy",
            "majority_baseline": "eval_majority_baseline",
        },
        keep_model=True,
    )
    base = os.path.join(a.workdir, "prm")
    common = {
        "save_strategy": "no",
        "report_to": "none",
        "seed": a.seed,
        "do_train": "false",
        "dev_dataset_path": pb,
        "max_seq_len": a.seq_len,
        "max_prompt_len": 256,
        "max_eval_samples": 24 if a.quick else 120,
    }  # all 120 solutions, as the tiny demo's F1
    before, s_before = run_entry(a, "run_reward.py", "prm_argument.json", base + "_pb_before", common)
    trained = base + "_after"
    after, s_after = run_entry(
        a,
        "run_reward.py",
        "prm_argument.json",
        base + "_pb_after",
        {**common, "model_name_or_path": trained, "tokenizer_name_or_path": trained},
    )
    keys = ("processbench_f1", "processbench_acc_error", "processbench_acc_correct")
    r["before"].update({k: before.get("eval_" + k) for k in keys})
    r["after"].update({k: after.get("eval_" + k) for k in keys})
    r["processbench_eval_s"] = s_before + s_after
    if not a.keep_checkpoints:
        remove_weights(trained)
    r["goal"] = (
        f"beat the tiny demo: step accuracy > {TINY_DEMO['prm_step_accuracy']}, F1 > {TINY_DEMO['processbench_f1']}"
    )
    r["goal_met"] = (r["after"]["step_accuracy"] or 0) > TINY_DEMO["prm_step_accuracy"] and (
        r["after"]["processbench_f1"] or 0
    ) > TINY_DEMO["processbench_f1"]
    return r


# --------------------------------------------------------------------------------------------------------------
# Report and plot.
# --------------------------------------------------------------------------------------------------------------
def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [t for t in TASKS if t in report.get("tasks", {}) and "error" not in report["tasks"][t]]
    if not panels:
        return
    cols = min(3, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.7 * rows + 0.6), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax, task in zip(axes.flat, panels):
        r = report["tasks"][task]
        if task == "grpo":
            for side, style in (("ours", "o-"), ("trl", "s--")):
                if side in r and r[side]["curve"]:
                    c = r[side]["curve"]
                    ax.plot(
                        [p["wall_s"] / 60 for p in c],
                        [100 * p["accuracy"] for p in c],
                        style,
                        label=f"{side} ({r[side]['steps']} steps)",
                    )
            if r.get("base_accuracy") is not None:
                ax.axhline(100 * r["base_accuracy"] + 15, color="grey", ls=":", lw=1, label="base + 15")
            ax.set_xlabel("training wall time (min, 1 thread each)")
            ax.set_ylabel("arith_dev accuracy (%, greedy)")
            ax.set_title("GRPO, rule reward")
            ax.legend(fontsize=7)
        else:
            hist = [h for h in r.get("log_history", []) if "loss" in h and "step" in h]
            if hist:
                ax.plot(
                    [h["step"] for h in hist],
                    [h["loss"] for h in hist],
                    color="lightsteelblue",
                    lw=1,
                    label="train loss",
                )
                ax.set_xlabel("step")
                ax.set_ylabel("train loss (light line)", color="slategray")
            ax2 = ax.twinx()
            steps = r["settings"].get("max_steps", 0)
            shown = {
                "sft": ["eval_loss"],
                "orm": ["accuracy"],
                "dpo": ["reward_accuracy"],
                "prm": ["step_accuracy", "processbench_f1"],
            }[task]
            for key, val in r["before"].items():
                if val is None or key not in shown:
                    continue
                after = r["after"].get(key)
                ax2.plot([0, steps], [val, after], "o-", lw=2, label=f"{key}: {val:.3f} -> {after:.3f}")
            if task == "prm":
                for ref in ("prm_step_accuracy", "processbench_f1"):
                    ax2.axhline(TINY_DEMO[ref], ls=":", lw=1, color="grey")
            if task in ("orm", "dpo"):
                ax2.axhline(0.75, ls=":", lw=1, color="grey")
            ax2.set_ylabel("held-out metric (dots: before / after)")
            if task != "sft":
                ax2.set_ylim(-0.02, 1.02)
            ax2.legend(fontsize=7, loc="center right")
            ax.set_title(f"{task.upper()}: {steps} steps", fontsize=10)
    fig.suptitle("SmolLM2-135M-Instruct on CPU:\nheld-out metrics before and after training", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def environment(a) -> dict:
    import torch
    import transformers

    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": " ".join(sys.argv),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "threads_per_process": a.threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": "SmolLM2-135M-Instruct (fp32)",
    }


def parser(description: str = __doc__) -> argparse.ArgumentParser:
    """The flags of this script (``bench_grpo_race.py`` adds its own to them)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--quick", action="store_true", help="smoke run: a minute or two per task")
    p.add_argument("--out", default=os.path.join(ROOT, "bench/results/real_learning.json"))
    p.add_argument("--png", help="default: the --out path with .png")
    p.add_argument("--workdir", default=os.path.join(ROOT, "output/real_learning"))
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--keep-checkpoints", action="store_true")
    g = p.add_argument_group("GRPO")
    g.add_argument("--grpo-sides", default="ours,trl")
    g.add_argument(
        "--trl-python",
        help="python of an environment with TRL's current release (default: this python with .trl-current first "
        "on its path, as scripts/setup.sh installs it)",
    )
    g.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="every task: fp32, or bf16 (SFT / DPO / ORM / PRM: `bf16: true`, O1: bf16 autocast over fp32 "
        "weights, training and evaluation; GRPO ours `training.bf16`, O2: bf16 weights, fp32 AdamW masters, TRL "
        "bf16=True: autocast, which TRL's configs turn on by default, on a CPU too; fp32: TRL bf16=False)",
    )
    g.add_argument("--minutes", type=float, default=32.0, help="training wall budget per side")
    g.add_argument("--evals", type=int, default=5, help="checkpoints per side (every --minutes / --evals)")
    g.add_argument("--max-steps", type=int, default=100000)
    g.add_argument("--prompts", type=int, default=4, help="prompts per step")
    g.add_argument("--group", type=int, default=8, help="completions per prompt")
    g.add_argument("--new-tokens", type=int, default=16, help="completion cap in training")
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument(
        "--micro-batch",
        type=int,
        default=8,
        help="completions per forward/backward (memory); the optimizer step takes all of a step's",
    )
    g.add_argument("--lr", type=float, default=1e-5)
    g.add_argument("--beta", type=float, default=0.04, help="k3 KL coefficient (TRL beta, our kl_loss_coef)")
    g.add_argument("--lora", action="store_true")
    g.add_argument("--lora-rank", type=int, default=16)
    g.add_argument("--eval-new-tokens", type=int, default=16)
    g.add_argument("--eval-prompts", type=int, default=128)
    g.add_argument("--eval-parallel", type=int, default=2, help="evaluator processes at once")
    s = p.add_argument_group("SFT / reward models / DPO")
    s.add_argument("--eval-samples", type=int, help="max_eval_samples of the dev files (default: all; --quick: 24)")
    s.add_argument("--seq-len", type=int, default=512, help="max_seq_len (packed row) of ORM, DPO, PRM")
    s.add_argument("--dpo-eval-before", action="store_true", help="measure DPO's step-0 metrics (all zero) too")
    s.add_argument("--sft-steps", type=int, default=20)
    s.add_argument("--sft-lr", type=float, default=2e-5)
    s.add_argument("--orm-steps", type=int, default=40)
    s.add_argument("--orm-lr", type=float, default=2e-5)
    s.add_argument("--orm-head-lr", type=float, default=None, help="the score head's own rate (head_learning_rate)")
    s.add_argument("--dpo-steps", type=int, default=30)
    s.add_argument("--dpo-lr", type=float, default=5e-6)
    s.add_argument("--prm-steps", type=int, default=40)
    s.add_argument("--prm-lr", type=float, default=2e-5)
    # internal (workers)
    p.add_argument("--side", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--eval-list", help=argparse.SUPPRESS)
    return p


def main() -> None:
    a = parser().parse_args()
    if a.side == "eval":
        eval_worker(a)
        return
    if a.side:
        side_main(a)
        return
    os.environ.update({k: v for k, v in env(a.threads).items() if k != "PYTHONPATH"})
    a.model_dir = a.model_dir or model_dir()
    if a.quick:
        a.minutes, a.evals, a.eval_prompts = min(a.minutes, 1.5), 1, min(a.eval_prompts, 32)
        a.eval_samples = a.eval_samples or 24
        a.workdir = a.workdir + "_quick"
        if a.out == os.path.join(ROOT, "bench/results/real_learning.json"):
            a.out = os.path.join(ROOT, "output/real_learning_quick.json")
    png = a.png or os.path.splitext(a.out)[0] + ".png"
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    report = {}
    if os.path.isfile(a.out):
        with open(a.out, encoding="utf-8") as f:
            report = json.load(f)
    report.setdefault("tasks", {})
    report["environment"] = environment(a)
    runners = {"sft": task_sft, "prm": task_prm, "orm": task_orm, "dpo": task_dpo, "grpo": task_grpo}
    for task in [t for t in a.tasks.split(",") if t]:
        t = time.perf_counter()
        print(f"=== {task} ===", flush=True)
        try:
            r = runners[task](a)
        except Exception as e:  # noqa: BLE001 (report the failure, go on with the other tasks)
            r = {"error": f"{type(e).__name__}: {e}"}
            print(f"{task} failed: {r['error']}", flush=True)
        r["task_wall_s"] = time.perf_counter() - t
        r["quick"] = a.quick
        r["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        if os.path.isfile(a.out):  # another invocation may have written other tasks meanwhile
            with open(a.out, encoding="utf-8") as f:
                report["tasks"] = {**json.load(f).get("tasks", {}), **report["tasks"]}
        report["tasks"][task] = r
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
        plot(report, png)
        print(
            json.dumps(
                {k: v for k, v in r.items() if k in ("before", "after", "goal_met", "base_accuracy", "error")}, indent=1
            ),
            flush=True,
        )
        for side in ("ours", "trl"):
            if side in r:
                print(side, [(round(c["wall_s"]), c["accuracy"]) for c in r[side]["curve"]], flush=True)
    if os.path.isfile(a.out):  # --tasks "" redraws the plot from the report
        with open(a.out, encoding="utf-8") as f:
            plot(json.load(f), png)
    print(f"report: {a.out}\nplot: {png}")


if __name__ == "__main__":
    main()
