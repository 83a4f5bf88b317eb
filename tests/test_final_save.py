"""The final model is never written in place (issue 22, item 5): a save that dies half-way leaves no
half-written model.safetensors in output_dir, the resumed run (already complete) saves it again. A full disk
during a checkpoint or the final save (issue 26, item 6), for the flat trainers and PPO, as an OSError or as
safetensors' error: one message and exit 2 naming the last complete checkpoint, the unfinished save removed,
nothing complete lost."""

import errno
import json
import os

import pytest
import torch
import transformers.modeling_utils
from safetensors.torch import load_file

from llm.run_reward import main as reward_main
from llm.utils.checkpoints import FINAL_MARKER, FINAL_STAGING
from llm.utils.disk_full import human
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


# what safetensors raises when the disk fills (read from a real full tmpfs, safetensors 0.8)
SAFETENSORS_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"


@pytest.mark.parametrize("kind", ["OSError", "SafetensorError"])
def test_a_full_disk_while_saving_the_final_model_is_one_message(tmp_path, monkeypatch, capsys, kind):
    """The final save runs out of space: exit 2, one message naming output_dir, the space, and checkpoint-2 (the
    last complete checkpoint); the staging directory is removed and checkpoint-2 is whole."""
    from safetensors import SafetensorError

    from llm.utils.checkpoints import checkpoint_problem

    out = tmp_path / "out"
    if kind == "OSError":
        err = OSError(errno.ENOSPC, "No space left on device", str(out / FINAL_STAGING / "model.safetensors"))
    else:
        err = SafetensorError(SAFETENSORS_FULL)
    dying_save(monkeypatch, err)
    with pytest.raises(SystemExit) as info:
        run_cli(reward_main, argv(out))
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err and err.count("error: ") == 1, err[-3000:]
    assert f"error: no space left on device saving the final model in output_dir {out} (it had written " in err
    assert "free there now); the unfinished save was removed. Free space, or point output_dir elsewhere" in err
    assert (
        f"the last complete checkpoint is {out / 'checkpoint-2'}: with the space freed resume_from_checkpoint " in err
    )
    assert f"(in another output_dir: resume_from_checkpoint {out / 'checkpoint-2'})" in err
    assert not (out / "model.safetensors").exists() and not (out / FINAL_STAGING).exists()
    assert checkpoint_problem(str(out / "checkpoint-2")) is None


def failing_safetensors(monkeypatch, where: str):
    """safetensors' writers (the library's own and transformers' alias) raise a full disk for files under
    ``where``; the rest is written."""
    import safetensors.torch
    from safetensors import SafetensorError

    for module, name in ((safetensors.torch, "save_file"), (transformers.modeling_utils, "safe_save_file")):
        real = getattr(module, name)

        def save(tensors, filename, metadata=None, _real=real):
            if where in str(filename):
                raise SafetensorError(SAFETENSORS_FULL)
            return _real(tensors, filename, metadata=metadata)

        monkeypatch.setattr(module, name, save)


def test_a_full_disk_while_saving_a_checkpoint_keeps_the_last_complete_one(tmp_path, monkeypatch, capsys):
    """checkpoint-4 runs out of space (safetensors' error): exit 2 naming checkpoint-2 and the size of a checkpoint;
    checkpoint-4.partial is removed, checkpoint-2 is whole, and the run resumes from it to the end."""
    from llm.utils.checkpoints import checkpoint_problem, read_marker

    out = tmp_path / "out"
    cli = [CONFIG, "--output_dir", str(out), "--max_steps", "4", "--save_steps", "2", "--do_eval", "false"]
    cli += ["--report_to", "none", "--disable_tqdm", "true"]
    failing_safetensors(monkeypatch, "checkpoint-4.partial")
    with pytest.raises(SystemExit) as info:
        run_cli(reward_main, cli)
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err and "SafetensorError" not in err, err[-3000:]
    size = sum(read_marker(str(out / "checkpoint-2"))["files"].values())
    assert f"error: no space left on device saving checkpoint-4 in output_dir {out}" in err
    assert f"a complete checkpoint of this run takes {human(size)}" in err
    assert f"the last complete checkpoint is {out / 'checkpoint-2'}" in err
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert checkpoint_problem(str(out / "checkpoint-2")) is None
    monkeypatch.undo()
    reward_main([*cli, "--resume_from_checkpoint", "auto"])  # space freed: on from checkpoint-2
    assert json.loads((out / FINAL_MARKER).read_text())["step"] == 4


