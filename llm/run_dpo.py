"""Direct preference optimisation (DPO; also IPO, hinge, SimPO, ORPO by loss_type) on preference pairs.

python llm/run_dpo.py llm/config/tiny/dpo_argument.json [--field value ...]
torchrun --nproc_per_node 8 llm/run_dpo.py llm/config/llama/dpo_argument.json

Evaluation reports TRL's metrics (rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies,
logps/chosen, logps/rejected) and writes them per pair to eval_scores.jsonl.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llm.settings.dpo import DPO_ARGUMENT_TYPES
from llm.settings.flat import validate_arguments
from llm.settings.load import parse_arguments
from llm.utils.errors import run_cli
from llm.utils.logging import setup_logging
from llm.utils.threads import choose_threads


def main(argv: list[str] | None = None) -> None:
    model_args, data_args, training_args = parse_arguments(sys.argv[1:] if argv is None else argv, DPO_ARGUMENT_TYPES)
    validate_arguments(model_args, data_args, training_args)
    setup_logging(training_args)
    choose_threads()  # unless OMP_NUM_THREADS says otherwise (llm/utils/threads.py)
    # the model code only now: a config or path error above shows in seconds, before these heavy imports
    from llm.alignment.context import RunContext
    from llm.alignment.dpo.build import build_dpo_trainer
    from llm.alignment.runner import output_dir_guard, train_and_evaluate

    run = RunContext.load(model_args, data_args, training_args)  # the tokenizer and what it decides, once
    with output_dir_guard(run):
        trainer, train, dev = build_dpo_trainer(run)
        train_and_evaluate(trainer, data_args, training_args, train, dev)


if __name__ == "__main__":
    run_cli(main)
