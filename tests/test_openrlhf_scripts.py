"""Launch scripts as people write them and as an attacker might (llm/settings/dialects/openrlhf/script.py): the
shapes a training command takes (held in a variable, --module, continuations, environment prefixes, pipes, two
branches), and hostile input answered with one message: oversized scripts, here-documents and words that made the
old reader quadratic, expansion bombs, a FIFO, command substitution. A hang is turned into a failure by an alarm far
above the time needed (never a wall-clock assert)."""

from __future__ import annotations

import contextlib
import json
import os
import signal

import pytest

from llm.settings.dialects.openrlhf import read_launch_script
from llm.settings.dialects.openrlhf.script import MAX_BYTES, MAX_EXPANDED, read_training_command
from llm.settings.load import parse_arguments
from llm.utils.errors import UserError


@contextlib.contextmanager
def answers(seconds: int = 120):
    """Fails the test when the code inside has not answered after ``seconds`` (a quadratic scan of a 1 MB script
    or an open() blocked on a FIFO); the reader answers these in well under a second."""

    def hang(*_):
        raise AssertionError(f"no answer after {seconds} s: the reader hangs on this input")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def sh(tmp_path):
    """A launch script ``name`` in tmp_path holding ``text``; a data file ``d.jsonl`` beside it."""
    (tmp_path / "d.jsonl").write_text(json.dumps({"src": "q", "tgt": "a"}) + "\n")

    def write(text: str, name: str = "train.sh") -> str:
        (tmp_path / name).write_text(text.replace("DATA", str(tmp_path / "d.jsonl")))
        return str(tmp_path / name)

    return write


def translate(path: str, kind: str = "sft") -> dict:
    return read_launch_script(path, kind, [])


# --- the shapes of a training command -----------------------------------------------------------------------
def test_command_held_in_a_variable_runs_with_deepspeed_module(sh):
    out = translate(sh('cmds="openrlhf.cli.train_sft --pretrain m --save_path ./out --dataset DATA"\n'
                       "deepspeed --module $cmds\n"))  # fmt: skip
    assert (out["model_name_or_path"], out["output_dir"]) == ("m", "./out")  # openrlhf.cli: save_path is the model
    out = translate(sh('export CMD="openrlhf.cli.train_sft \\\n  --pretrain m \\\n  --learning_rate 3e-6 \\\n'
                       '  --dataset DATA"\npython -m $CMD --max_epochs=2\n'))  # fmt: skip
    assert (out["learning_rate"], out["num_train_epochs"]) == (3e-6, 2)


def test_environment_prefix_redirections_and_a_pipe_around_the_command(sh):
    launch = "CUDA_VISIBLE_DEVICES=0,1 NCCL_DEBUG=INFO deepspeed --num_gpus 2 --module openrlhf.cli.train_sft"
    out = translate(
        sh(f'{launch} \\\n    --pretrain "my model" \\\n    --dataset DATA 2>&1 | tee train.log; echo ok\n')
    )
    assert out["model_name_or_path"] == "my model" and out["train_dataset_path"].endswith("d.jsonl")


def test_command_substitution_heredoc_and_two_branches_are_one_command(sh):
    path = sh(
        "training_commands=$(cat <<'EOF'\nopenrlhf.cli.train_sft \\\n  --pretrain m \\\n  --dataset DATA\nEOF\n)\n"
        'if [[ "${1}" == "slurm" ]]; then\n  srun deepspeed --module $training_commands\nelse\n'
        "  deepspeed --module $training_commands\nfi\n"
    )
    assert read_training_command(path).args == ["--pretrain", "m", "--dataset", path.replace("train.sh", "d.jsonl")]
    with pytest.raises(UserError, match=r"holds 2 training commands \(lines 1, 2\)"):
        translate(sh("deepspeed ../train_sft.py --pretrain m\ndeepspeed ../train_sft.py --pretrain n\n"))


def test_commands_it_cannot_see_say_where_they_are(sh):
    with pytest.raises(UserError, match=r'line 2: the training command is one quoted word \(bash -c "..."\)'):
        translate(sh('set -x\nsrun bash -c "deepspeed ../train_sft.py --pretrain m"\n'))
    with pytest.raises(UserError, match="holds no OpenRLHF training command.*line 2 reads ./train_ppo_llama.sh"):
        translate(sh('readonly script="train_ppo_llama.sh"\nsource ./${script} slurm\n'))
    with pytest.raises(UserError, match="line 2: --dataset starts a command of its own: the line before does not"):
        translate(sh("deepspeed ../train_sft.py --pretrain m \\ \n  --dataset DATA\n"))  # a space after the \\
    array = "ARGS=(\n  --pretrain m\n  # --lora_rank 8\n  --dataset DATA\n)\n"
    array += 'deepspeed --module openrlhf.cli.train_sft "${ARGS[@]}"\n'
    with pytest.raises(UserError, match=r"'\$\{ARGS\[@\]\}' holds \$\{ARGS\[...\]\}, a bash array, which this reader"):
        translate(sh(array))
    with pytest.raises(UserError, match=r"line 2: a quote \(\"\) is never closed"):
        translate(sh('set -x\ndeepspeed ../train_sft.py --pretrain "m\n'))
    with pytest.raises(UserError, match="line 1: the here-document <<EOF is never closed: end it with a line"):
        translate(sh("read -r -d '' cmds <<EOF\n../train_sft.py --pretrain m\nEO\n"))