def test_a_full_disk_while_ppo_saves_is_one_message_and_resumes(tmp_path, monkeypatch, capsys):
    """PPO: checkpoint-4's actor runs out of space (safetensors' error, through transformers' save_pretrained):
    exit 2 naming training.output_dir and checkpoint-2; checkpoint-4.partial is removed; the resumed run ends at
    step 4 with its final model."""
    from llm.run_ppo import main as ppo_main
    from llm.utils.checkpoints import checkpoint_problem, final_model_complete
    from tests.test_ppo_run import config as ppo_config

    monkeypatch.chdir(ROOT)
    out = tmp_path / "ppo"
    cfg = ppo_config(tmp_path, training={"max_steps": 4, "save_steps": 2, "output_dir": str(out)})
    failing_safetensors(monkeypatch, "checkpoint-4.partial")
    with pytest.raises(SystemExit) as info:
        run_cli(ppo_main, [cfg])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err, err[-3000:]
    assert f"error: no space left on device saving checkpoint-4 in training.output_dir {out}" in err
    assert "Free space, or point training.output_dir elsewhere" in err
    assert f"the last complete checkpoint is {out / 'checkpoint-2'}: with the space freed training." in err
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert checkpoint_problem(str(out / "checkpoint-2")) is None
    monkeypatch.undo()
    monkeypatch.chdir(ROOT)
    ppo_main([cfg, "--training.resume_from_checkpoint", "auto"])
    assert final_model_complete(str(out), 4)


def test_disk_full_is_told_apart_from_other_errors():
    from safetensors import SafetensorError

    from llm.utils.errors import DiskFull, is_disk_full

    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert is_disk_full(SafetensorError(SAFETENSORS_FULL)) and is_disk_full(DiskFull("x"))
    try:  # raised while handling one (transformers wrapping the writer's error)
        try:
            raise SafetensorError(SAFETENSORS_FULL)
        except SafetensorError as inner:
            raise RuntimeError("saving failed") from inner
    except RuntimeError as outer:
        assert is_disk_full(outer)
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not is_disk_full(SafetensorError("Error while serializing: I/O error: Permission denied (os error 13)"))
    assert not is_disk_full(ValueError("bad"))


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


def test_a_roles_disk_full_reaches_the_drivers_save_as_one_message(tmp_path):
    """A PPO role on Ray turns the writer's error into DiskFull (a UserError, which Ray's wait re-raises as itself:
    ray_roles.wait); the driver's save then removes checkpoint-6.partial and names the last complete checkpoint."""
    from safetensors import SafetensorError

    from llm.utils.checkpoints import begin_checkpoint, finish_checkpoint
    from llm.utils.disk_full import disk_full_as_error, saving
    from llm.utils.errors import DiskFull, UserError

    out = tmp_path / "out"
    partial = begin_checkpoint(str(out / "checkpoint-4"), is_main=True)
    (out / "checkpoint-4.partial" / "state.json").write_text("{}")
    finish_checkpoint(partial, str(out / "checkpoint-4"), 4)
    role = disk_full_as_error(str(out / "checkpoint-6.partial" / "actor"))
    with pytest.raises(DiskFull, match="no space left on device writing .*actor"), role:
        raise SafetensorError(SAFETENSORS_FULL)
    save = saving(str(out), str(out / "checkpoint-6.partial"), "checkpoint-6", field="training.output_dir")
    with pytest.raises(UserError) as info, save:
        begin_checkpoint(str(out / "checkpoint-6"), is_main=True)
        (out / "checkpoint-6.partial" / "half").write_bytes(b"x" * 2048)
        raise DiskFull("no space left on device writing the actor")  # as ray_roles.wait re-raises it
    message = str(info.value)
    assert message.startswith(f"no space left on device saving checkpoint-6 in training.output_dir {out} (it had ")
    assert "written 2.0 KiB; a complete checkpoint of this run takes 2 bytes;" in message
    assert f"the last complete checkpoint is {out / 'checkpoint-4'}: with the space freed training." in message
    assert sorted(os.listdir(out)) == ["checkpoint-4"]
    with pytest.raises(ValueError, match="not a full disk"), saving(str(out), str(out / "x.partial"), "checkpoint-8"):
        raise ValueError("not a full disk")  # anything else passes unchanged
