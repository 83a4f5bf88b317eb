"""PRM step labels made from rollouts: every step of a solution (given, or written by the policy) completed
num_completions times by a completer model and checked by a verifier; Math-Shepherd's estimates or OmegaPRM's
binary search and tree search; optional consensus with a judge. Writes PaddleNLP PRM records with soft_labels
(output_dir/labels.jsonl, which run_reward.py trains on) and report.json; a rerun resumes.

python llm/run_label.py llm/config/tiny/label_argument.json [--field value ...]
torchrun --nproc_per_node 8 llm/run_label.py llm/config/smollm2/label_argument.json
python llm/run_label.py llm/config/smollm2/label_argument.json --ray_workers 4
"""

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llm.settings.label import LABEL_ARGUMENT_TYPES, validate_label_arguments
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
    (args,) = parse_arguments(argv, LABEL_ARGUMENT_TYPES, paddle={})
    validate_label_arguments(args, argv[0])
    # the model code only now: a config or path error above shows in seconds
    from llm.alignment.label.completer import StuckCompleter
    from llm.alignment.label.run import init_processes, run_labelling

    init_processes()
    try:
        with run_guard(args.output_dir, trains=False):
            run_labelling(args, argv[0])
    except StuckCompleter as err:  # its thread cannot be stopped: exit 2 now, skipping the interpreter's shutdown
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(2)


if __name__ == "__main__":
    run_cli(main)
