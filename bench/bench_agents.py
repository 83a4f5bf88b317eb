"""Agents learning on the real model: each bundled environment's held-out success rate before training, after an
SFT warm-up on generated demonstrations, and during GRPO, ours against TRL's current ``GRPOTrainer``.

Not a test: a benchmark (issue 27 item 7). For each task (``--tasks``: ``calculator``, ``guessing``; settings in
``bench/agents_tasks.py``):

1. **Demonstrations** (``--warmup-demos`` from the task's train records, none of the held-out ones): the
   calculator, a Hermes tool call of the question's product, the tool's result, the answer; the game, binary
   search with the game's own feedback. Written as multi-turn SFT records (system / user / assistant: the SFT
   reader takes no ``tool`` role, so a tool result is the user message the chat template renders it as; the
   report says whether a demonstration renders token for token as the episodes do, ``demo_exact``).
2. **Warm-up** with our SFT trainer (``llm/run_finetune.py``, packed rows, ``--warmup-epochs``, ``--warmup-lr``),
   reported apart (its own wall time). ``--warmup-demos 0``: none, RL starts from the model itself.
3. **GRPO** for ``--minutes`` of training wall time per side, ours (``llm/alignment/ppo`` with the task's
   ``environment`` section) and TRL's ``GRPOTrainer`` (TRL's current release from ``.trl-current``, first on
   PYTHONPATH): the calculator with ``tools=[calculator]`` and a reward reading the final answer as
   ``CalculatorTask`` does; the game through ``environment_factory`` (``GuessingTool``: TRL continues an episode
   only on tool calls, so its guesses are ``guess`` tool calls, from its own warm-up on demonstrations in that
   form). Same start model, prompts, group size, learning rate, KL, clip, temperature; both sides at once, one
   thread each (``--threads``), each saving its policy every ``--minutes / --evals`` minutes of training.
4. **One evaluator** afterwards: every checkpoint, the model before training and after warm-up, greedy, one
   episode per held-out record (the first ``--eval-n`` of the task's dev file) with our episode loop
   (``EpisodeRunner``), success = the environment's reward > 0. TRL's game variant is evaluated in its own
   (tool) form by the same chat rendering. ``--eval-samples K`` adds the policy's own success at temperature 1
   (``K`` episodes per record, seed 1): greedy success saturates where the prompts are all alike (the calculator
   flips from 0% to 100% between one and two warm-up steps), the sampled one is what GRPO maximises.

Writes ``--out`` (JSON: settings, every curve, the warm-up, what stopped a side) and a PNG of held-out success
against training wall time per task (``--png``, default next to the JSON).

Usage (from the repository root)::

    python bench/bench_agents.py --quick --model tiny            # the pipeline end to end in a few minutes
    python bench/bench_agents.py --quick                         # the same on SmolLM2-135M-Instruct
    python bench/bench_agents.py --minutes 60                    # the measurement (hours: 2 tasks x 60 min + evals)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.agents_tasks import (
    SYSTEM,
    TASKS,
    TEMPLATES,
    calculator_demo,
    guessing_demo,
    guessing_tool_demo,
    make_tokenizer_dir,
    prompt_rows,
    read_jsonl,
    write_jsonl,
)
from bench.bench_real_learning import Budget

TRL_PATH = os.path.join(ROOT, ".trl-current")
SIDES = ("ours", "trl")


def task_spec(a, name: str | None = None):
    """The task's settings; the tiny test tokenizer (648 tokens) writes the prompts about 3x longer."""
    from bench.agents_tasks import copy_spec

    spec = TASKS[name or a.task]
    if a.model != "tiny":
        return spec
    return copy_spec(
        spec, max_prompt_length=1280, max_episode_tokens=1792, trl_completion_tokens=spec.trl_completion_tokens * 2
    )


def env(threads: int, trl: bool = False) -> dict:
    e = dict(os.environ)
    path = [TRL_PATH, ROOT] if trl else [ROOT]
    e.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        TRL_EXPERIMENTAL_SILENCE="1",
        PYTHONPATH=os.pathsep.join(path),
    )
    return e


def load_json(path: str, default=None):
    if not os.path.isfile(path):
        return default
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def dump_json(path: str, data) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)


def uptime() -> str:
    try:
        with open("/proc/loadavg", encoding="utf-8") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


# --------------------------------------------------------------------------------------------------------------
# Preparation: the start model, the tokenizer, prompts, demonstrations, warm-up.
# --------------------------------------------------------------------------------------------------------------
def base_model(a) -> str:
    if a.model == "smollm2":
        from llm.utils.gguf import smollm2_dir

        return smollm2_dir()
    if a.model == "tiny":  # a seeded random tiny Llama, saved once (every side loads the same weights)
        out = os.path.join(a.workdir, "tiny_base")
        if not os.path.isfile(os.path.join(out, "config.json")):
            import torch
            from transformers import AutoConfig, AutoModelForCausalLM

            torch.manual_seed(a.seed)
            model = AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(os.path.join(ROOT, "llm/assets/tiny-llama"))
            )
            model.save_pretrained(out)
        return out
    return a.model


def tokenizer_source(a, base: str) -> str:
    return os.path.join(ROOT, "llm/assets/tiny_tokenizer") if a.model == "tiny" else base


