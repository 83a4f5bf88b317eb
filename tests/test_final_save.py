"""The final model is never written in place (issue 22, item 5): a save that dies half-way leaves no
half-written model.safetensors in output_dir, the resumed run (already complete) saves it again, and a full
disk is one message and exit 2."""

import errno
import json
import os

import pytest
import torch
import transformers.modeling_utils
from safetensors.torch import load_file

from llm.run_reward import main as reward_main
from llm.utils.checkpoints import FINAL_MARKER, FINAL_STAGING
from llm.utils.errors import run_cli
from tests.helpers import ROOT

CONFIG = os.path.join(ROOT, "llm", "config", "tiny", "rm_argument.json")


def argv(out, *extra):
    fixed = ["--max_steps", "2", "--save_steps", "2", "--do_eval", "false", "--report_to", "none"]
    return [CONFIG, "--output_dir", str(out), *fixed, "--disable_tqdm", "true", *extra]


def dying_save(monkeypatch, err: BaseException):
    """safetensors writes half of the final model's file, then ``err``; checkpoint saves are left alone."""
    real = transformers.modeling_utils.safe_save_file

    def save(tensors, filename, metadata=None):
        if FINAL_STAGING not in str(filename):
            return real(tensors, filename, metadata=metadata)
        real(tensors, filename, metadata=metadata)
        with open(filename, "rb") as f:
            data = f.read()
        with open(filename, "wb") as f:
            f.write(data[: len(data) // 2])
        raise err

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", save)


def test_a_final_save_stopped_half_way_is_redone_on_resume(tmp_path, monkeypatch):
    out = tmp_path / "out"
    dying_save(monkeypatch, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        reward_main(argv(out))
    assert not (out / "model.safetensors").exists()  # the half-written file stays in the staging directory
    assert (out / FINAL_STAGING / "model.safetensors").exists() and not (out / FINAL_MARKER).exists()
    assert (out / "checkpoint-2" / "model.safetensors").exists()

    monkeypatch.undo()
    reward_main(argv(out, "--resume_from_checkpoint", "auto"))  # already complete: saves the final model again
    assert json.loads((out / FINAL_MARKER).read_text())["step"] == 2
    assert not (out / FINAL_STAGING).exists()
    final, ckpt = load_file(out / "model.safetensors"), load_file(out / "checkpoint-2" / "model.safetensors")
    assert final.keys() == ckpt.keys() and all(torch.equal(final[k], ckpt[k]) for k in final)


def test_a_full_disk_while_saving_is_one_message(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    dying_save(monkeypatch, OSError(errno.ENOSPC, "No space left on device", str(out / FINAL_STAGING)))
    with pytest.raises(SystemExit) as info:
        run_cli(reward_main, argv(out))
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert f"error: no space left on device writing {out / FINAL_STAGING}" in err
    assert "resume_from_checkpoint auto" in err
    assert not (out / "model.safetensors").exists()


def test_ppo_final_model_is_renamed_in_and_saved_again_when_cut(tmp_path, monkeypatch):
    """PPO's final actor / critic go through output_dir/final.partial too: a final save that died before its rename
    leaves no marker, and resuming the complete run saves them again instead of reporting success."""
    from llm.run_ppo import main as ppo_main
    from llm.utils.checkpoints import final_model_complete
    from tests.test_ppo_run import config as ppo_config

    monkeypatch.chdir(ROOT)
    out = tmp_path / "ppo"
    cfg = ppo_config(tmp_path, training={"save_steps": 2, "output_dir": str(out), "report_to": "none"})
    ppo_main([cfg])
    assert final_model_complete(str(out), 2) and (out / "actor" / "model.safetensors").exists()
    assert not (out / FINAL_STAGING).exists()
    os.remove(out / FINAL_MARKER)  # as if the save had died between writing the files and the marker
    ppo_main([cfg, "--training.resume_from_checkpoint", "auto"])
    assert final_model_complete(str(out), 2)  # the marker is back: the resumed run saved the final model again
