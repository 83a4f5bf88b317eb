"""Parallel layouts under torchrun (gloo, CPU): FSDP2 sharding stages, tensor parallel, both on a 2 x 2 mesh,
and the sharded checkpoint that resumes under another layout.

Each layout must give the losses, final weights and eval metrics of ONE process with the same global
batch (fp32, SGD so that weights compare at 1e-5). Each torchrun launch costs ~10 s on 2 cores, so every
launch checks one layout end to end (train, unified save, eval) and no more launches are made than needed.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import ROOT

TINY = os.path.join(ROOT, "llm", "config", "tiny")
DATA = {
    "prm": os.path.join(ROOT, "llm", "data", "sample", "prm_"),
    "pairs": os.path.join(ROOT, "llm", "data", "sample", "pairs_"),
    "sft": os.path.join(ROOT, "llm", "data", "sample_sft", "sft_"),
}
SCRIPTS = {"reward": "run_reward.py", "dpo": "run_dpo.py", "sft": "run_finetune.py"}
# (script, tiny config, data, eval metric that must agree too)
JOBS = {
    "prm": ("reward", "prm_argument.json", "prm", "eval_step_accuracy"),
    "orm": ("reward", "rm_argument.json", "pairs", "eval_accuracy"),
    "dpo": ("dpo", "dpo_argument.json", "pairs", "eval_rewards/margins"),
    "sft": ("sft", "sft_argument.json", "sft", "eval_loss"),
}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}


def subset(tmp_path, kind, split, n):
    with open(DATA[kind] + f"{split}.jsonl", encoding="utf-8") as f:
        lines = [next(f) for _ in range(n)]
    path = tmp_path / f"{kind}_{split}.jsonl"
    path.write_text("".join(lines))
    return str(path)


def write_config(tmp_path, job, output_dir, **overrides):
    _, name, kind, _ = JOBS[job]
    with open(os.path.join(TINY, name), encoding="utf-8") as f:
        cfg = json.load(f)
    for key in ("model_name_or_path", "tokenizer_name_or_path"):
        cfg[key] = os.path.join(ROOT, cfg[key])
    cfg.update(
        train_dataset_path=subset(tmp_path, kind, "train", 16),
        dev_dataset_path=subset(tmp_path, kind, "dev", 6),
        output_dir=str(output_dir),
        disable_tqdm=True,
        report_to="none",
        logging_steps=1,
        max_seq_len=512,
        max_prompt_len=128,
        save_strategy="no",
        evaluation_strategy="no",
        do_eval=True,
        per_device_eval_batch_size=1,  # 6 dev rows split evenly over 2 data-parallel ranks
        max_steps=3,
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=0.0,
        zero_padding=False,
        greedy_zero_padding=False,
    )
    cfg.update(overrides)
    path = output_dir.parent / f"{output_dir.name}.json"
    path.write_text(json.dumps(cfg, ensure_ascii=False))
    return str(path)


def launch(job, cfg, nproc=1, *flags):
    script = os.path.join(ROOT, "llm", SCRIPTS[JOBS[job][0]])
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    if nproc > 1:
        launcher += ["--nproc_per_node", str(nproc)]
    proc = subprocess.run(
        [*launcher, script, cfg, *flags], env=ENV, timeout=600, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def train_losses(output_dir):
    return [h["loss"] for h in read_json(output_dir / "trainer_state.json")["log_history"] if "loss" in h]


def max_weight_diff(a, b):
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert set(wa) == set(wb)  # the unified checkpoint holds every tensor, whole
    assert all(wa[k].shape == wb[k].shape for k in wa)
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process, global batch 2: the reference run of each job (made once, on first use)."""
    made = {}

    def get(job):
        if job not in made:
            out = tmp_path_factory.mktemp(job) / "one"
            launch(job, write_config(out.parent, job, out, per_device_train_batch_size=2))
            made[job] = out
        return made[job]

    return get


# (job, processes, per-device batch, flags). Global batch 2 in each: batch 1 on 2 data-parallel ranks, or batch 2
# on one tensor-parallel group. stage1 runs stage2's code path (see llm/utils/distributed.py); "stage1" is in test_arguments.
LAYOUTS = [
    ("prm", 2, 1, ["--sharding", "stage2"]),
    ("prm", 2, 1, ["--sharding", "stage3 offload"]),
    ("prm", 2, 2, ["--tensor_parallel_degree", "2"]),
    ("orm", 2, 1, ["--sharding", "stage3"]),
    ("orm", 2, 2, ["--tensor_parallel_degree", "2"]),
    ("dpo", 2, 1, ["--sharding", "stage3"]),
    ("dpo", 2, 2, ["--tensor_parallel_degree", "2"]),
    ("sft", 2, 1, ["--sharding", "stage3"]),
    ("prm", 4, 1, ["--sharding", "stage3", "--tensor_parallel_degree", "2"]),  # the 2 x 2 mesh
]


