"""PPO with four roles (actor, reference, critic, reward) from one MindSpeed-style JSON file.

python llm/run_ppo.py llm/config/tiny/ppo_argument.json [--section.field value ...]
"""

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llm.alignment.ppo.build import build_ppo
from llm.alignment.ppo.config import parse_ppo_config
from llm.utils.checkpoints import latest_checkpoint
from llm.utils.errors import run_cli
from llm.utils.logging import configure_logging


def main(argv: list[str] | None = None) -> None:
    configure_logging(logging.INFO)
    config = parse_ppo_config(sys.argv[1:] if argv is None else argv)
    trainer = build_ppo(config)
    resume = latest_checkpoint(config.training.resume_from_checkpoint, config.training.output_dir)
    if resume:
        trainer.load_checkpoint(resume)
    trainer.train()


if __name__ == "__main__":
    run_cli(main)
