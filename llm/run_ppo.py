"""PPO with four roles (actor, reference, critic, reward) from one config file: JSON or YAML, in this project's
layout or in MindSpeed-LLM's own (its configs/rlxf/ppo_trainer_*.yaml as they are; llm/alignment/ppo/mindspeed.py).

python llm/run_ppo.py llm/config/tiny/ppo_argument.json [--section.field value ...]
python llm/run_ppo.py llm/config/tiny/ppo_ray_argument.json      # roles in Ray actors (resource_pool)
python llm/run_ppo.py configs/rlxf/ppo_trainer_llama32_1b.yaml   # a MindSpeed-LLM file (its model/*.yaml beside it)
cd llm && python run_ppo.py config/tiny/ppo_argument.json        # relative paths: working directory, then repo root
"""

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llm.alignment.ppo.build import build_ppo, load_prompts, placed_roles
from llm.alignment.ppo.config import parse_ppo_config
from llm.utils.checkpoints import latest_checkpoint
from llm.utils.errors import run_cli
from llm.utils.logging import configure_logging


def main(argv: list[str] | None = None) -> None:
    configure_logging(logging.INFO)
    config = parse_ppo_config(sys.argv[1:] if argv is None else argv)
    resume = latest_checkpoint(config.training.resume_from_checkpoint, config.training.output_dir)
    prompts = load_prompts(config)
    with placed_roles(config) as roles:
        trainer = build_ppo(config, prompts, roles)
        if resume:
            trainer.load_checkpoint(resume)
        trainer.train()


if __name__ == "__main__":
    run_cli(main)
