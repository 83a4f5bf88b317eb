"""One run per output_dir and clean stops (issue 11, items 3 and 4).

- output_dir checked at start-up by every script: a file there, or a directory that cannot be written, is exit 2
  with a message naming the path and no traceback (it used to be a FileExistsError, or for PPO a lost run);
- the lock: a second run on a live run's output_dir stops naming the holder's pid; a lock left by a run killed
  with kill -9 is taken over (with a warning naming it); a directory with another run's results needs
  overwrite_output_dir or a resume;
- SIGTERM: PPO saves after the step in progress and exits 0, and resume_from_checkpoint auto then ends with the
  same log history as an uninterrupted run; SIGTERM while the data loads stops the run at once (exit 143, one
  line), where it used to be swallowed until the first step's end (a lazy stream) or kill the run unsaid.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from llm.utils import run_files
from llm.utils.errors import UserError, run_cli
from llm.utils.rundir import LOCK_NAME, RunLock, check_output_dir, files_of_another_origin
from tests.helpers import ROOT
from tests.test_ppo_run import config as ppo_config
from tests.test_ppo_run import history

TINY = os.path.join(ROOT, "llm", "config", "tiny")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1"}

# script, tiny config, the option that names output_dir
SCRIPTS = {
    "orm": ("run_reward.py", "rm_argument.json", "--output_dir"),
    "prm": ("run_reward.py", "prm_argument.json", "--output_dir"),
    "sft": ("run_finetune.py", "sft_argument.json", "--output_dir"),
    "dpo": ("run_dpo.py", "dpo_argument.json", "--output_dir"),
    "ppo": ("run_ppo.py", "ppo_argument.json", "--training.output_dir"),
}


def command(kind, output_dir, *extra):
    script, cfg, option = SCRIPTS[kind]
    report = "--training.report_to" if kind == "ppo" else "--report_to"
    return [sys.executable, os.path.join(ROOT, "llm", script), os.path.join(TINY, cfg), option, str(output_dir)] + [
        report,
        "none",
        *extra,
    ]


def run(cmd, timeout=300):
    return subprocess.run(cmd, check=False, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def unwritable_dir(tmp_path):
    """A directory this process cannot create files in: mode 0555, or for root (who may write anyway) /sys."""
    if os.geteuid() == 0:
        return "/sys"
    path = tmp_path / "readonly"
    path.mkdir()
    path.chmod(0o555)
    return str(path)


@pytest.mark.parametrize("kind", list(SCRIPTS))
def test_output_dir_a_file_or_unwritable_is_exit_2_with_a_message(tmp_path, kind):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    proc = run(command(kind, a_file))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"{a_file} is a file, not a directory" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    below = unwritable_dir(tmp_path)
    proc = run(command(kind, os.path.join(below, "new", "out")))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"cannot write in {below}" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not os.path.exists(os.path.join(below, "new"))


def test_check_output_dir_in_process(tmp_path):
    check_output_dir(str(tmp_path / "a" / "b"))  # does not exist yet: its parent is writable
    assert not (tmp_path / "a").exists()  # nothing created
    (tmp_path / "f").write_text("")
    with pytest.raises(UserError, match="is a file, not a directory"):
        check_output_dir(str(tmp_path / "f"))
    with pytest.raises(UserError, match=r"cannot create it, .*/f is a file"):
        check_output_dir(str(tmp_path / "f" / "below"))
    with pytest.raises(UserError, match="cannot write in"):
        check_output_dir(os.path.join(unwritable_dir(tmp_path), "x"))


def wait_for_lock(out, proc, timeout=120):
    path = out / LOCK_NAME
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the first run ended early"
        try:
            holder = json.loads(path.read_text())
            if holder.get("pid") == proc.pid:
                return holder
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError("the first run never took the lock")


def test_second_run_on_a_live_runs_output_dir_stops_and_a_killed_runs_lock_is_taken_over(tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen(
        command("ppo", out, "--training.max_steps", "100000", "--training.save_steps", "0"),
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        info = wait_for_lock(out, holder)
        assert info["host"] and info["since"]
        for kind in ("ppo", "sft"):  # the same script, and another one, on the same directory
            proc = run(command(kind, out))
            assert proc.returncode == 2, proc.stderr[-3000:]
            assert f"output_dir {out} is in use by another run: pid {holder.pid} on host {info['host']}" in proc.stderr
            assert "Traceback" not in proc.stderr
            assert holder.poll() is None  # the holder runs on, its lock untouched
            assert json.loads((out / LOCK_NAME).read_text())["pid"] == holder.pid
    finally:
        holder.kill()  # kill -9: no chance to release the lock
        holder.wait(timeout=60)
    assert (out / LOCK_NAME).exists()
    proc = run(command("ppo", out, "--training.max_steps", "1", "--training.save_steps", "0"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"taking over the lock left by a run that ended without releasing it (pid {holder.pid}" in proc.stderr
    assert not (out / LOCK_NAME).exists()  # released at exit
    assert (out / "log_history.json").exists()


def test_lock_in_process_released_on_error_and_refused_while_held(tmp_path):
    out = tmp_path / "out"
    with RunLock(str(out)), pytest.raises(UserError, match=f"in use by another run: pid {os.getpid()}"):
        RunLock(str(out)).acquire()
    assert not (out / LOCK_NAME).exists()
    with pytest.raises(RuntimeError), RunLock(str(out)):
        raise RuntimeError("boom")
    RunLock(str(out)).acquire().release()  # free again


def test_under_torchrun_every_rank_stops_with_rank_0s_refusal(tmp_path):
    # Rank 0 alone takes the lock and looks at the directory; the others learn the outcome from it (a
    # broadcast) and stop with the same message instead of waiting for rank 0 in a collective.
    out = tmp_path / "out"
    (out / "checkpoint-7").mkdir(parents=True)
    script, cfg, _ = SCRIPTS["prm"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone"]
    cmd += [os.path.join(ROOT, "llm", script), os.path.join(TINY, cfg), "--output_dir", str(out), "--report_to", "none"]
    proc = run(cmd, timeout=240)
    assert proc.returncode != 0
    assert proc.stderr.count(f"output_dir {out} already holds another run's results (checkpoint-7)") == 2, proc.stderr
    assert not (out / LOCK_NAME).exists()


def sft_config(tmp_path, **overrides):
    with open(os.path.join(TINY, "sft_argument.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    for key in ("model_name_or_path", "tokenizer_name_or_path", "train_dataset_path", "dev_dataset_path"):
        cfg[key] = os.path.join(ROOT, cfg[key])
    cfg.update(
        output_dir=str(tmp_path / "out"),
        disable_tqdm=True,
        report_to="none",
        logging_steps=1,
        max_seq_len=512,
        max_prompt_len=128,
        save_strategy="no",
        do_eval=False,
        max_steps=1,
    )
    cfg.update(overrides)
    path = tmp_path / f"sft_{len(list(tmp_path.glob('sft_*')))}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_another_runs_results_need_overwrite_or_resume(tmp_path, capsys):
    from llm.run_finetune import main as sft_main
    from llm.run_ppo import main as ppo_main

    out = tmp_path / "out"
    (out / "checkpoint-60").mkdir(parents=True)
    (out / "model.safetensors").write_text("an older run's model")
    run_files.record(str(out), ["model.safetensors"])  # an earlier run's final save wrote it
    with pytest.raises(SystemExit) as e:
        run_cli(sft_main, [sft_config(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert f"output_dir {out} already holds another run's results (checkpoint-60, model.safetensors)" in err, err
    assert "overwrite_output_dir true" in err and "resume_from_checkpoint auto" in err
    assert not (out / LOCK_NAME).exists()  # released on the way out
    with pytest.raises(SystemExit) as e:
        run_cli(ppo_main, [ppo_config(tmp_path, training={"max_steps": 1})])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"training.output_dir {out} already holds another run's results" in err, err
    assert "training.overwrite_output_dir true" in err
    # A file no run wrote stops every run, even one told to overwrite (issue 26, item 6); a subdirectory is fine.
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as e:
        run_cli(sft_main, [sft_config(tmp_path, output_dir=str(other), overwrite_output_dir=True)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"output_dir {other} holds files that no run of this project wrote (notes.txt)" in err
    assert os.listdir(other) == ["notes.txt"]
    sft_main([sft_config(tmp_path, output_dir=str(other / "run"))])
    assert (other / "run" / "model.safetensors").exists()
    # overwrite_output_dir starts a new run over another run's results and deletes nothing
    sft_main([sft_config(tmp_path, overwrite_output_dir=True)])
    assert (out / "checkpoint-60").is_dir() and (out / "trainer_state.json").exists()
    ppo_main([ppo_config(tmp_path, training={"max_steps": 1, "overwrite_output_dir": True})])
    assert (out / "log_history.json").exists() and (out / "checkpoint-60").is_dir()


# --- a directory holding a user's files (issue 26, item 6) -------------------------------------------------
USERS_FILES = {"config.json": '{"my": "model"}', "tokenizer.json": '{"my": "tokenizer"}', "notes.txt": "mine"}


def users_directory(tmp_path):
    path = tmp_path / "my_model"
    path.mkdir()
    for name, text in USERS_FILES.items():
        (path / name).write_text(text)
    return path


def untouched(path):
    return {p.name: p.read_text() for p in path.iterdir()} == USERS_FILES


@pytest.mark.parametrize("kind", ["sft", "orm", "dpo", "ppo"])
def test_a_directory_of_the_users_files_is_refused_before_anything_is_built(tmp_path, capsys, monkeypatch, kind):
    """An output_dir holding a user's config.json and tokenizer.json was accepted and the final save replaced them;
    every entry point refuses it at start-up now, whatever resume / overwrite say, naming the files, and leaves the
    directory as it was (not a lock, not a run_files.json)."""
    import importlib

    from llm.alignment import recipe
    from llm.alignment.ppo import build

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(recipe.Recipe, "load_model", no_model)
    monkeypatch.setattr(build, "build_ppo", no_model)
    monkeypatch.chdir(ROOT)
    users = users_directory(tmp_path)
    script, _, _ = SCRIPTS[kind]
    main = importlib.import_module(f"llm.{script[:-3]}").main
    field = "training." if kind == "ppo" else ""
    for extra in ([], [f"--{field}overwrite_output_dir", "true", f"--{field}resume_from_checkpoint", "auto"]):
        with pytest.raises(SystemExit) as e:
            run_cli(main, command(kind, users, *extra)[2:])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "Traceback" not in err, err[-3000:]
        assert (
            f"{field}output_dir {users} holds files that no run of this project wrote (config.json, notes.txt, "
            "tokenizer.json); a run writes its model, tokenizer, config and results there and would replace files "
            f"of the same names. Choose an empty or new directory, or a subdirectory such as {users / 'run'}"
        ) in err, err[-3000:]
        assert untouched(users)


def test_run_pipeline_and_convert_gguf_refuse_a_directory_of_the_users_files(tmp_path):
    from llm.run_pipeline import main as pipeline
    from llm.utils.gguf import MARKER, check_replaceable, convert

    users = users_directory(tmp_path)
    with pytest.raises(UserError, match=r"holds files that no run of this project wrote \(config.json, notes.txt, "):
        pipeline(["--output_dir", str(users), "--overwrite"])
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF")  # never read: the directory is refused first
    with pytest.raises(UserError, match=r"holds files that no GGUF conversion wrote \(config.json, notes.txt, "):
        convert(str(fake), str(users), force=True)
    assert untouched(users)
    # an earlier conversion may be replaced, unless a file it did not write was put there
    converted = tmp_path / "converted"
    converted.mkdir()
    (converted / "model.safetensors").write_text("weights")
    (converted / MARKER).write_text(json.dumps({"format": 1, "files": ["model.safetensors"]}))
    check_replaceable(str(converted))
    (converted / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match=r"no GGUF conversion wrote \(notes.txt\)"):
        check_replaceable(str(converted))


def test_what_counts_as_a_runs_own_files(tmp_path):
    """run_files.json lists what runs wrote; a run's own kinds count whatever it lists; a run directory written
    before run_files.json existed is known by its checkpoints' markers or its final_model.json."""
    from llm.utils.checkpoints import FINAL_MARKER, MARKER

    assert files_of_another_origin(str(tmp_path / "missing")) == []
    out = tmp_path / "run"
    out.mkdir()
    for name in ("config.json", "model.safetensors", "eval_results.json", "final_model.json.tmp42", LOCK_NAME):
        (out / name).write_text("x")
    for name in ("checkpoint-3", "checkpoint-4.partial", "final.partial", "runs"):
        (out / name).mkdir()
    # not a run directory (no run_files.json): only a run's own kinds are a run's (checkpoint-3, saves, the lock)
    expected = ["config.json", "eval_results.json", "final_model.json.tmp42", "model.safetensors", "runs"]
    assert files_of_another_origin(str(out)) == expected
    run_files.record(str(out), ["config.json", "model.safetensors"])
    assert files_of_another_origin(str(out)) == []  # eval_results.json, runs/, ...: a run directory's results
    (out / "tokenizer.json").write_text("the user's, put there later")
    assert files_of_another_origin(str(out)) == ["tokenizer.json"]
    (out / "sub").mkdir()  # a user's folder; one that is itself a run directory is a run's (run_pipeline's stages)
    assert files_of_another_origin(str(out)) == ["sub", "tokenizer.json"]
    run_files.record(str(out / "sub"), [])
    assert files_of_another_origin(str(out)) == ["tokenizer.json"]
    (out / run_files.RUN_FILES).write_text(json.dumps({"names": ["tokenizer.json"]}))  # not written by a run
    assert "tokenizer.json" in files_of_another_origin(str(out)) and "run_files.json" in files_of_another_origin(
        str(out)
    )
    old = tmp_path / "old_run"  # before run_files.json: a checkpoint's marker and final_model.json say it
    (old / "checkpoint-2").mkdir(parents=True)
    (old / "checkpoint-2" / MARKER).write_text("{}")
    (old / "all_results.json").write_text("{}")
    assert files_of_another_origin(str(old)) == []
    (old / "model.safetensors").write_text("x")
    assert files_of_another_origin(str(old)) == ["model.safetensors"]
    (old / FINAL_MARKER).write_text(json.dumps({"step": 2, "files": ["model.safetensors"]}))
    assert files_of_another_origin(str(old)) == []