@pytest.mark.slow
@pytest.mark.parametrize("job, nproc, batch, flags", LAYOUTS, ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_layout_equals_one_process(tmp_path, single, job, nproc, batch, flags):
    out = tmp_path / "par"
    proc = launch(job, write_config(tmp_path, job, out, per_device_train_batch_size=batch), nproc, *flags)
    if "--sharding" in flags:
        assert "FSDP2 stage" in proc.stderr  # the start-up line names the layout that ran
    if "--tensor_parallel_degree" in flags:
        assert "tensor parallel 2" in proc.stderr
    one = single(job)
    assert train_losses(out) == pytest.approx(train_losses(one), abs=1e-5)
    assert max_weight_diff(one, out) <= 1e-5
    a, b = read_json(one / "eval_results.json"), read_json(out / "eval_results.json")
    for key in ("eval_loss", JOBS[job][3]):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-5), key


@pytest.mark.slow
def test_sharded_checkpoint_from_two_processes_resumes_in_one(tmp_path):
    """AdamW (its state must come back too): 4 steps on 2-way FSDP2 saving at step 2; then one process resumes
    from checkpoint-2 and must continue with the losses and weights of the uninterrupted 2-process run."""
    from transformers import AutoModelForCausalLM

    from llm.utils.distributed import SHARDED_STATE_DIR, load_sharded_state

    # lr 1e-3: Adam amplifies the float-rounding differences of the 2-process gradient reduction where
    # gradients are near zero (max weight difference 1.8e-5 at lr 1e-2 on the bundled data, 1.5e-8 at
    # 1e-3); a resume that lost the optimizer state differs by about lr.
    common = {"max_steps": 4, "optim": "adamw_torch", "learning_rate": 0.001, "do_eval": False}
    common.update(save_strategy="steps", save_steps=2)
    full = tmp_path / "full"
    launch(
        "prm", write_config(tmp_path, "prm", full, per_device_train_batch_size=1, **common), 2, "--sharding", "stage3"
    )
    checkpoint = full / "checkpoint-2"
    assert len(list((checkpoint / SHARDED_STATE_DIR).glob("*.safetensors"))) == 2  # one file per rank

    # The unified copy loads with plain transformers and equals the sharded state.
    unified = AutoModelForCausalLM.from_pretrained(checkpoint)
    sharded = AutoModelForCausalLM.from_pretrained(checkpoint)
    for p in sharded.parameters():
        p.data.zero_()
    load_sharded_state(str(checkpoint / SHARDED_STATE_DIR), sharded, None)
    for (name, a), b in zip(unified.state_dict().items(), sharded.state_dict().values()):
        assert torch.equal(a, b), name

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    os.rename(checkpoint, resumed / "checkpoint-2")
    cfg = write_config(tmp_path, "prm", resumed, per_device_train_batch_size=2, resume_from_checkpoint="auto", **common)
    launch("prm", cfg)
    assert train_losses(resumed)[-2:] == pytest.approx(train_losses(full)[-2:], abs=1e-5)
    assert max_weight_diff(full, resumed) <= 1e-5


@pytest.mark.slow
def test_orm_head_drawn_on_a_causal_lm_checkpoint_is_the_same_on_every_rank(tmp_path):
    """An ORM from a causal-LM checkpoint gets a new random score head. Seeded before loading, every rank draws
    the head one process draws: tensor parallel 2 (the head replicated on both ranks) trains like one process
    (unseeded, the losses differed by ~0.1 at step 3)."""
    from tests.helpers import tiny_model

    checkpoint = tmp_path / "causal_lm"
    tiny_model("llama", seed=5).save_pretrained(checkpoint)
    common = {"model_name_or_path": str(checkpoint), "init_from_config": False, "do_eval": False}
    one, two = tmp_path / "one", tmp_path / "tp2"
    launch("orm", write_config(tmp_path, "orm", one, per_device_train_batch_size=2, **common))
    cfg = write_config(tmp_path, "orm", two, per_device_train_batch_size=2, **common)
    launch("orm", cfg, 2, "--tensor_parallel_degree", "2")
    assert train_losses(two) == pytest.approx(train_losses(one), abs=1e-5)
    assert max_weight_diff(one, two) <= 1e-5