def demo_check(spec, chat, demo: dict) -> bool:
    """Whether a demonstration renders in SFT (the template without tools, the system message holding their
    description) as the same text as the episode it shows (our episode loop: the prompt with the tools, each model
    turn and its EOS, then what the loop appends for a tool result or the environment's message)."""
    from llm.alignment.ppo.agent.tools import ToolResult

    tok, msgs = chat.tokenizer, demo["messages"]
    text = chat.render(chat.prompt_messages([{"role": "system", "content": SYSTEM}, msgs[1]]), True)
    tool = spec.tools[0].split(":")[1] if spec.tools else None
    for m in msgs[2:]:
        if m["role"] == "assistant":
            text += m["content"] + tok.eos_token
        elif tool:
            body = m["content"].removeprefix("<tool_response>\n").removesuffix("\n</tool_response>")
            text += tok.decode(chat.message_ids(chat.tool_messages([ToolResult(tool, body)]), tool))
        else:
            text += tok.decode(chat.message_ids([m]))
    return tok.apply_chat_template(msgs, tokenize=False).rstrip() == text.rstrip()


def prepare(a, name: str) -> dict:
    """Prompt files, demonstrations and the tokenizer directory of task ``name``; returns their paths."""
    from transformers import AutoTokenizer

    from bench.agents_tasks import GuessingTool
    from llm.alignment.ppo.agent.chat import ChatFormat
    from llm.alignment.ppo.agent.tools import load_tools

    spec = TASKS[name]
    d = os.path.join(a.workdir, name)
    os.makedirs(d, exist_ok=True)
    for f in os.listdir(d):  # an earlier run's results and checkpoints (the prompts and demos are written anew)
        if f.startswith(("rl_", "eval_", "ours_step", "trl_step", "ours_run", "trl_run")):
            path = os.path.join(d, f)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    base = base_model(a)
    tok_dir = make_tokenizer_dir(
        tokenizer_source(a, base), a.template, os.path.join(a.workdir, f"tokenizer_{a.template}")
    )
    train = read_jsonl(spec.train)
    dev = read_jsonl(spec.dev)[: a.eval_n]
    paths = {"base": base, "tokenizer": tok_dir, "dir": d}
    paths["train_prompts"] = os.path.join(d, "train_prompts.jsonl")
    write_jsonl(paths["train_prompts"], prompt_rows(train))
    paths["dev"] = os.path.join(d, "dev.jsonl")
    write_jsonl(paths["dev"], dev)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    schemas = [t.schema for t in load_tools(list(spec.tools)).values()]
    chat = ChatFormat(tok, schemas)
    demos = train[: a.warmup_demos]
    info = {"demos": len(demos)}
    if demos:
        if name == "calculator":
            rows = [calculator_demo(r, chat) for r in demos]
        else:
            rows = [guessing_demo(r, spec.kwargs) for r in demos]
        info["demo_exact"] = all(demo_check(spec, chat, r) for r in rows[:8])
        info["demo_example"] = rows[0]["messages"][1:]
        paths["demos"] = os.path.join(d, "demos.jsonl")
        write_jsonl(paths["demos"], rows)
        if name == "guessing" and "trl" in a.sides and a.template == "tools":
            from transformers.utils import get_json_schema

            tool_chat = ChatFormat(tok, [get_json_schema(GuessingTool().guess)], "hermes")
            tool_rows = [guessing_tool_demo(r, spec.kwargs, tool_chat) for r in demos]
            info["tool_demo_example"] = tool_rows[0]["messages"][1:]
            paths["tool_demos"] = os.path.join(d, "demos_tool.jsonl")
            write_jsonl(paths["tool_demos"], tool_rows)
    return {"paths": paths, "info": info}


def warm_up(a, demos: str, base: str, tok_dir: str, out: str) -> dict:
    """Our SFT trainer on the demonstrations (packed rows of 1024), saving the model to ``out``."""
    flags = {
        "model_name_or_path": base,
        "tokenizer_name_or_path": tok_dir,
        "train_dataset_path": demos,
        "do_eval": "false",
        "output_dir": out,
        "overwrite_output_dir": "true",
        "save_strategy": "no",
        "report_to": "none",
        "seed": a.seed,
        "learning_rate": a.warmup_lr,
        "num_train_epochs": a.warmup_epochs,
        "max_steps": a.warmup_steps,
        "warmup_steps": 0,
        "lr_scheduler_type": "constant",
        "max_seq_len": 2048 if a.model == "tiny" else 1024,
        "max_prompt_len": 1280 if a.model == "tiny" else 512,
        "logging_steps": 1,
        "use_chat_template": "true",
    }
    cmd = [
        sys.executable,
        os.path.join(ROOT, "llm/run_finetune.py"),
        os.path.join(ROOT, "llm/config/smollm2/sft_argument.json"),
    ]
    for k, v in flags.items():
        cmd += [f"--{k}", str(v)]
    print("$", " ".join(cmd), flush=True)
    t = time.perf_counter()
    with open(out + ".log", "w", encoding="utf-8") as log:
        rc = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env(a.threads_warmup), cwd=ROOT, check=False
        ).returncode
    seconds = time.perf_counter() - t
    if rc != 0:
        with open(out + ".log", encoding="utf-8") as f:
            raise RuntimeError(f"the SFT warm-up failed (rc {rc}; {out}.log):\n{f.read()[-2000:]}")
    state = load_json(os.path.join(out, "trainer_state.json"), {})
    results = load_json(os.path.join(out, "all_results.json"), {})
    losses = [h["loss"] for h in state.get("log_history", []) if "loss" in h]
    return {
        "wall_s": seconds,
        "train_runtime_s": results.get("train_runtime"),
        "steps": state.get("global_step"),
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "threads": a.threads_warmup,
        "settings": {k: flags[k] for k in ("learning_rate", "num_train_epochs", "max_steps", "max_seq_len")},
    }


