"""Checkpoints you can trust (issue 11): atomic saves, auto-resume from the newest complete checkpoint of
this run, another run's checkpoints refused, nothing in a checkpoint run when loaded, and a resume of a
finished run changing nothing. Flat scripts through run_reward.py (PRM, tiny), PPO through run_ppo.py."""

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from llm.run_ppo import main as ppo_main
from llm.run_reward import main as reward_main
from llm.settings.fingerprint import run_fingerprint
from llm.utils.checkpoints import MARKER, checkpoint_problem, differing_fields, latest_checkpoint, load_tree, read_json
from llm.utils.errors import UserError, run_cli
from tests.helpers import ROOT
from tests.test_ppo_run import config as ppo_config
from tests.test_ppo_run import history as ppo_history
from tests.test_run_reward import config as reward_config
from tests.test_run_reward import small_split, train_losses

MARKER_FILE = "PAYLOAD_RAN"


class Payload:
    """Unpickling this creates ``path``: proof that a loader ran code from a checkpoint."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def flat_common(tmp_path, **overrides):
    common = {
        "train_dataset_path": small_split(tmp_path, "prm_train.jsonl", 40),
        "do_eval": False,
        "max_steps": 6,
        "save_strategy": "steps",
        "save_steps": 2,
        "lr_scheduler_type": "linear",
        "save_total_limit": None,
    }
    common.update(overrides)
    return common


def run_reward(tmp_path, out, **cfg):
    reward_main([reward_config(tmp_path, output_dir=str(out), **cfg)])


def reward_exit(tmp_path, capsys, out, **cfg):
    """run_cli's exit status (0: normal end) and stderr."""
    capsys.readouterr()
    try:
        run_cli(reward_main, [reward_config(tmp_path, output_dir=str(out), **cfg)])
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """An uninterrupted 6-step PRM run saving checkpoint-2, -4, -6 (shared by the flat tests of this module)."""
    tmp = tmp_path_factory.mktemp("full")
    common = flat_common(tmp)
    out = tmp / "out"
    run_reward(tmp, out, **common)
    return tmp, out, common


def test_fingerprint_ignores_where_and_how_often_and_names_what_differs(tmp_path):
    import functools

    from llm.settings.load import parse_arguments as parse
    from llm.settings.reward import REWARD_ARGUMENT_TYPES

    parse_arguments = functools.partial(parse, types=REWARD_ARGUMENT_TYPES)  # a reward config
    base = os.path.join(ROOT, "llm", "config", "tiny", "prm_argument.json")
    a = run_fingerprint(*parse_arguments([base]))
    same = run_fingerprint(
        *parse_arguments(
            [
                base,
                "--output_dir",
                str(tmp_path),
                "--max_steps",
                "3",
                "--logging_steps",
                "7",
                "--save_steps",
                "9",
                "--report_to",
                "none",
                "--dataloader_num_workers",
                "2",
                "--resume_from_checkpoint",
                "auto",
            ]
        )
    )
    assert a.digest == same.digest
    other = run_fingerprint(*parse_arguments([base, "--learning_rate", "0.5"]))
    assert other.digest != a.digest
    assert [d.split(" ")[0] for d in differing_fields(a.values, other.values)] == ["learning_rate"]
    # the data file's content counts, not only its name
    data = tmp_path / "d.jsonl"
    shutil.copy(os.path.join(ROOT, "llm", "data", "sample", "prm_train.jsonl"), data)
    one = run_fingerprint(*parse_arguments([base, "--train_dataset_path", str(data)]))
    with open(data, "a", encoding="utf-8") as f:
        f.write('{"src": "one more", "tgt": ["x"], "label": ["+"]}\n')
    two = run_fingerprint(*parse_arguments([base, "--train_dataset_path", str(data)]))
    assert one.digest != two.digest and "train_dataset_path" in differing_fields(one.values, two.values)[0]


