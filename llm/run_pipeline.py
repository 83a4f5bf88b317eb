"""The OpenLLaMA2 workflow on the bundled tiny default: SFT -> reward model (ORM) -> PPO, then a report.

    python llm/run_pipeline.py [--output_dir output/pipeline] [--ppo_steps 30] [--overwrite]

Each stage is the ordinary entry point with the tiny config and a few overrides, so this is also a
recipe for real models: swap the configs. The report compares the SFT and PPO policies' greedy
answers on held-out prompts, scored by the trained reward model and by exact match.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from llm import run_finetune, run_ppo, run_reward
from llm.alignment.ppo.prompts import make_samples, prompts_from_records
from llm.alignment.ppo.rewards import ORMReward
from llm.alignment.ppo.rewards.rule_functions import math_exact_match
from llm.alignment.ppo.roles import PolicyModel
from llm.data.readers import read_records
from llm.utils import run_files
from llm.utils.attention import PACKED_SDPA
from llm.utils.errors import UserError, run_cli
from llm.utils.modeling import load_tokenizer, model_stop_ids
from llm.utils.rundir import check_output_dir, check_own_directory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "llm", "config", "tiny")
HELD_OUT = 50
STAGES = ("sft_before", "sft", "rm", "ppo")  # each stage's output_dir, in --output_dir
# every name the pipeline writes in --output_dir: the stages, their configs, the prompts split, the report
WRITTEN = (
    *STAGES,
    "sft.json",
    "rm.json",
    "ppo.json",
    "prompts_train.jsonl",
    "prompts_heldout.jsonl",
    "pipeline_report.json",
)


def _json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _config(name: str, out: str, **overrides) -> str:
    cfg = _json(os.path.join(TINY, name))
    cfg.update(overrides)
    path = os.path.join(out, f"{name.replace('_argument', '')}")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=1, ensure_ascii=False)
    return path


def split_prompts(out: str) -> tuple[str, str]:
    with open(os.path.join(ROOT, "llm", "data", "sample", "prompts.jsonl"), encoding="utf-8") as f:
        lines = f.readlines()
    train, held = os.path.join(out, "prompts_train.jsonl"), os.path.join(out, "prompts_heldout.jsonl")
    with open(train, "w", encoding="utf-8") as f:
        f.writelines(lines[:-HELD_OUT])
    with open(held, "w", encoding="utf-8") as f:
        f.writelines(lines[-HELD_OUT:])
    return train, held


@torch.no_grad()
def compare_policies(sft_dir: str, ppo_dir: str, rm_dir: str, held_out: str, max_new_tokens: int) -> dict:
    tok = load_tokenizer(sft_dir)
    prompts = prompts_from_records(read_records(held_out, "prompt"), tok, 256, False)
    reward_model = AutoModelForSequenceClassification.from_pretrained(rm_dir, attn_implementation=PACKED_SDPA).eval()
    orm = ORMReward(reward_model, tok, tok, 16)
    result = {}
    for name, path in (("sft", sft_dir), ("ppo", ppo_dir)):
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=PACKED_SDPA).eval()
        policy, stops = PolicyModel(model, tok, 1.0, 16), model_stop_ids(model, tok)
        responses = policy.generate(
            [p.ids for p in prompts],
            num_samples=1,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            top_p=1.0,
            top_k=0,
            stop_ids=stops,
        )
        samples = make_samples(prompts, responses, tok, stops)
        scores = orm.score(samples).scores
        exact = [
            math_exact_match(p, r, ref) for p, r, ref in zip(samples.prompts, samples.responses, samples.references)
        ]
        result[name] = {
            "reward_model_score": scores.mean().item(),
            "exact_match": sum(exact) / len(exact),
            "example": samples.responses[0],
        }
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="output/pipeline")
    parser.add_argument("--ppo_steps", type=int, default=30)
    parser.add_argument(
        "--overwrite", action="store_true", help="run again over an output_dir that holds an earlier pipeline's run"
    )
    args = parser.parse_args(argv)
    out = os.path.abspath(args.output_dir)
    check_output_dir(out, "--output_dir")
    check_own_directory(out, "--output_dir")  # a user's files there: refused, whatever --overwrite says
    earlier = [d for d in STAGES if os.path.isdir(os.path.join(out, d))]
    if earlier and not args.overwrite:
        raise UserError(
            f"--output_dir {args.output_dir} holds an earlier pipeline run ({', '.join(earlier)}): add --overwrite to "
            "run again there (files of the same name are written over), or give another --output_dir"
        )
    os.makedirs(out, exist_ok=True)
    run_files.record(out, WRITTEN)  # before they are written: what this pipeline writes there is its own
    again = {"overwrite_output_dir": True} if args.overwrite else {}
    sft_dir, rm_dir, ppo_dir = (os.path.join(out, d) for d in ("sft", "rm", "ppo"))

    # 1. SFT, with an evaluation of the untrained model first ("before").
    run_finetune.main(
        [
            _config(
                "sft_argument.json",
                out,
                output_dir=os.path.join(out, "sft_before"),
                do_train=False,
                report_to="none",
                eval_random_init=True,  # the untrained (random) model, on purpose: the "before" figure
            )
        ]
    )
    run_finetune.main([_config("sft_argument.json", out, output_dir=sft_dir, save_strategy="no", **again)])
    # 2. Outcome reward model from the SFT model (its backbone; a new score head).
    run_reward.main(
        [
            _config(
                "rm_argument.json",
                out,
                model_name_or_path=sft_dir,
                tokenizer_name_or_path=sft_dir,
                init_from_config=False,
                output_dir=rm_dir,
                save_strategy="no",
                **again,
            )
        ]
    )
    # 3. PPO: actor and reference from SFT, critic and reward from the reward model.
    train_prompts, held_out = split_prompts(out)
    ppo = _json(os.path.join(TINY, "ppo_argument.json"))
    ppo["training"].update(output_dir=ppo_dir, max_steps=args.ppo_steps, save_steps=0, disable_tqdm=True, **again)
    ppo["actor_rollout"].update(
        model_name_or_path=sft_dir,
        tokenizer_name_or_path=sft_dir,
        init_from_config=False,
        learning_rate=2e-5,
        max_response_length=48,
    )
    ppo["critic"].update(learning_rate=1e-4)
    ppo["reward"] = {"type": "orm", "model_name_or_path": rm_dir}
    ppo["data"]["train_dataset_path"] = train_prompts
    ppo_path = os.path.join(out, "ppo.json")
    with open(ppo_path, "w", encoding="utf-8") as f:
        json.dump(ppo, f, indent=1)
    run_ppo.main([ppo_path])

    # 4. Report.
    before = _json(os.path.join(out, "sft_before", "eval_results.json"))
    after = _json(os.path.join(sft_dir, "eval_results.json"))
    rm = _json(os.path.join(rm_dir, "eval_results.json"))
    history = _json(os.path.join(ppo_dir, "log_history.json"))
    k = max(1, len(history) // 5)
    start = sum(h["score"] for h in history[:k]) / k
    end = sum(h["score"] for h in history[-k:]) / k
    compare = compare_policies(sft_dir, os.path.join(ppo_dir, "actor"), rm_dir, held_out, 48)
    report = {
        "sft_eval_loss_before": before["eval_loss"],
        "sft_eval_loss_after": after["eval_loss"],
        "reward_model_accuracy": rm["eval_accuracy"],
        f"ppo_reward_first_{k}_steps": start,
        f"ppo_reward_last_{k}_steps": end,
        "held_out": compare,
    }
    with open(os.path.join(out, "pipeline_report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    print("\n=== pipeline report ===")
    print(f"SFT eval loss: {before['eval_loss']:.3f} -> {after['eval_loss']:.3f}")
    print(f"reward model pair accuracy (dev): {rm['eval_accuracy']:.3f}")
    print(f"PPO reward-model score: first {k} steps {start:.3f} -> last {k} steps {end:.3f}")
    print(f"held-out prompts ({HELD_OUT}), greedy answers scored by the reward model / exact match:")
    for name in ("sft", "ppo"):
        c = compare[name]
        print(f"  {name}: reward {c['reward_model_score']:.3f}, exact match {c['exact_match']:.2f}")
    print(f"report: {os.path.join(out, 'pipeline_report.json')}")


if __name__ == "__main__":
    run_cli(main)
