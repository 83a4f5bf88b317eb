"""Train and/or evaluate an outcome (ORM) or process (PRM) reward model.

python llm/run_reward.py llm/config/tiny/prm_argument.json [--field value ...]
torchrun --nproc_per_node 2 llm/run_reward.py llm/config/mistral/prm_argument.json
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llm.alignment.rm.build import build_reward_trainer, write_json, write_scores
from llm.utils.arguments import parse_arguments, validate_arguments
from llm.utils.errors import run_cli
from llm.utils.logging import resume_checkpoint, setup_logging


def main(argv: list[str] | None = None) -> None:
    model_args, data_args, training_args = parse_arguments(sys.argv[1:] if argv is None else argv)
    validate_arguments(model_args, data_args, training_args)
    setup_logging(training_args)
    trainer, _train, dev = build_reward_trainer(model_args, data_args, training_args)
    out = training_args.output_dir
    results = {}
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=resume_checkpoint(training_args))
        if trainer.stopped_by_signal:
            return  # checkpoint saved; resume with resume_from_checkpoint=auto
        if not (data_args.benchmark or data_args.autotuner_benchmark):
            trainer.save_model(out)
            trainer.save_state()
        results.update({f"train_{k}" if not k.startswith("train") else k: v for k, v in result.metrics.items()})
    if training_args.do_eval:
        metrics, examples = trainer.evaluate_with_outputs()
        results.update(metrics)
        if trainer.is_world_process_zero():
            write_json(os.path.join(out, "eval_results.json"), metrics)
            write_scores(os.path.join(out, "eval_scores.jsonl"), examples, dev.records)
    if trainer.is_world_process_zero() and results:
        write_json(os.path.join(out, "all_results.json"), results)


if __name__ == "__main__":
    run_cli(main)