def test_cut_saves_are_skipped_and_auto_resumes_the_previous_complete_one(full_run, tmp_path, capsys):
    """checkpoint-2 complete; newer ones cut at several points: marker missing, a shard missing, trainer
    state missing, a leftover .partial. auto must resume checkpoint-2, name each skipped one, and reproduce
    the uninterrupted run's losses."""
    _, full, common = full_run
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(full / "checkpoint-2", out / "checkpoint-2")
    shutil.copytree(full / "checkpoint-4", out / "checkpoint-4")
    os.remove(out / "checkpoint-4" / MARKER)  # killed before the marker
    shutil.copytree(full / "checkpoint-4", out / "checkpoint-5")
    for shard in (out / "checkpoint-5" / "sharded_state").glob("*.safetensors"):
        os.remove(shard)  # killed while the shards were written
    shutil.copytree(full / "checkpoint-6", out / "checkpoint-7")
    os.remove(out / "checkpoint-7" / "trainer_state.json")
    shutil.copytree(full / "checkpoint-6", out / "checkpoint-8.partial")  # a save that never got renamed
    assert all(checkpoint_problem(str(out / f"checkpoint-{n}")) for n in (4, 5, 7))
    capsys.readouterr()
    run_reward(tmp_path, out, resume_from_checkpoint="auto", **common)
    err = capsys.readouterr().err
    for n, why in ((4, "no checkpoint.json"), (5, "missing: sharded_state/shard-"), (7, "missing: trainer_state.json")):
        assert f"skipping {out / f'checkpoint-{n}'}: incomplete" in err and why in err, (n, err[-3000:])
    assert f"resuming from {out / 'checkpoint-2'}" in err
    assert train_losses(out)[-4:] == pytest.approx(train_losses(full)[-4:], abs=1e-6)
    assert not (out / "checkpoint-8.partial").exists()  # removed by the next save
    assert checkpoint_problem(str(out / "checkpoint-4")) is None  # rewritten, complete


KILL_DURING_SAVE = """
import os, signal, sys
sys.path.insert(0, {root!r})
from llm.alignment.trainer import AlignmentTrainer
original = AlignmentTrainer._save_rng_state
def save_rng_state(self, output_dir):
    if self.state.global_step == 4:  # model and sharded state are written: die in the middle of the save
        os.kill(os.getpid(), signal.SIGKILL)
    original(self, output_dir)
AlignmentTrainer._save_rng_state = save_rng_state
from llm.run_reward import main
main([{cfg!r}])
"""


def test_kill_9_during_a_save_then_auto_resumes_the_previous_one(full_run, tmp_path, capsys):
    _, full, common = full_run
    out = tmp_path / "killed"
    cfg = reward_config(tmp_path, output_dir=str(out), **common)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT}
    script = KILL_DURING_SAVE.format(root=ROOT, cfg=cfg)
    proc = subprocess.run(
        [sys.executable, "-c", script], check=False, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert (out / "checkpoint-4.partial" / "sharded_state").is_dir() and not (out / "checkpoint-4").exists()
    capsys.readouterr()
    run_reward(tmp_path, out, resume_from_checkpoint="auto", **common)
    assert f"resuming from {out / 'checkpoint-2'}" in capsys.readouterr().err
    assert train_losses(out)[-4:] == pytest.approx(train_losses(full)[-4:], abs=1e-6)
    assert not (out / "checkpoint-4.partial").exists() and checkpoint_problem(str(out / "checkpoint-6")) is None


def test_another_runs_checkpoints_are_refused_by_auto_and_accepted_by_name(full_run, tmp_path, capsys):
    _, full, common = full_run
    out = tmp_path / "stale"
    out.mkdir()
    shutil.copytree(full / "checkpoint-2", out / "checkpoint-2")  # left by a run with learning_rate 0.003
    code, err = reward_exit(tmp_path, capsys, out, resume_from_checkpoint="auto", learning_rate=0.01, **common)
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert str(out / "checkpoint-2") in err and "learning_rate (0.003 -> 0.01)" in err, err[-3000:]
    assert f"resume_from_checkpoint: {out / 'checkpoint-2'}" in err and "another output_dir" in err
    assert not (out / "checkpoint-4").exists()
    # named explicitly: accepted with a warning; save_total_limit leaves the other run's checkpoint alone
    code, err = reward_exit(
        tmp_path,
        capsys,
        out,
        resume_from_checkpoint=str(out / "checkpoint-2"),
        learning_rate=0.01,
        **{**common, "save_total_limit": 1},
    )
    assert code == 0, err[-3000:]
    assert "saved by a run with other settings (learning_rate (0.003 -> 0.01))" in err
    assert (out / "checkpoint-2").is_dir() and (out / "checkpoint-6").is_dir() and not (out / "checkpoint-4").exists()


def test_resuming_a_finished_run_changes_nothing(full_run, tmp_path, capsys):
    _, full, common = full_run
    out = tmp_path / "done"
    shutil.copytree(full, out)
    before = {p: (out / p).read_bytes() for p in ("model.safetensors", "trainer_state.json")}
    code, err = reward_exit(tmp_path, capsys, out, resume_from_checkpoint="auto", **common)
    assert code == 0, err[-3000:]
    assert "the run is already complete" in err
    assert not (out / "checkpoint-7").exists()
    assert {p: (out / p).read_bytes() for p in before} == before
    assert read_json(out / "checkpoint-6" / "trainer_state.json")["global_step"] == 6


# --- nothing in a checkpoint runs code --------------------------------------------------------------------
def plant(directory, payload_path, fix_marker):
    """A pickle payload in place of every file under ``directory`` (the marker too unless ``fix_marker``: then
    the marker is rewritten with the planted files' sizes, as an attacker who knows the format would), plus
    pickled files of the types that older formats loaded (.pt, .pth, .distcp, .metadata)."""
    blob = pickle.dumps(Payload(str(payload_path)))
    extra = ["optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.pt"]
    for sub in ("sharded_state", "actor", "critic"):
        if (directory / sub).is_dir():
            extra += [f"{sub}/.metadata", f"{sub}/__0_0.distcp", f"{sub}/optimizer.pt"]
    for name in extra:
        (directory / name).write_bytes(blob)
    files = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, directory)
            if rel == MARKER and fix_marker:
                continue
            with open(path, "wb") as f:
                f.write(blob)
            files[rel] = len(blob)
    if fix_marker:
        marker = read_json(directory / MARKER)
        marker["files"] = files
        (directory / MARKER).write_text(json.dumps(marker))
    kinds = {os.path.splitext(n)[1] or os.path.basename(n) for n in files}
    assert {".safetensors", ".json", ".pt", ".pth", ".distcp", ".metadata"} <= kinds, kinds