def test_a_final_save_lists_what_it_moves_in_before_moving_it(tmp_path, monkeypatch):
    """finish_final adds the names to run_files.json first: a save killed between the two leaves no file that the
    next run would take for someone else's."""
    from llm.utils import checkpoints

    out = tmp_path / "out"
    staging = checkpoints.begin_final(str(out), is_main=True)
    for name in ("model.safetensors", "config.json"):
        open(os.path.join(staging, name), "w").close()

    replace = os.replace

    def killed(src, dst):  # the first move out of the staging directory: killed
        if checkpoints.FINAL_STAGING in str(src):
            raise KeyboardInterrupt
        replace(src, dst)

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoints.finish_final(str(out), 3)
    assert run_files.recorded(str(out)) == {"config.json", "model.safetensors"}
    monkeypatch.undo()
    (staging_file := out / checkpoints.FINAL_STAGING / "config.json").rename(out / "config.json")  # half moved
    assert not staging_file.exists() and files_of_another_origin(str(out)) == []


def comparable(log):
    return [{k: v for k, v in entry.items() if not k.startswith("time/")} for entry in log]


# The roles in two Ray actors on shares of a CPU; Ray started by the run itself (the driver).
RAY_POOL = {
    "use_ray": True,
    "actor_rollout": 0.5,
    "ref": 0.5,
    "critic": 0.5,
    "reward": 0.5,
    "colocate": [["actor_rollout", "ref"], ["critic", "reward"]],
}