# --- hostile input ----------------------------------------------------------------------------------------
def test_a_script_over_the_limit_is_refused_unread(sh):
    path = sh("<<A\n" * (5 * MAX_BYTES // 4))  # 5 MB of here-document openers
    with answers(), pytest.raises(UserError, match=r"is 5,242,880 bytes; over 1,048,576 is not read \(an OpenRLHF"):
        translate(path)


def test_near_limit_pathological_scripts_are_answered(sh):
    """Just under the limit: the old reader's here-document regex scanned the rest of the file from each opener
    (about 10^11 steps here) and shlex built a long word one character at a time (a minute for this word)."""
    openers = sh("cat <<A\n" + "x <<A\n" * ((MAX_BYTES - 8) // 6))
    with answers(), pytest.raises(UserError, match="line 1: the here-document <<A is never closed"):
        translate(openers)
    word = sh("deepspeed ../train_sft.py --pretrain m --dataset DATA --save_path " + "a" * (MAX_BYTES - 200))
    with answers():
        assert translate(word)["output_dir"] == "a" * (MAX_BYTES - 200) + "/sft_model"
    one_line = sh("<<A " * 1000)  # openers on one line: each waits for its own body
    with answers(), pytest.raises(UserError, match="line 1: the here-document <<A is never closed"):
        translate(one_line)


def test_expansion_bomb_stops(sh):
    lines = ["A=" + "x" * 1000] + [f"{b}=" + f"${a}" * 100 for a, b in zip("ABCD", "BCDE")]
    with answers(), pytest.raises(UserError, match=f"expand to over {MAX_EXPANDED:,} characters in all"):
        translate(sh("\n".join(lines) + "\ndeepspeed ../train_sft.py --pretrain $E\n"))


def test_fifo_and_device_are_refused_before_open(tmp_path, sh):
    fifo = tmp_path / "x.sh"
    os.mkfifo(fifo)
    with answers(), pytest.raises(UserError, match=r"x.sh: is a FIFO \(named pipe\), not a regular file"):
        translate(str(fifo))
    with answers(), pytest.raises(UserError, match=r"x.sh: is a FIFO"):
        parse_arguments([str(fifo)])  # through the config path every run script takes
    config = tmp_path / "x.json"
    os.mkfifo(config)
    with answers(), pytest.raises(UserError, match=r"x.json: is a FIFO \(named pipe\), not a regular file"):
        parse_arguments([str(config)])


@pytest.mark.parametrize(
    "text, flag, shown",
    [
        ('--save_path "./x$(touch {marker})"', "--save_path", "./x$(touch "),
        ("--save_path=`touch {marker}`", "--save_path", "`touch "),
        ("--pretrain ${{MODEL:-m}}", "--pretrain", "${MODEL:-m}"),
    ],
    ids=["dollar-paren", "backticks", "parameter-default"],
)
def test_command_substitution_is_refused_naming_the_flag(tmp_path, sh, text, flag, shown):
    marker = tmp_path / "ran"
    path = sh(f"deepspeed ../train_sft.py --dataset DATA {text.format(marker=marker)}\n")
    with pytest.raises(UserError, match=rf"train.sh: {flag}: '.*' holds .*: write the value it stands for literally"):
        translate(path)
    assert shown in str(pytest.raises(UserError, translate, path).value)
    assert not marker.exists() and not any(p.name.startswith("x") for p in tmp_path.iterdir())  # nothing ran


def test_substitution_through_a_variable_is_refused(sh):
    path = sh('SAVE="$(pwd)/ckpt"\ndeepspeed ../train_sft.py --pretrain m --dataset DATA --save_path "$SAVE"\n')
    with pytest.raises(UserError, match=r"--save_path: '\$\(pwd\)/ckpt' holds a command substitution"):
        translate(path)
    # the launcher's own words are not the run's: a substitution there is bash's business
    ok = sh("deepspeed --include localhost:$(echo 0) ../train_sft.py --pretrain m --dataset DATA\n", "ok.sh")
    assert translate(ok)["model_name_or_path"] == "m"