@pytest.fixture
def no_unpickling(monkeypatch):
    """Every way of unpickling, recorded: a resume must not use any of them."""
    calls = []

    def forbid(name, original):
        def call(*args, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)

        return call

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, forbid(f"pickle.{name}", getattr(pickle, name)))
    monkeypatch.setattr(torch, "load", forbid("torch.load", torch.load))
    return calls


def test_resume_of_an_intact_checkpoint_unpickles_nothing(full_run, tmp_path, no_unpickling):
    _, full, common = full_run
    out = tmp_path / "intact"
    out.mkdir()
    shutil.copytree(full / "checkpoint-4", out / "checkpoint-4")
    run_reward(tmp_path, out, resume_from_checkpoint="auto", **common)
    assert no_unpickling == []
    assert train_losses(out)[-2:] == pytest.approx(train_losses(full)[-2:], abs=1e-6)


@pytest.mark.parametrize("fix_marker", [False, True])
def test_planted_payloads_never_run_in_a_flat_resume(full_run, tmp_path, capsys, fix_marker):
    _, full, common = full_run
    out = tmp_path / "planted"
    out.mkdir()
    shutil.copytree(full / "checkpoint-4", out / "checkpoint-4")
    ran = tmp_path / MARKER_FILE
    plant(out / "checkpoint-4", ran, fix_marker)
    for value in ("auto", str(out / "checkpoint-4")):
        code, err = reward_exit(tmp_path, capsys, out, resume_from_checkpoint=value, **common)
        assert not ran.exists()
        assert code == 2 and "Traceback" not in err and "checkpoint-4" in err, err[-3000:]


def test_each_loader_refuses_a_planted_file_with_a_message(full_run, tmp_path):
    """Each loader on its own file type, payload in place: a UserError naming the file, never the payload."""
    from llm.alignment.ppo.checkpoint import load_optimizer_state
    from llm.utils.checkpoints import read_safetensors
    from llm.utils.distributed import load_sharded_state
    from tests.helpers import tiny_model

    _, full, _ = full_run
    ran = tmp_path / MARKER_FILE
    blob = pickle.dumps(Payload(str(ran)))
    ckpt = tmp_path / "c"
    shutil.copytree(full / "checkpoint-4", ckpt)
    for name in ("scheduler.json", "scheduler.safetensors", "rng_state_0.json", "rng_state_0.safetensors"):
        if (ckpt / name).exists():
            (ckpt / name).write_bytes(blob)
    with pytest.raises(UserError, match="scheduler.json: not valid JSON"):
        load_tree(str(ckpt), "scheduler")
    with pytest.raises(UserError, match="rng_state_0.json: not valid JSON"):
        load_tree(str(ckpt), "rng_state_0")
    (ckpt / "x.safetensors").write_bytes(blob)
    with pytest.raises(UserError, match="x.safetensors: not a valid safetensors file"):
        read_safetensors(str(ckpt / "x.safetensors"))
    model = tiny_model()
    sharded = ckpt / "sharded_state"
    for shard in sharded.glob("*.safetensors"):
        shard.write_bytes(blob)
    with pytest.raises(UserError, match="cannot read the sharded state"):
        load_sharded_state(str(sharded), model, None)
    (sharded / "state.json").write_bytes(blob)
    with pytest.raises(UserError, match="state.json: not valid JSON"):
        load_sharded_state(str(sharded), model, None)
    (sharded / ".metadata").write_bytes(blob)
    with pytest.raises(UserError, match="older torch.distributed.checkpoint format"):
        load_sharded_state(str(sharded), model, None)
    (ckpt / "optimizer.pt").write_bytes(blob)
    with pytest.raises(UserError, match="optimizer.pt: an optimizer state pickled by an older version"):
        load_optimizer_state(str(ckpt))
    assert not ran.exists()


