"""PPO with four roles (actor, reference, critic, reward) from one config file: JSON or YAML, in this project's
layout or in MindSpeed-LLM's own (its configs/rlxf/ppo_trainer_*.yaml as they are; llm/settings/dialects/mindspeed/).

python llm/run_ppo.py llm/config/tiny/ppo_argument.json [--section.field value ...]
python llm/run_ppo.py llm/config/tiny/ppo_ray_argument.json      # roles in Ray actors (resource_pool)
python llm/run_ppo.py configs/rlxf/ppo_trainer_llama32_1b.yaml   # a MindSpeed-LLM file (its model/*.yaml beside it)
cd llm && python run_ppo.py config/tiny/ppo_argument.json        # relative paths: working directory, then repo root
"""

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llm.alignment.ppo.build import PPOContext, build_ppo, load_prompts, placed_roles
from llm.settings.load import parse_ppo_config
from llm.utils.checkpoints import final_model_complete, latest_checkpoint
from llm.utils.errors import run_cli
from llm.utils.logging import configure_logging
from llm.utils.rundir import run_guard
from llm.utils.threads import choose_threads


def main(argv: list[str] | None = None) -> None:
    configure_logging(logging.INFO)
    choose_threads()  # unless OMP_NUM_THREADS says otherwise (llm/utils/threads.py)
    config = parse_ppo_config(sys.argv[1:] if argv is None else argv)
    t = config.training
    # Before any model loads (not at the final save): output_dir writable, locked for this run (by the driver,
    # on Ray) and not another run's; SIGTERM handled from here on.
    guard = run_guard(t.output_dir, t.resume_from_checkpoint, t.overwrite_output_dir, field="training.output_dir")
    with guard:
        run = PPOContext.load(config)  # the tokenizers and what they decide, once; the fingerprint on first use
        fingerprint = run.fingerprint if t.resume_from_checkpoint else None  # the same one the trainer then saves
        resume = latest_checkpoint(t.resume_from_checkpoint, t.output_dir, fingerprint)
        prompts = load_prompts(config, run)
        with placed_roles(config, run) as roles:
            trainer = build_ppo(config, prompts, roles, run)
            if resume:
                trainer.load_checkpoint(resume)
                if trainer.finished and not final_model_complete(t.output_dir, trainer.step):
                    logging.getLogger("llm.run_ppo").warning(
                        "%s: the final save did not finish: saving it", t.output_dir
                    )
                    trainer.save_final()
                if trainer.finished:
                    logging.getLogger("llm.run_ppo").warning(
                        "%s is at step %d of training.max_steps=%d: the run is already complete, nothing to train "
                        "(raise max_steps to train on)",
                        resume,
                        trainer.step,
                        t.max_steps,
                    )
                    return
            trainer.train()


if __name__ == "__main__":
    run_cli(main)