# --------------------------------------------------------------------------------------------------------------
# The evaluator (a subprocess: every checkpoint of a list).
# --------------------------------------------------------------------------------------------------------------
def eval_worker(a) -> None:
    import torch

    from bench.agents_tasks import SAMPLED, evaluate_episodes, evaluate_guess_tool, load_policy

    torch.set_num_threads(a.threads)
    spec = task_spec(a)
    rows = read_jsonl(os.path.join(a.workdir, a.task, "dev.jsonl"))
    points = load_json(a.eval_list)
    out = []
    for p in points:
        t = time.perf_counter()
        model, tok = load_policy(p["path"], a.tokenizer_dir)
        fn = evaluate_guess_tool if p.get("format") == "guess_tool" else evaluate_episodes
        r = fn(model, tok, spec, rows, a.eval_batch)
        if a.eval_samples > 0 and fn is evaluate_episodes:
            s = evaluate_episodes(model, tok, spec, rows, a.eval_batch, SAMPLED, a.eval_samples)
            r.update({f"{k}_sampled": s[k] for k in ("success", "n", "tool_call_rate", "tool_calls", "turns")})
            r["samples_sampled"] = s["samples"]
        r["eval_s"] = time.perf_counter() - t
        out.append({**p, **r})
        sampled = f", sampled {r['success_sampled']:.3f} of {r['n_sampled']}" if "success_sampled" in r else ""
        print(
            f"[eval {a.task}] {p['label']} wall {p.get('wall_s', 0):.0f}s: success {r['success']:.3f}{sampled} "
            f"(n {r['n']}, tool calls {r.get('tool_calls', 0):.2f}, {r['eval_s']:.0f}s)",
            flush=True,
        )
        if not a.keep_checkpoints and p.get("step", 0) > 0:
            shutil.rmtree(p["path"], ignore_errors=True)
        dump_json(a.result, out)


# --------------------------------------------------------------------------------------------------------------
# GRPO sides (a subprocess each; TRL's with TRL's current release first on PYTHONPATH).
# --------------------------------------------------------------------------------------------------------------
def ours_config(a, spec, start: str) -> dict:
    batch = a.prompts * a.group
    return {
        "training": {
            "output_dir": os.path.join(a.workdir, a.task, "ours_run"),
            "seed": a.seed,
            "learning_rate": a.lr,
            "max_grad_norm": 1.0,
            "max_steps": 100000,
            "micro_batch_size": a.micro_batch,
            "report_to": "none",
            "disable_tqdm": True,
        },
        "actor_rollout": {
            "model_name_or_path": start,
            "tokenizer_name_or_path": a.tokenizer_dir,
            "do_sample": True,
            "temperature": a.temperature,
            "top_p": 1.0,
            "top_k": 0,
            "max_prompt_length": spec.max_prompt_length,
            "max_response_length": spec.max_response_length,
            "num_samples_per_step": a.group,
            "ppo_mini_batch_size": batch,
            "ppo_epochs": 1,
            "clip_ratio": 0.2,
            "shuffle_minibatch": False,
        },
        "ref": {},
        "critic": {},
        "reward": {"type": "rule", "rule": "llm.alignment.ppo.rewards.rule_functions:no_reward"},
        "algorithm": {
            "adv_estimator": "grpo",
            "kl_penalty": "k3",
            "kl_loss_coef": a.beta,
            "use_kl_in_reward": False,
            "kl_ctrl": {"type": "fixed", "kl_coef": 0.0},
        },
        "data": {
            "train_dataset_path": os.path.join(a.workdir, a.task, "train_prompts.jsonl"),
            "rollout_batch_size": a.prompts,
            "use_chat_template": True,
        },
        "environment": {
            "name_or_path": spec.env,
            "kwargs": dict(spec.kwargs),
            "tools": list(spec.tools),
            "tool_call_format": "auto",
            "max_turns": spec.max_turns,
            "max_episode_tokens": spec.max_episode_tokens,
            "step_timeout": 10.0,
            "gamma": 1.0,
            "on_error": "zero",
            "max_error_fraction": 0.5,
        },
    }


def progress(a, log: list, points: list) -> None:
    dump_json(a.result + ".progress", {"log": log, "points": points})


def run_ours(a) -> dict:
    import torch

    from llm.alignment.ppo.build import PPOContext, build_ppo, load_prompts, placed_roles
    from llm.settings.load import parse_ppo_config

    torch.set_num_threads(a.threads)
    spec = task_spec(a)
    path = os.path.join(a.workdir, a.task, "ours_grpo.json")
    dump_json(path, ours_config(a, spec, a.start))
    c = parse_ppo_config([path])
    budget = Budget(a.minutes, a.evals, a.max_steps)
    log: list[dict] = []
    run = PPOContext.load(c)  # the tokenizers and what they decide, once (as run_ppo.py)
    with placed_roles(c, run) as roles:
        trainer = build_ppo(c, load_prompts(c, run), roles, run)
        step = 0
        while not budget.done(step):
            t = time.perf_counter()
            m = trainer.train_step()
            budget.add(time.perf_counter() - t)
            step += 1
            row = {
                "step": step,
                "wall_s": budget.train_s,
                "reward": m.get("env_reward", m["score"]),
                "kl": m["kl"],
                "response_length": m["response_length"],
                "turns": m.get("episode/turns"),
                "tool_calls": m.get("episode/tool_calls"),
                "step_s": m["time/step"],
                "generation_s": m.get("time/rollout_generation"),
                "environment_s": m.get("time/rollout_environment"),
                "update_s": m.get("time/update"),
            }
            log.append(row)
            print(
                f"[ours {a.task}] step {step} wall {budget.train_s:.0f}s reward {row['reward']:.3f} kl {row['kl']:.4f} "
                f"turns {row['turns']} tool calls {row['tool_calls']} step {row['step_s']:.1f}s",
                flush=True,
            )
            if budget.due(step):
                d = os.path.join(a.workdir, a.task, f"ours_step{step}")
                trainer.actor.save(d, False)
                budget.points.append(
                    {"side": "ours", "label": f"ours step {step}", "step": step, "wall_s": budget.train_s, "path": d}
                )
                progress(a, log, budget.points)
    return {"log": log, "points": budget.points}