# --- PPO ----------------------------------------------------------------------------------------------------
def ppo_exit(capsys, cfg):
    capsys.readouterr()
    try:
        run_cli(ppo_main, [cfg])
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def test_ppo_cut_saves_stale_runs_payloads_and_a_finished_run(tmp_path, capsys):
    train = {"max_steps": 3, "save_steps": 1, "save_total_limit": None}
    full = tmp_path / "out"
    ppo_main([ppo_config(tmp_path, training=train)])
    reference = ppo_history(full)
    for n in (1, 2, 3):
        marker = read_json(full / f"checkpoint-{n}" / MARKER)
        assert marker["step"] == n and {"actor/optimizer.json", "critic/optimizer.safetensors"} <= set(marker["files"])

    # cut saves: checkpoint-2 lost its critic/, checkpoint-3's actor/ is empty, a .partial is left over
    out = tmp_path / "resumed"
    out.mkdir()
    for n in (1, 2, 3):
        shutil.copytree(full / f"checkpoint-{n}", out / f"checkpoint-{n}")
    shutil.rmtree(out / "checkpoint-2" / "critic")
    for f in (out / "checkpoint-3" / "actor").iterdir():
        f.unlink()
    shutil.copytree(full / "checkpoint-3", out / "checkpoint-4.partial")
    cfg = ppo_config(tmp_path, training={**train, "output_dir": str(out), "resume_from_checkpoint": "auto"})
    code, err = ppo_exit(capsys, cfg)
    assert code == 0, err[-3000:]
    assert f"skipping {out / 'checkpoint-3'}: incomplete: file(s) missing: actor/" in err
    assert f"skipping {out / 'checkpoint-2'}: incomplete: file(s) missing: critic/" in err
    assert f"resumed from {out / 'checkpoint-1'} at step 1" in err
    again = ppo_history(out)
    assert [h["step"] for h in again] == [1, 2, 3]
    for a, b in zip(reference[1:], again[1:]):
        assert a["score"] == pytest.approx(b["score"], abs=1e-6)
        assert a["policy_loss"] == pytest.approx(b["policy_loss"], abs=1e-5)
    assert not (out / "checkpoint-4.partial").exists()

    # a finished run: nothing trained, nothing written
    before = {p: (full / p).read_bytes() for p in ("log_history.json", "actor/model.safetensors")}
    code, err = ppo_exit(capsys, ppo_config(tmp_path, training={**train, "resume_from_checkpoint": "auto"}))
    assert code == 0 and "the run is already complete" in err, err[-3000:]
    assert {p: (full / p).read_bytes() for p in before} == before and not (full / "checkpoint-4").exists()

    # another run's checkpoints (another actor learning rate): auto refuses naming the field
    other = ppo_config(
        tmp_path, training={**train, "resume_from_checkpoint": "auto"}, actor_rollout={"learning_rate": 0.01}
    )
    code, err = ppo_exit(capsys, other)
    assert code == 2 and "actor_rollout.learning_rate (0.003 -> 0.01)" in err and "Traceback" not in err, err
    assert str(full / "checkpoint-3") in err

    # payloads everywhere (the marker rewritten to match): refused with a message, never run
    ran = tmp_path / MARKER_FILE
    planted = tmp_path / "planted"
    planted.mkdir()
    shutil.copytree(full / "checkpoint-2", planted / "checkpoint-2")
    plant(planted / "checkpoint-2", ran, fix_marker=True)
    cfg = ppo_config(tmp_path, training={**train, "output_dir": str(planted), "resume_from_checkpoint": "auto"})
    code, err = ppo_exit(capsys, cfg)
    assert not ran.exists()
    assert code == 2 and "Traceback" not in err and "checkpoint-2" in err, err[-3000:]


def test_latest_checkpoint_messages(tmp_path):
    with pytest.raises(UserError, match="no complete checkpoint-"):
        latest_checkpoint("auto", str(tmp_path))
    (tmp_path / "checkpoint-3").mkdir()
    with pytest.raises(UserError, match=r"skipped: checkpoint-3 \(incomplete: no checkpoint.json"):
        latest_checkpoint("auto", str(tmp_path))
    with pytest.raises(UserError, match="is not a directory"):
        latest_checkpoint(str(tmp_path / "nope"), str(tmp_path))
