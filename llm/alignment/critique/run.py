"""``llm/run_critiques.py``: every record's critiques made (``make.critiques_for``) and appended as it finishes.

::

    output_dir/
      critiques_run.json   the settings' fingerprint: a rerun resumes only its own (overwrite_output_dir: afresh)
      critiques.jsonl      PaddleNLP PRM records with critiques (run_reward.py with prm_kind generative trains on it)
      done.jsonl           one line per finished input record, written after its record
      report.json          the counts (records, steps, template and judge critiques, judge critiques replaced)

A rerun skips the records with a ``done`` line; a record written without one (a kill between the two writes) is
cut off first, so a kill loses at most the record being made.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter

import torch

from llm.alignment.critique.make import critiques_for
from llm.alignment.label.completer import hf_engine, vllm_engine
from llm.data.encoding import render_prompt, resolve_chat_template
from llm.data.readers.mixing import load_dataset_records
from llm.settings.critiques import CritiqueArguments
from llm.settings.fingerprint import run_fingerprint
from llm.utils.checkpoints import differing_fields
from llm.utils.errors import UserError
from llm.utils.modeling import load_model, load_tokenizer

logger = logging.getLogger(__name__)

RUN_FILE, OUT_FILE, DONE_FILE, REPORT_FILE = "critiques_run.json", "critiques.jsonl", "done.jsonl", "report.json"


def _whole_lines(path: str) -> list[str]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [line for line in f if line.endswith("\n")]


def claim(output_dir: str, fingerprint: dict, overwrite: bool) -> int:
    """The output directory for these settings: how many input records are done (0 for a fresh start)."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, RUN_FILE)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            before = json.load(f)
        changed = differing_fields(before, fingerprint)
        if changed and not overwrite:
            raise UserError(
                f"output_dir {output_dir} holds critiques made with other settings (differing: {', '.join(changed)}). "
                "Fix: choose another output_dir, or set overwrite_output_dir true to start afresh there"
            )
        if changed or overwrite:
            for name in (OUT_FILE, DONE_FILE, REPORT_FILE):
                if os.path.exists(os.path.join(output_dir, name)):
                    os.remove(os.path.join(output_dir, name))
    with open(path, "w", encoding="utf-8") as f:
        json.dump(fingerprint, f, indent=1, sort_keys=True)
    done = [json.loads(line) for line in _whole_lines(os.path.join(output_dir, DONE_FILE))]
    written = sum(1 for d in done if d["written"])
    for name, keep in ((OUT_FILE, written), (DONE_FILE, len(done))):  # cut a torn line or a record without done
        lines = _whole_lines(os.path.join(output_dir, name))[:keep]
        with open(os.path.join(output_dir, name), "w", encoding="utf-8") as f:
            f.writelines(lines)
    return len(done)


def build_judge(args: CritiqueArguments):
    """prompts -> critique texts, by the judge model on its engine (greedy at temperature 0); None: templates."""
    if not args.judge_model_name_or_path:
        return None
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(args.tokenizer_name_or_path or args.judge_model_name_or_path)
    model = load_model(
        AutoModelForCausalLM,
        args.judge_model_name_or_path,
        init_from_config=args.init_from_config,
        seed=args.seed,
        dtype=torch.bfloat16 if args.bf16 else torch.float32,
        pad_token_id=tok.pad_token_id,
    ).to("cuda" if torch.cuda.is_available() else "cpu")
    chat = resolve_chat_template(args.use_chat_template, tok)
    temperature = args.temperature or 1.0
    if args.engine == "vllm":
        length = getattr(model.config, "max_position_embeddings", 4096)
        generate = vllm_engine(
            model, tok, temperature, length, args.seed, args.vllm_gpu_memory_utilization, args.generation_batch_size
        )
    else:
        generate = hf_engine(model, tok, temperature)

    def judge(prompts: list[str], seed: int) -> list[str]:
        ids = [render_prompt([{"role": "user", "content": p}], tok, chat) for p in prompts]
        out: list[str] = []
        for part, start in enumerate(range(0, len(ids), args.generation_batch_size)):
            responses = generate(
                ids[start : start + args.generation_batch_size],
                num_samples=1,
                max_new_tokens=args.max_new_tokens,
                do_sample=args.temperature > 0,
                top_p=1.0,
                top_k=0,
                seed=seed + part,
            )
            out += [tok.decode(r, skip_special_tokens=True) for r in responses]
        return out

    return judge


def run_critiques(args: CritiqueArguments) -> dict:
    """Every record's critiques, appended per record; the report (also in ``report.json``)."""
    tokens = args.label_tokens
    records = load_dataset_records(
        args.data_path, "prm", seed=args.seed, reward_tokens=tokens, placeholder=args.placeholder_token,
        map_keys=args.map_keys,
    )  # fmt: skip
    records = records[: args.max_records] if args.max_records else records
    done = claim(args.output_dir, run_fingerprint(args).values, args.overwrite_output_dir)
    if done:
        logger.info("%s: %d of %d records done before: resuming after them", args.output_dir, done, len(records))
    judge = build_judge(args) if done < len(records) else None
    templates = (args.positive_template, args.negative_template)
    counts: Counter = Counter()
    out_path, done_path = os.path.join(args.output_dir, OUT_FILE), os.path.join(args.output_dir, DONE_FILE)
    for i in range(done, len(records)):
        call = None if judge is None else (lambda prompts, i=i: judge(prompts, args.seed * 1_000_003 + i))
        row = critiques_for(records[i], tokens, templates, call, args.judge_prompt, counts)
        if row is not None:
            with open(out_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        with open(done_path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"index": i, "written": row is not None}) + "\n")
    report = {"records_in": len(records), "resumed_after": done, **counts}
    report["records_written"] = len(_whole_lines(out_path))
    with open(os.path.join(args.output_dir, REPORT_FILE), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, sort_keys=True)
    logger.info("critiques: %s (%s)", out_path, ", ".join(f"{k} {v}" for k, v in sorted(report.items())))
    return report
