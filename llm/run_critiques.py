"""A generative PRM's training data: a critique for every labelled step of step-labelled PRM records, written by a
template (by label) or by a judge model told the label (HF or vLLM engine). Writes PaddleNLP PRM records with a
``critiques`` list (output_dir/critiques.jsonl, which run_reward.py with prm_kind generative trains on), appended
per finished record, and report.json; a rerun resumes.

python llm/run_critiques.py llm/config/tiny/critiques_argument.json [--field value ...]
"""

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llm.settings.critiques import CRITIQUE_ARGUMENT_TYPES, validate_critique_arguments
from llm.settings.load import parse_arguments
from llm.utils.errors import run_cli
from llm.utils.logging import configure_logging
from llm.utils.rundir import run_guard
from llm.utils.threads import choose_threads


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    configure_logging(logging.WARNING)  # transformers' INFO lines (each model's config) are noise here
    logging.getLogger("llm").setLevel(logging.INFO)
    choose_threads()  # unless OMP_NUM_THREADS says otherwise (llm/utils/threads.py)
    (args,) = parse_arguments(argv, CRITIQUE_ARGUMENT_TYPES, paddle={})
    validate_critique_arguments(args, argv[0])
    # the model code only now: a config or path error above shows in seconds
    from llm.alignment.critique.run import run_critiques

    with run_guard(args.output_dir, trains=False):
        run_critiques(args)


if __name__ == "__main__":
    run_cli(main)