def calculator_reward(completions, tgt, **kwargs) -> list[float]:
    """TRL side: 1 when the final assistant message makes no tool call and its last number is the answer (what
    ``CalculatorTask`` pays); else 0."""
    from llm.alignment.ppo.rewards.rule_functions import last_number

    out = []
    for c, ref in zip(completions, tgt):
        final = c[-1] if isinstance(c, list) and c else {"role": "assistant", "content": str(c)}
        ok = final.get("role") == "assistant" and not final.get("tool_calls")
        out.append(1.0 if ok and last_number(final.get("content") or "") == last_number(ref) else 0.0)
    return out


def trl_dataset(a, spec):
    from datasets import Dataset

    from bench.agents_tasks import GUESS_TOOL_SRC, messages_of

    rows = read_jsonl(spec.train)
    if a.task == "calculator":
        return Dataset.from_dict({"prompt": [messages_of(r) for r in rows], "tgt": [r["tgt"] for r in rows]})
    return Dataset.from_dict(
        {
            "prompt": [messages_of(r, GUESS_TOOL_SRC.format(**r)) for r in rows],
            "tgt": [r["tgt"] for r in rows],
            "low": [r["low"] for r in rows],
            "high": [r["high"] for r in rows],
        }
    )


def trl_refusal_of_own_template(a, model, args, data) -> str | None:
    """What TRL says when given SmolLM2's own chat template with the calculator tool (None: it accepts it)."""
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    from llm.alignment.ppo.agent.envs.calculator import calculator

    if a.model == "tiny":
        return None
    tok = AutoTokenizer.from_pretrained(a.start)
    tok.chat_template = AutoTokenizer.from_pretrained(base_model(a)).chat_template
    try:
        GRPOTrainer(
            model=model,
            reward_funcs=[calculator_reward],
            args=args,
            processing_class=tok,
            train_dataset=data,
            tools=[calculator],
        )
    except Exception as err:  # noqa: BLE001 (recorded: what stops TRL)
        return f"{type(err).__name__}: {err}"
    return None


