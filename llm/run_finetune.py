"""Supervised fine-tuning (SFT): train and/or evaluate a causal LM on prompt/response data.

python llm/run_finetune.py llm/config/tiny/sft_argument.json [--field value ...]
torchrun --nproc_per_node 8 llm/run_finetune.py llm/config/llama/sft_argument.json

The loss is on response tokens only (every assistant turn of a multi-turn conversation); evaluation
reports eval_loss (mean NLL per response token) and eval_ppl = exp(eval_loss).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llm.settings.flat import validate_arguments
from llm.settings.load import parse_arguments
from llm.utils.errors import run_cli
from llm.utils.logging import setup_logging
from llm.utils.threads import choose_threads


def main(argv: list[str] | None = None) -> None:
    model_args, data_args, training_args = parse_arguments(sys.argv[1:] if argv is None else argv)
    validate_arguments(model_args, data_args, training_args)
    setup_logging(training_args)
    choose_threads()  # unless OMP_NUM_THREADS says otherwise (llm/utils/threads.py)
    # the model code only now: a config or path error above shows in seconds, before these heavy imports
    from llm.alignment.context import RunContext
    from llm.alignment.runner import output_dir_guard, train_and_evaluate
    from llm.alignment.sft.build import build_sft_trainer

    run = RunContext.load(model_args, data_args, training_args)  # the tokenizer and what it decides, once
    with output_dir_guard(run):
        trainer, train, dev = build_sft_trainer(run)
        train_and_evaluate(trainer, data_args, training_args, train, dev)


if __name__ == "__main__":
    run_cli(main)
