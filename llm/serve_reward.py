"""Serve a trained ORM or PRM over HTTP for PPO's ``reward.type: http`` (protocol: llm/alignment/rm/serve.py).

python llm/serve_reward.py llm/config/tiny/prm_argument.json --model_name_or_path output/tiny_prm \
    --init_from_config false --port 8000 [--prm_aggregation min]

The config is a reward config as ``run_reward.py`` reads it (model, tokenizer, process_reward, placeholder and
reward tokens); training and data fields are accepted and unused. Stop it with Ctrl-C or SIGTERM.
"""

import logging
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llm.alignment.rm.serve import ServeArgument, build_scorer, make_server
from llm.settings.dialects.paddle import PADDLE_REWARD_NAMES
from llm.settings.load import parse_arguments
from llm.settings.reward import REWARD_ARGUMENT_TYPES
from llm.utils.errors import run_cli
from llm.utils.logging import setup_logging
from llm.utils.threads import choose_threads

logger = logging.getLogger("llm.serve_reward")
STOP_WAIT = 120  # seconds a stop waits for the request being scored


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    model_args, data_args, training_args, serve_args = parse_arguments(
        argv, (*REWARD_ARGUMENT_TYPES, ServeArgument), paddle=PADDLE_REWARD_NAMES
    )
    setup_logging(training_args)
    choose_threads()  # unless OMP_NUM_THREADS says otherwise (llm/utils/threads.py)
    scorer = build_scorer(model_args, training_args, serve_args, data_args.max_seq_len)
    server = make_server(scorer, serve_args)
    host, port = server.server_address[:2]
    signal.signal(signal.SIGTERM, _interrupt)
    logger.warning(
        "serving the %s %s on http://%s:%d (GET /health, POST /)", scorer.kind, scorer.model_path, host, port
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        # a request being scored holds the lock inside torch: exiting under it aborts the process ("terminate called
        # without an active exception"); new requests get 503 while it finishes
        scorer.stopping = True
        if scorer.lock.acquire(timeout=STOP_WAIT):
            logger.warning("stopped")
        else:
            logger.warning("stopped after %d s with a request still being scored", STOP_WAIT)
    finally:
        server.server_close()


if __name__ == "__main__":
    run_cli(main)