@pytest.mark.parametrize("mode", ["one_process", "ray"])
def test_ppo_sigterm_saves_after_the_step_and_resume_equals_an_uninterrupted_run(tmp_path, mode):
    """On Ray the SIGTERM goes to the driver's whole process group, as `timeout` and Slurm send it: the Ray
    processes must live on until the driver has finished the step and saved it (they used to die first: rc -6
    or 1). The resume and the uninterrupted run are in one process (Ray's equal to it: test_ppo_ray.py)."""
    from llm.run_ppo import main

    steps = 12
    interrupted = tmp_path / "interrupted"
    training = {"max_steps": steps, "save_steps": 0, "save_total_limit": None}
    pool = {"resource_pool": RAY_POOL} if mode == "ray" else {}
    path = ppo_config(tmp_path, training={**training, "output_dir": str(interrupted)}, **pool)
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "llm", "run_ppo.py"), path],
        cwd=ROOT,
        env={**ENV, "RAY_USAGE_STATS_ENABLED": "0"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, to signal as a whole
    )
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if '"step": 1,' in line:  # the first step is logged: training is under way
            if mode == "ray":
                os.killpg(proc.pid, signal.SIGTERM)  # the driver, the GCS, the raylet, ...
            else:
                proc.send_signal(signal.SIGTERM)
            break
    _, rest = proc.communicate(timeout=180)
    err = "".join(lines) + rest
    assert proc.returncode == 0, err[-3000:]
    checkpoints = sorted(interrupted.glob("checkpoint-*"))
    assert len(checkpoints) == 1, err[-3000:]
    stopped_at = int(checkpoints[0].name.split("-")[1])
    assert 1 <= stopped_at < steps
    assert f"stopped by signal {int(signal.SIGTERM)} after step {stopped_at}: saved {checkpoints[0]}" in err
    assert not (interrupted / "log_history.json").exists()  # not a finished run
    assert not (interrupted / LOCK_NAME).exists()
    main(
        [ppo_config(tmp_path, training={**training, "output_dir": str(interrupted), "resume_from_checkpoint": "auto"})]
    )
    full = tmp_path / "full"
    main([ppo_config(tmp_path, training={**training, "output_dir": str(full)})])
    resumed, reference = comparable(history(interrupted)), comparable(history(full))
    assert [h["step"] for h in resumed] == list(range(1, steps + 1))
    assert len(resumed) == len(reference)
    for a, b in zip(resumed, reference):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], abs=1e-5), (a["step"], key)