def run_trl(a) -> dict:
    import inspect

    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from bench.agents_tasks import GuessingTool, trl_response_template
    from llm.alignment.ppo.agent.envs.calculator import calculator

    torch.set_num_threads(a.threads)
    spec = task_spec(a)
    tok = AutoTokenizer.from_pretrained(a.tokenizer_dir)
    trl_response_template(tok)
    model = AutoModelForCausalLM.from_pretrained(a.start, dtype=torch.float32)
    batch = a.prompts * a.group
    data = trl_dataset(a, spec)
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
                d = os.path.join(a.workdir, a.task, f"trl_step{step}")
                model.save_pretrained(d)
                budget.points.append(
                    {"side": "trl", "label": f"trl step {step}", "step": step, "wall_s": budget.train_s, "path": d}
                )
                progress(a, log, budget.points)
            if budget.done(step):
                control.should_training_stop = True
            return control

        def on_log(self, args, st, control, logs=None, **kwargs):
            if logs and "reward" in logs and log:
                keep = (
                    "reward",
                    "kl",
                    "completions/mean_length",
                    "tools/call_frequency",
                    "tools/failure_frequency",
                    "step_time",
                )
                log[-1].update({k: logs.get(k) for k in keep if k in logs})
                print(
                    f"[trl {a.task}] step {log[-1]['step']} wall {log[-1]['wall_s']:.0f}s "
                    + " ".join(f"{k} {logs.get(k)}" for k in keep if k in logs),
                    flush=True,
                )

    kwargs = dict(  # noqa: C408 (GRPOConfig's keyword arguments)
        output_dir=os.path.join(a.workdir, a.task, "trl_run"),
        use_cpu=True,
        seed=a.seed,
        report_to="none",
        per_device_train_batch_size=a.micro_batch,
        num_generations=a.group,
        gradient_accumulation_steps=max(1, batch // a.micro_batch),
        generation_batch_size=batch,
        max_completion_length=spec.trl_completion_tokens,
        max_tool_calling_iterations=spec.max_turns - 1 if a.task == "calculator" else spec.max_turns,
        temperature=a.temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        optim="adamw_torch",
        max_grad_norm=1.0,
        beta=a.beta,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        gradient_checkpointing=False,
        bf16=False,  # as ours: fp32 (TRL's configs default to bf16 autocast, on a CPU too)
        max_steps=100000,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        # Off: TRL 1.16's completion printer json.loads a tool call's arguments and raises on arguments that
        # are not JSON (a sampled `{"expression": 12*34}`-like call), which stops training (2026-12-05, step 5).
        log_completions=False,
        use_vllm=False,
        dataloader_num_workers=0,
    )
    accepted = set(inspect.signature(GRPOConfig.__init__).parameters)
    dropped = sorted(k for k in kwargs if k not in accepted)
    args = GRPOConfig(**{k: v for k, v in kwargs.items() if k in accepted})
    out = {"trl_version": trl.__version__, "dropped_config_keys": dropped}
    if a.task == "calculator":
        out["own_template_refusal"] = trl_refusal_of_own_template(a, model, args, data)
        side = {"reward_funcs": [calculator_reward], "tools": [calculator]}
    else:
        side = {"environment_factory": lambda: GuessingTool(**spec.kwargs)}
    trainer = GRPOTrainer(model=model, args=args, processing_class=tok, train_dataset=data, callbacks=[Clock()], **side)
    trainer.train()
    out.update(log=log, points=budget.points)
    return out


def side_main(a) -> None:
    import resource

    import transformers

    t = time.perf_counter()
    out = run_ours(a) if a.side == "ours" else run_trl(a)
    out.update(
        total_s=time.perf_counter() - t,
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        transformers=transformers.__version__,
    )
    dump_json(a.result, out)


FORWARD = (
    "workdir", "model", "threads", "minutes", "evals", "max_steps", "prompts", "group", "micro_batch", "temperature",
    "lr", "beta", "seed", "eval_batch", "eval_samples", "template",
)  # fmt: skip


def worker_cmd(a, side: str, result: str, **extra) -> list[str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--side", side, "--result", result, "--task", a.task]
    for k in FORWARD:
        cmd += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    if a.keep_checkpoints:
        cmd.append("--keep-checkpoints")
    for k, v in extra.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    return cmd


def run_procs(a, jobs: dict[str, tuple[list[str], bool]], parallel: int) -> dict[str, int]:
    """``jobs``: name -> (command, with TRL's path); at most ``parallel`` at once; their logs in the task dir."""
    d = os.path.join(a.workdir, a.task)
    pending, running, rcs = list(jobs.items()), {}, {}
    while pending or running:
        while pending and len(running) < parallel:
            name, (cmd, trl) = pending.pop(0)
            print("$", " ".join(cmd), flush=True)
            log = open(os.path.join(d, f"{name}.log"), "w", encoding="utf-8")  # noqa: SIM115 (closed below)
            running[name] = (
                subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env(a.threads, trl), cwd=ROOT),
                log,
            )
        time.sleep(2)
        for name, (p, log) in list(running.items()):
            if p.poll() is not None:
                log.close()
                rcs[name] = p.returncode
                del running[name]
    return rcs


def log_tail(a, name: str, chars: int = 1500) -> str:
    path = os.path.join(a.workdir, a.task, f"{name}.log")
    if not os.path.isfile(path):
        return ""
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()[-chars:]


# --------------------------------------------------------------------------------------------------------------
# One task: prepare, warm up, both RL sides at once, then one evaluator over every policy.
# --------------------------------------------------------------------------------------------------------------
def settings(a) -> dict:
    spec = task_spec(a)
    return {
        "model": a.model,
        "template": a.template,
        "environment": {
            k: getattr(spec, k)
            for k in ("env", "kwargs", "tools", "max_turns", "max_response_length", "max_episode_tokens")
        },
        "trl_max_completion_length": spec.trl_completion_tokens,
        "prompts_per_step": a.prompts,
        "group": a.group,
        "episodes_per_step": a.prompts * a.group,
        "temperature": a.temperature,
        "learning_rate": a.lr,
        "beta_kl_k3": a.beta,
        "clip": 0.2,
        "loss": "token mean over the step (ours; TRL loss_type dapo), advantages (r - mean_g) / std_g",
        "minutes_per_side": a.minutes,
        "threads_per_side": a.threads,
        "eval": f"greedy, first {a.eval_n} of {spec.dev}, success = environment reward > 0"
        + (
            f"; sampled: {a.eval_samples} episodes per record at temperature 1 (the policy GRPO trains), seed 1"
            if a.eval_samples > 0
            else ""
        ),
        "warmup": {"demos": a.warmup_demos, "epochs": a.warmup_epochs, "max_steps": a.warmup_steps, "lr": a.warmup_lr},
        "seed": a.seed,
    }


def side_result(a, side: str, rc: int | None) -> dict:
    path = os.path.join(a.workdir, a.task, f"rl_{side}.json")
    if rc == 0 and os.path.isfile(path):
        return load_json(path)
    out = {"error": log_tail(a, f"rl_{side}", 2500), "rc": rc}
    out.update(load_json(path + ".progress", {}))
    return out


EVAL_KEYS = (
    "success", "tool_calls", "tool_call_rate", "turns", "samples",
    "success_sampled", "tool_call_rate_sampled", "tool_calls_sampled", "n_sampled",
)  # fmt: skip


def curve(points: list[dict], evals: dict[str, dict], start: dict | None) -> list[dict]:
    keys = ("step", "wall_s", *EVAL_KEYS)
    first = [{"step": 0, "wall_s": 0.0, **{k: start.get(k) for k in keys[2:]}}] if start else []
    return first + [{k: evals[p["label"]].get(k) for k in keys} for p in points if p["label"] in evals]


def side_summary(r: dict, c: list[dict], first: dict, origin: dict, eval_format: str) -> dict:
    """One side's report: its curve ``c`` (held-out success at each checkpoint, from ``first``: its start policy's
    evaluation), the gains over ``origin`` (the model before training) and over its start (RL's own), its log."""
    final = c[-1]["success"] if len(c) > 1 else None
    final_s = c[-1].get("success_sampled") if len(c) > 1 else None
    start_s = first.get("success_sampled")
    return {
        "curve": c,
        "eval_format": eval_format,
        "before": origin.get("success"),
        "start": first.get("success"),
        "final": final,
        "best": max((p["success"] for p in c[1:] if p["success"] is not None), default=None),
        "gain_points_over_before": None
        if final is None or origin.get("success") is None
        else 100 * (final - origin["success"]),
        "gain_points_of_rl": None
        if final is None or first.get("success") is None
        else 100 * (final - first["success"]),
        "start_sampled": start_s,
        "final_sampled": final_s,
        "best_sampled": max(
            (p["success_sampled"] for p in c[1:] if p.get("success_sampled") is not None), default=None
        ),
        "gain_points_of_rl_sampled": None if final_s is None or start_s is None else 100 * (final_s - start_s),
        "steps": r["log"][-1]["step"] if r.get("log") else 0,
        "train_wall_s": r["log"][-1]["wall_s"] if r.get("log") else 0,
        "train_log": r.get("log", []),
        **{
            k: r[k]
            for k in (
                "trl_version",
                "dropped_config_keys",
                "own_template_refusal",
                "peak_rss_mib",
                "total_s",
                "error",
                "rc",
            )
            if k in r
        },
    }


def set_goals(task: dict) -> None:
    """The issue's goal (+15 points) on our side: over the model before training, and RL's own (sampled)."""
    ours = task.get("ours", {})
    for goal, gain in (("goal_+15_points_met", "gain_points_over_before"),
                       ("goal_+15_points_of_rl_sampled_met", "gain_points_of_rl_sampled")):  # fmt: skip
        if ours.get(gain) is not None:
            task[goal] = ours[gain] >= 15


def run_task(a, name: str) -> dict:
    a.task = name
    out: dict = {"settings": settings(a), "load_average_start": uptime()}
    prep = prepare(a, name)
    paths = prep["paths"]
    out["prepare"] = prep["info"]
    a.tokenizer_dir = paths["tokenizer"]
    d = paths["dir"]
    start = {"ours": paths["base"], "trl": paths["base"]}
    formats = {"ours": "episodes", "trl": "guess_tool" if name == "guessing" else "episodes"}
    if "demos" in paths:
        out["warmup"] = warm_up(a, paths["demos"], paths["base"], a.tokenizer_dir, os.path.join(d, "warm"))
        start = {"ours": os.path.join(d, "warm"), "trl": os.path.join(d, "warm")}
    if "tool_demos" in paths:
        out["warmup_trl_tool_game"] = warm_up(
            a, paths["tool_demos"], paths["base"], a.tokenizer_dir, os.path.join(d, "warm_tool")
        )
        start["trl"] = os.path.join(d, "warm_tool")
    # RL: the sides at once
    jobs = {
        f"rl_{s}": (
            worker_cmd(a, s, os.path.join(d, f"rl_{s}.json"), start=start[s], tokenizer_dir=a.tokenizer_dir),
            s == "trl",
        )
        for s in a.sides
    }
    out["load_average_rl_start"] = uptime()
    rcs = run_procs(a, jobs, len(jobs))
    out["load_average_rl_end"] = uptime()
    results = {s: side_result(a, s, rcs.get(f"rl_{s}")) for s in a.sides}
    # Evaluation: the start policies, then each side's checkpoints
    before = [{"label": "base", "side": "base", "step": 0, "path": paths["base"], "format": "episodes"}]
    if "warmup" in out:
        before.append({"label": "warm", "side": "warm", "step": 0, "path": start["ours"], "format": "episodes"})
    if "trl" in a.sides and formats["trl"] != "episodes":
        before.append({"label": "base_tool", "side": "base", "step": 0, "path": paths["base"], "format": "guess_tool"})
        if start["trl"] != paths["base"]:
            before.append(
                {"label": "warm_tool", "side": "warm", "step": 0, "path": start["trl"], "format": "guess_tool"}
            )
    lists = {"before": before}
    for s in a.sides:
        lists[s] = [{**p, "format": formats[s]} for p in results[s].get("points", [])]
    ejobs = {}
    for group, points in lists.items():
        if points:
            lst = os.path.join(d, f"eval_{group}.list.json")
            dump_json(lst, points)
            cmd = worker_cmd(
                a, "eval", os.path.join(d, f"eval_{group}.json"), eval_list=lst, tokenizer_dir=a.tokenizer_dir
            )
            ejobs[f"eval_{group}"] = (cmd, False)
    run_procs(a, ejobs, a.eval_parallel)
    evals = {}
    for group in lists:
        for e in load_json(os.path.join(d, f"eval_{group}.json"), []):
            evals[e["label"]] = e
    base = evals.get("base", {})
    out["before"] = {k: base.get(k) for k in EVAL_KEYS if k in base}
    if "warm" in evals:
        out["after_warmup"] = {k: evals["warm"].get(k) for k in EVAL_KEYS if k in evals["warm"]}
    for s in a.sides:
        if formats[s] == "episodes":
            first, origin = evals.get("warm", base), base
        else:
            first, origin = evals.get("warm_tool", evals.get("base_tool", {})), evals.get("base_tool", {})
        out[s] = side_summary(results[s], curve(results[s].get("points", []), evals, first), first, origin, formats[s])
    set_goals(out)
    out["load_average_end"] = uptime()
    return out


# --------------------------------------------------------------------------------------------------------------
# Report and plot.
# --------------------------------------------------------------------------------------------------------------
def plot(report: dict, path: str) -> str | None:
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed: no PNG"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t in TASKS if t in report.get("tasks", {}) and "error" not in report["tasks"][t]]
    if not tasks:
        return None
    fig, axes = plt.subplots(1, len(tasks), figsize=(max(7.0, 5.4 * len(tasks)), 4.2), squeeze=False)
    for ax, name in zip(axes[0], tasks):
        r = report["tasks"][name]
        for side, style in (("ours", "o-"), ("trl", "s--")):
            if side in r and r[side]["curve"]:
                c = r[side]["curve"]
                label = f"{side} ({r[side]['steps']} steps)" + (
                    ", guess tool" if r[side]["eval_format"] == "guess_tool" else ""
                )
                ax.plot([p["wall_s"] / 60 for p in c], [100 * (p["success"] or 0) for p in c], style, label=label)
                if any(p.get("success_sampled") is not None for p in c):
                    ax.plot(
                        [p["wall_s"] / 60 for p in c],
                        [100 * (p.get("success_sampled") or 0) for p in c],
                        style[0] + ":",
                        color=ax.lines[-1].get_color(),
                        label=f"{side}, sampled at T = 1",
                    )
        before = r.get("before", {}).get("success")
        if before is not None:
            ax.axhline(100 * before, color="grey", lw=1, label=f"before training ({100 * before:.0f}%)")
            ax.axhline(100 * before + 15, color="grey", ls=":", lw=1, label="before + 15 points")
        w = r.get("warmup")
        warm = f"; warm-up {w['steps']} SFT steps, {w['wall_s'] / 60:.1f} min apart" if w else "; no warm-up"
        ax.set_title(f"{name}{warm}", fontsize=9)
        ax.set_xlabel(f"GRPO training wall time (min, {r['settings']['threads_per_side']} thread per side)")
        ax.set_ylabel("held-out success (%; solid/dashed greedy, dotted sampled)")
        ax.set_ylim(-2, 102)
        ax.legend(fontsize=7)
    env_ = report.get("environment", {})
    fig.suptitle(
        f"{env_.get('model', '')}: held-out success of multi-turn GRPO, ours vs TRL {env_.get('trl', '')}", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def add_side(a, png: str) -> None:
    """``--add-side``: one side's GRPO run made apart (its worker command, e.g. again after a crash; its result
    JSON ``--side-result``) evaluated by the same evaluator and put into the task's report in ``--out`` beside the
    other side, against the report's own start evaluations."""
    if not a.side_result or not a.tokenizer_dir:
        fail("--add-side needs --side-result (the side worker's result JSON) and --tokenizer-dir")
    report = load_json(a.out, {})
    a.task = a.tasks.split(",")[0]
    task = report.get("tasks", {}).get(a.task)
    if not task or "before" not in task:
        fail(f"{a.out} has no evaluated {a.task!r} task to add a side to: run the task first")
    if a.task == "guessing" and a.add_side == "trl":
        fail("--add-side takes sides evaluated as episodes (not TRL's guessing tool format)")
    result = load_json(a.side_result)
    if not result or not result.get("points"):
        fail(f"{a.side_result} holds no checkpoints (a side's finished result JSON is needed)")
    d = os.path.join(a.workdir, a.task)
    lst = os.path.join(d, f"eval_{a.add_side}.list.json")
    dump_json(lst, [{**p, "format": "episodes"} for p in result["points"]])
    ev = os.path.join(d, f"eval_{a.add_side}.json")
    run_procs(
        a, {f"eval_{a.add_side}": (worker_cmd(a, "eval", ev, eval_list=lst, tokenizer_dir=a.tokenizer_dir), False)}, 1
    )
    evals = {e["label"]: e for e in load_json(ev, [])}
    first = task.get("after_warmup") or task["before"]
    task[a.add_side] = side_summary(result, curve(result["points"], evals, first), first, task["before"], "episodes")
    task[a.add_side]["run_apart"] = {
        "command": " ".join(sys.argv),
        "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    set_goals(task)
    dump_json(a.out, report)
    plot(report, png)
    s = task[a.add_side]
    print(json.dumps({k: s.get(k) for k in ("start", "final", "start_sampled", "final_sampled", "steps")}, indent=1))


def environment(a) -> dict:
    import torch
    import transformers

    trl_version = None
    meta = (
        [n for n in os.listdir(TRL_PATH) if n.startswith("trl-") and n.endswith(".dist-info")]
        if os.path.isdir(TRL_PATH)
        else []
    )
    if meta:
        trl_version = meta[0][4:-10]
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": " ".join(sys.argv),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_average": uptime(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl_version,
        "model": {"smollm2": "SmolLM2-135M-Instruct (fp32)", "tiny": "tiny random Llama (llm/assets/tiny-llama)"}.get(
            a.model, a.model
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument(
        "--model", default="smollm2", help="smollm2, tiny (a random tiny Llama: the pipeline only) or a model directory"
    )
    p.add_argument("--template", default="tools", choices=TEMPLATES, help="see bench/agents_tasks.py")
    p.add_argument(
        "--quick", action="store_true", help="a smoke run: tiny held-out set, 2 SFT steps, 2 GRPO steps per side"
    )
    p.add_argument(
        "--out", help="default bench/results/bench_agents.json (--quick: output/bench_agents_quick_<model>.json)"
    )
    p.add_argument("--png", help="default: the --out path with .png")
    p.add_argument("--workdir", help="default output/bench_agents[_quick]")
    p.add_argument("--threads", type=int, default=1, help="torch threads per RL side and evaluator")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--keep-checkpoints", action="store_true")
    g = p.add_argument_group("GRPO (both sides)")
    g.add_argument("--minutes", type=float, default=60.0, help="training wall budget per side and task")
    g.add_argument("--evals", type=int, default=6, help="checkpoints per side (every --minutes / --evals)")
    g.add_argument("--max-steps", type=int, default=100000)
    g.add_argument("--prompts", type=int, default=4, help="prompts per step")
    g.add_argument("--group", type=int, default=8, help="episodes per prompt")
    g.add_argument(
        "--micro-batch", type=int, default=4, help="episodes per forward / backward (TRL: per_device_train_batch_size)"
    )
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--lr", type=float, default=1e-5)
    g.add_argument("--beta", type=float, default=0.04, help="k3 KL coefficient (TRL beta, our kl_loss_coef)")
    g = p.add_argument_group("warm-up and evaluation")
    g.add_argument("--warmup-demos", type=int, default=64, help="demonstrations (0: no warm-up)")
    g.add_argument("--warmup-epochs", type=float, default=1.0)
    g.add_argument("--warmup-steps", type=int, default=-1, help="max_steps of the SFT (-1: the epochs decide)")
    g.add_argument("--warmup-lr", type=float, default=5e-5)
    g.add_argument("--threads-warmup", type=int, default=2)
    g.add_argument("--eval-n", type=int, default=64, help="held-out records (the dev file's first)")
    g.add_argument("--eval-batch", type=int, default=16)
    g.add_argument(
        "--eval-samples",
        type=int,
        default=0,
        help="also evaluate sampled at temperature 1, this many episodes per record (0: greedy only)",
    )
    g.add_argument("--eval-parallel", type=int, default=2, help="evaluator processes at once")
    p.add_argument(
        "--add-side",
        choices=SIDES,
        help="evaluate a side's run made apart (--side-result: its worker's JSON; --workdir, --tokenizer-dir: "
        "its task's) and add it to the task's report in --out",
    )
    p.add_argument("--side-result", help="with --add-side")
    # internal (workers)
    for flag in ("--side", "--result", "--task", "--start", "--tokenizer-dir", "--eval-list"):
        p.add_argument(flag, help=argparse.SUPPRESS)
    a = p.parse_args()
    a.sides = [s for s in a.sides.split(",") if s] if isinstance(a.sides, str) else a.sides
    if a.side == "eval":
        eval_worker(a)
        return
    if a.side:
        side_main(a)
        return
    os.environ.update({k: v for k, v in env(a.threads).items() if k != "PYTHONPATH"})
    if a.quick:
        a.minutes, a.evals, a.max_steps = min(a.minutes, 2.0), 1, min(a.max_steps, 2)
        a.eval_n, a.warmup_demos = min(a.eval_n, 8), min(a.warmup_demos, 8)
        a.warmup_steps = 2 if a.warmup_steps < 0 else a.warmup_steps
        a.prompts, a.group, a.micro_batch = min(a.prompts, 2), min(a.group, 4), min(a.micro_batch, 8)
    tag = os.path.basename(a.model.rstrip("/")) if a.model not in ("smollm2", "tiny") else a.model
    a.workdir = a.workdir or os.path.join(
        ROOT, "output", f"bench_agents_quick_{tag}" if a.quick else f"bench_agents_{tag}"
    )
    a.out = a.out or (
        os.path.join(ROOT, "output", f"bench_agents_quick_{tag}.json")
        if a.quick
        else os.path.join(ROOT, "bench/results/bench_agents.json")
    )
    png = a.png or os.path.splitext(a.out)[0] + ".png"
    if a.add_side:
        add_side(a, png)
        return
    os.makedirs(a.workdir, exist_ok=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    report = load_json(a.out, {})
    report.setdefault("tasks", {})
    report["environment"] = environment(a)
    for name in [t for t in a.tasks.split(",") if t]:
        t = time.perf_counter()
        print(f"=== {name} (load average {uptime()}) ===", flush=True)
        try:
            r = run_task(a, name)
        except Exception as e:  # noqa: BLE001 (report the failure, go on with the other tasks)
            import traceback

            traceback.print_exc()
            r = {"error": f"{type(e).__name__}: {e}"}
        r.update(
            environment=report["environment"],  # each task's own run (a report gathers tasks of several runs)
            task_wall_s=time.perf_counter() - t,
            quick=a.quick,
            finished=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        )
        report["tasks"][name] = r
        dump_json(a.out, report)
        note = plot(report, png)
        if note:
            report["png"] = note
            dump_json(a.out, report)
        summary = {
            k: r.get(k)
            for k in ("before", "after_warmup", "goal_+15_points_met", "goal_+15_points_of_rl_sampled_met", "error")
        }
        for s in SIDES:
            if s in r:
                summary[s] = {
                    k: r[s].get(k)
                    for k in (
                        "before", "start", "final", "steps", "gain_points_over_before",
                        "start_sampled", "final_sampled", "gain_points_of_rl_sampled", "error",
                    )
                }  # fmt: skip
                summary[s]["curve"] = [
                    (round(c["wall_s"]), c["success"], c.get("success_sampled")) for c in r[s]["curve"]
                ]
        for k in ("before", "after_warmup"):
            if summary.get(k):
                summary[k] = {kk: vv for kk, vv in summary[k].items() if not kk.startswith("samples")}
        print(json.dumps(summary, indent=1, default=str)[:4000], flush=True)
    print(f"report: {a.out}\nplot: {png}")


if __name__ == "__main__":
    main()