def test_checkpoint_without_unified_copy_resumes(tmp_path):
    """unified_checkpoint false: checkpoints hold only the sharded state (fast save); resume still works, and the
    final model in output_dir is the Hugging Face one."""
    common = {"max_steps": 4, "optim": "adamw_torch", "learning_rate": 0.01, "do_eval": False}
    common.update(save_strategy="steps", save_steps=2, unified_checkpoint=False, per_device_train_batch_size=2)
    full = tmp_path / "full"
    launch("prm", write_config(tmp_path, "prm", full, **common))
    assert not (full / "checkpoint-2" / "model.safetensors").exists()
    assert (full / "checkpoint-2" / "sharded_state").is_dir() and (full / "model.safetensors").exists()
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    os.rename(full / "checkpoint-2", resumed / "checkpoint-2")
    launch("prm", write_config(tmp_path, "prm", resumed, resume_from_checkpoint="auto", **common))
    assert train_losses(resumed)[-2:] == pytest.approx(train_losses(full)[-2:], abs=1e-6)
    assert max_weight_diff(full, resumed) <= 1e-6


@pytest.mark.slow
def test_two_nodes_through_rendezvous_equal_one_process(tmp_path, single):
    """Multi-node launch (--nnodes 2 --rdzv-endpoint HOST:PORT, one torchrun per node), here two 'nodes' on this
    machine, with FSDP2 across them: the same losses and weights as one process."""
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    out = tmp_path / "two_nodes"
    cfg = write_config(tmp_path, "prm", out, per_device_train_batch_size=1)
    script = os.path.join(ROOT, "llm", SCRIPTS["reward"])
    node = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1"]
    node += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "test"]
    procs = [
        subprocess.Popen(
            [*node, "--node-rank", str(rank), script, cfg, "--sharding", "stage3"],
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-4000:]
    one = single("prm")
    assert train_losses(out) == pytest.approx(train_losses(one), abs=1e-5)
    assert max_weight_diff(one, out) <= 1e-5


def test_best_model_at_end_comes_from_the_sharded_state(tmp_path):
    """load_best_model_at_end with checkpoints that hold only the sharded state: the final model is the best one."""
    out = tmp_path / "best"
    cfg = write_config(
        tmp_path,
        "prm",
        out,
        per_device_train_batch_size=2,
        max_steps=4,
        learning_rate=2.0,  # large steps: the eval loss moves, so "best" is not simply the last
        save_strategy="steps",
        save_steps=1,
        evaluation_strategy="steps",
        eval_steps=1,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        unified_checkpoint=False,
    )
    launch("prm", cfg)
    history = [h["eval_loss"] for h in read_json(out / "trainer_state.json")["log_history"] if "eval_loss" in h]
    assert read_json(out / "eval_results.json")["eval_loss"] == pytest.approx(min(history[:4]), rel=1e-6)


def test_ranks_given_different_settings_stop_naming_them(tmp_path):
    """Two torchrun processes, one given max_steps 2 and the other 6, used to hang for ever in a collective that only
    one of them reached; now both stop at start-up (exit 2) naming the field and each rank's value."""
    cfg = write_config(tmp_path, "sft", tmp_path / "out")
    wrapper = tmp_path / "per_rank.py"
    wrapper.write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "from llm.run_finetune import main\n"
        "from llm.utils.errors import run_cli\n"
        "steps = '2' if os.environ['RANK'] == '0' else '6'\n"
        "run_cli(main, [sys.argv[1], '--max_steps', steps])\n"
    )
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.run(
        [*launcher, str(wrapper), cfg], env=ENV, timeout=300, capture_output=True, text=True, check=False
    )
    assert proc.returncode != 0
    assert "different settings: max_steps (rank 0: '2', rank 1: '6')" in proc.stderr, proc.stderr[-3000:]


def test_tied_weights_save_and_load_in_the_sharded_state(tmp_path):
    """SmolLM2 ties its input embedding to its LM head: the checkpoint's sharded state (safetensors, which refuses
    shared memory: every SmolLM2 checkpoint failed) holds both names, the optimizer's state too, and a load restores
    the tied parameter in another model and optimizer."""
    from llm.utils.distributed import load_sharded_state, save_sharded_state, unalias
    from tests.helpers import tiny_model

    model = tiny_model(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    optimizer.step()
    save_sharded_state(str(tmp_path / "state"), model, optimizer)
    other = tiny_model(tie_word_embeddings=True, seed=1)
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=1e-2)
    other(torch.tensor([[1, 2]]), labels=torch.tensor([[1, 2]])).loss.backward()
    other_optimizer.step()
    assert not torch.equal(other.lm_head.weight, model.lm_head.weight)
    load_sharded_state(str(tmp_path / "state"), other, None)
    load_sharded_state(str(tmp_path / "state"), other, other_optimizer)
    assert other.lm_head.weight is other.model.embed_tokens.weight  # still one parameter
    for a, b in zip(model.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b)
    for a, b in zip(optimizer.state.values(), other_optimizer.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq"))
    shared = torch.zeros(4)
    tensors = {"a": shared, "b": shared, "c": torch.ones(2), "d": shared[:2]}
    assert unalias(tensors) == 2 and tensors["b"] is not shared and torch.equal(tensors["b"], shared)