def fifo(tmp_path, name):
    path = tmp_path / name
    os.mkfifo(path)
    return path


def open_when_read(path, proc, timeout=120):
    """The writing end of the FIFO, once the run has opened it for reading (it is then reading the data)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        try:
            return os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # ENXIO: no reader yet
            time.sleep(0.1)
    raise AssertionError("the run never opened its data file")


@pytest.mark.parametrize("kind", ["sft", "prm_lazy"])
def test_sigterm_while_the_data_loads_stops_at_once(tmp_path, kind):
    data = fifo(tmp_path, "train.jsonl")  # a data source that is slow to read: nothing comes
    out = tmp_path / "out"
    if kind == "sft":
        cmd = command("sft", out, "--train_dataset_path", str(data), "--do_eval", "false")
    else:
        lazy = ("--lazy", "true", "--greedy_zero_padding", "false", "--max_steps", "5", "--do_eval", "false")
        cmd = command("prm", out, "--train_dataset_path", str(data), *lazy)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        fd = open_when_read(data, proc)
        os.write(fd, b'{"src": "an unfinished')  # part of a record: the reader waits for the rest
        time.sleep(0.5)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - sent
        os.close(fd)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "stopped by SIGTERM before the first optimizer step of this run completed: nothing to save" in err
    assert "Traceback" not in err, err[-3000:]
    assert elapsed < 20
    assert not (out / LOCK_NAME).exists()


def test_a_second_sigterm_exits_at_once(tmp_path):
    # After a step has completed a SIGTERM waits for the step's end; a second one does not wait, but the same
    # one delivered twice at once is one request.
    code = (
        "import time\n"
        "from llm.utils import preemption\n"
        "with preemption.handle_signals():\n"
        "    preemption.step_completed()\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(120)  # a step that does not end\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)  # at once again, as `timeout` does (its child, then the process group)
    time.sleep(2.0)  # more than preemption.SAME_SIGNAL_WINDOW: the next one is a second request
    assert proc.poll() is None  # the first request waits for the step's end
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "a second SIGTERM: exiting at once, nothing saved" in err


# --- Ctrl-C (issue 22, item 1) ---------------------------------------------------------------------------
def interrupted_run(cmd, started: str, timeout=180):
    """Run ``cmd``, send SIGINT (Ctrl-C) once an output line holds ``started``; (returncode, output)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if started in line:
            proc.send_signal(signal.SIGINT)
            break
    rest, _ = proc.communicate(timeout=timeout)
    return proc.returncode, "".join(lines) + rest


