"""Train and/or evaluate an outcome (ORM) or process (PRM) reward model.

python llm/run_reward.py llm/config/tiny/prm_argument.json [--field value ...]
torchrun --nproc_per_node 2 llm/run_reward.py llm/config/mistral/prm_argument.json
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llm.settings.dialects.paddle import PADDLE_REWARD_NAMES
from llm.settings.flat import validate_arguments
from llm.settings.load import parse_arguments
from llm.settings.reward import REWARD_ARGUMENT_TYPES
from llm.utils.errors import run_cli
from llm.utils.logging import setup_logging
from llm.utils.threads import choose_threads


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    model_args, data_args, training_args = parse_arguments(argv, REWARD_ARGUMENT_TYPES, paddle=PADDLE_REWARD_NAMES)
    validate_arguments(model_args, data_args, training_args)
    setup_logging(training_args)
    choose_threads()  # unless OMP_NUM_THREADS says otherwise (llm/utils/threads.py)
    # the model code only now: a config or path error above shows in seconds, before these heavy imports
    from llm.alignment.context import RunContext
    from llm.alignment.rm.build import build_reward_trainer
    from llm.alignment.runner import output_dir_guard, train_and_evaluate

    run = RunContext.load(model_args, data_args, training_args)  # the tokenizer and what it decides, once
    with output_dir_guard(run):
        trainer, train, dev = build_reward_trainer(run)
        train_and_evaluate(trainer, data_args, training_args, train, dev)


if __name__ == "__main__":
    run_cli(main)
