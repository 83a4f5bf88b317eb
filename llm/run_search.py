"""PRM-guided search, evaluation only: a policy writes solutions step by step, a process reward model scores each
step, and step-level beam search, diverse verifier tree search (DVTS) and best-of-N (with majority and weighted
vote) are compared at the same budgets N (llm/alignment/search/).

python llm/run_search.py llm/config/tiny/search_argument.json [--section.field value ...]
python llm/run_search.py llm/config/smollm2/search_argument.json --search.budgets [4,8]

Writes output_dir/search_results.jsonl (per problem: each method's chosen solution and its tree's scores) and
output_dir/search_metrics.json (accuracy against N per method).
"""

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llm.settings.load import parse_search_config
from llm.utils.errors import run_cli
from llm.utils.logging import configure_logging, log_config_notes
from llm.utils.rundir import run_guard
from llm.utils.threads import choose_threads


def main(argv: list[str] | None = None) -> dict:
    configure_logging(logging.INFO)
    choose_threads()  # unless OMP_NUM_THREADS says otherwise (llm/utils/threads.py)
    config = parse_search_config(sys.argv[1:] if argv is None else argv)
    log_config_notes(list(config.notes), config.source)
    # the model code only now: a config or path error above shows in seconds, before these heavy imports
    from llm.alignment.search.run import run_search

    with run_guard(config.search.output_dir, trains=False, field="search.output_dir"):
        return run_search(config)


if __name__ == "__main__":
    run_cli(main)