@pytest.mark.parametrize("kind", ["sft", "ppo"])
def test_ctrl_c_saves_after_the_step_and_exits_130_saying_how_to_resume(tmp_path, kind):
    """Ctrl-C behaves as SIGTERM does (finish the step, save), then exits 130 with one line, no traceback."""
    out = tmp_path / "out"
    if kind == "sft":
        cmd = command(kind, out, "--do_eval", "false", "--logging_steps", "1", "--save_strategy", "no")
        cmd += ["--disable_tqdm", "true"]
        code, err = interrupted_run(cmd, "'loss'")
        option = "--resume_from_checkpoint"
    else:
        path = ppo_config(tmp_path, training={"output_dir": str(out), "max_steps": 12, "save_steps": 0})
        code, err = interrupted_run([sys.executable, os.path.join(ROOT, "llm", "run_ppo.py"), path], '"step": 1,')
        option = "--training.resume_from_checkpoint"
    assert code == 130, err[-3000:]
    checkpoints = sorted(out.glob("checkpoint-*"))
    assert len(checkpoints) == 1, err[-3000:]
    step = int(checkpoints[0].name.split("-")[1])
    assert f"stopped by signal 2 (Ctrl-C) after step {step}: saved {checkpoints[0]}; resume with {option} auto" in err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert not (out / LOCK_NAME).exists()


@pytest.mark.parametrize("kind", ["prm", "ppo"])
def test_resume_auto_with_nothing_to_resume_stops_before_loading(tmp_path, kind):
    out = tmp_path / "empty"
    out.mkdir()
    option = "--training.resume_from_checkpoint" if kind == "ppo" else "--resume_from_checkpoint"
    proc = run(command(kind, out, option, "auto"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    field = "training." if kind == "ppo" else ""
    assert f"{field}resume_from_checkpoint=auto: {field}output_dir {out} holds no complete checkpoint" in proc.stderr
    assert f"run without {field}resume_from_checkpoint to start afresh" in proc.stderr
    assert "initialised" not in proc.stderr and "Traceback" not in proc.stderr  # no model was built
