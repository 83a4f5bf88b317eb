"""LoRA with peft in the flat trainers (llm/utils/lora.py): only the adapters (and the chosen head) train; the saved
adapter reloads with ``PeftModel.from_pretrained`` and gives the trained model's outputs; the merged export
(``lora_merge``) equals the adapter forward; DPO's disabled-adapter reference equals an explicit frozen copy of
the base for every loss that uses a reference, on the fly and precomputed; resume continues adapter and optimizer;
two DDP ranks equal one process; bad settings exit 2 with a message."""

import copy
import json
import math
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from llm.alignment.context import RunContext
from llm.alignment.dpo.build import build_dpo_trainer
from llm.alignment.dpo.loss import LOSSES
from llm.alignment.dpo.trainer import DPOTrainer, collate_pairs
from llm.alignment.rm.build import build_reward_trainer
from llm.alignment.runner import train_and_evaluate
from llm.alignment.sft.build import build_sft_trainer
from llm.data.encode_lm import encode_pair_for_lm
from llm.data.encoding import EncodeConfig, OverlongCounter
from llm.data.packing import pack
from llm.data.readers import read_records
from llm.run_dpo import main as dpo_main
from llm.run_finetune import main as sft_main
from llm.run_reward import main as reward_main
from llm.settings.dialects.paddle import PADDLE_REWARD_NAMES
from llm.settings.dpo import DPO_ARGUMENT_TYPES, DPOTrainingArguments
from llm.settings.flat import ARGUMENT_TYPES, ModelArgument, validate_arguments
from llm.settings.load import parse_arguments
from llm.settings.reward import REWARD_ARGUMENT_TYPES
from llm.utils.distributed import Layout
from llm.utils.errors import UserError, run_cli
from llm.utils.lora import DEFAULT_TARGETS, MERGED_DIR, apply_lora, check_lora_arguments
from llm.utils.modeling import load_model
from tests.helpers import ROOT, tiny_model, tokenizer

TINY = os.path.join(ROOT, "llm", "config", "tiny")
TINY_LLAMA = os.path.join(ROOT, "llm", "assets", "tiny-llama")
TINY_PRM = os.path.join(ROOT, "llm", "assets", "tiny-prm")
SFT_DATA = os.path.join(ROOT, "llm", "data", "sample_sft")
SAMPLE = os.path.join(ROOT, "llm", "data", "sample")
TOL = 1e-5


def subset(tmp_path, folder, name, n):
    with open(os.path.join(folder, name), encoding="utf-8") as f:
        lines = f.readlines()[:n]
    path = tmp_path / f"{n}_{name}"
    path.write_text("".join(lines))
    return str(path)


def config(tmp_path, name, **overrides):
    with open(os.path.join(TINY, name), encoding="utf-8") as f:
        cfg = json.load(f)
    for key in ("model_name_or_path", "tokenizer_name_or_path", "train_dataset_path", "dev_dataset_path"):
        cfg[key] = os.path.join(ROOT, cfg[key])
    cfg.update(
        output_dir=str(tmp_path / "out"),
        disable_tqdm=True,
        report_to="none",
        logging_steps=1,
        warmup_steps=0,
        max_seq_len=512,
        max_prompt_len=128,
        save_strategy="no",
        evaluation_strategy="no",
        do_eval=False,
        lora=True,
    )
    cfg.update(overrides)
    path = tmp_path / f"cfg_{len(list(tmp_path.glob('cfg_*')))}.json"
    path.write_text(json.dumps(cfg, ensure_ascii=False))
    return str(path)


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def train_in_process(cfg, types, build, paddle=None):
    """parse -> validate -> build -> train and save, as run_*.py do, keeping the trainer."""
    kwargs = {"paddle": paddle} if paddle is not None else {}
    model_args, data_args, training_args = parse_arguments([cfg], types, **kwargs)
    validate_arguments(model_args, data_args, training_args)
    trainer, train, dev = build(RunContext.load(model_args, data_args, training_args))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    train_and_evaluate(trainer, data_args, training_args, train, dev)
    trainer.model.eval()
    return trainer, before


def changed(model, before):
    return {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}


def sample_ids():
    torch.manual_seed(0)
    return torch.randint(3, 600, (2, 24))


def base_model(auto_class, path=TINY_LLAMA, **kw):
    """The tiny configs' random base (init_from_config, seed 42): what the adapter was trained on."""
    return load_model(auto_class, path, init_from_config=True, seed=42, pad_token_id=0, **kw).eval()


def max_diff(a, b):
    return (a - b).abs().max().item()


# --- what trains, what is saved ------------------------------------------------------------------------


def test_sft_trains_only_adapters_saves_a_peft_adapter_and_a_merged_model(tmp_path):
    cfg = config(
        tmp_path,
        "sft_argument.json",
        train_dataset_path=subset(tmp_path, SFT_DATA, "sft_train.jsonl", 12),
        max_steps=3,
        learning_rate=1e-2,
        lora_merge=True,
    )
    trainer, before = train_in_process(cfg, ARGUMENT_TYPES, build_sft_trainer)
    moved = changed(trainer.model, before)
    assert moved and all(".lora_A." in n or ".lora_B." in n for n in moved), sorted(moved)[:5]
    assert any(".lora_B." in n for n in moved)  # B starts at zero: the adapter really learnt something
    targets = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in moved}
    assert targets == set(DEFAULT_TARGETS)

    out = tmp_path / "out"
    assert (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists()
    assert not (out / "model.safetensors").exists()  # output_dir holds the adapter, not a copy of the base
    ids = sample_ids()
    with torch.no_grad():
        want = trainer.model(input_ids=ids).logits
        reloaded = PeftModel.from_pretrained(base_model(AutoModelForCausalLM), str(out)).eval()
        got = reloaded(input_ids=ids).logits
        merged = load_model(AutoModelForCausalLM, str(out / MERGED_DIR), init_from_config=False, seed=0).eval()
        assert not any("lora" in k for k in merged.state_dict())
        from_merged = merged(input_ids=ids).logits
    assert max_diff(got, want) <= TOL
    assert max_diff(from_merged, want) <= TOL
    assert max_diff(want, base_model(AutoModelForCausalLM)(input_ids=ids).logits) > 1e-4  # it did move


def test_orm_trains_adapters_and_the_score_head_and_reloads(tmp_path):
    cfg = config(
        tmp_path,
        "rm_argument.json",
        train_dataset_path=subset(tmp_path, SAMPLE, "pairs_train.jsonl", 12),
        max_steps=3,
        learning_rate=1e-2,
        lora_merge=True,
    )
    trainer, before = train_in_process(cfg, REWARD_ARGUMENT_TYPES, build_reward_trainer, PADDLE_REWARD_NAMES)
    assert trainer.readouts_only  # the last layer at the readouts only, through the LoRA projections
    moved = changed(trainer.model, before)
    heads = {n for n in moved if ".score." in n}
    assert heads and all("modules_to_save" in n for n in heads), heads  # the trained copy; the original is kept
    assert all(".lora_" in n or n in heads for n in moved), sorted(moved)[:5]
    assert any(".lora_B." in n for n in moved)

    out = tmp_path / "out"
    ids = sample_ids()
    with torch.no_grad():
        want = trainer.model(input_ids=ids).logits
        base = base_model(AutoModelForSequenceClassification, num_labels=1)
        got = PeftModel.from_pretrained(base, str(out)).eval()(input_ids=ids).logits
        merged = load_model(
            AutoModelForSequenceClassification, str(out / MERGED_DIR), init_from_config=False, seed=0
        ).eval()
        from_merged = merged(input_ids=ids).logits
    assert max_diff(got, want) <= TOL and max_diff(from_merged, want) <= TOL


def test_prm_with_lora_train_head_trains_only_the_reward_rows_of_the_head(tmp_path):
    cfg = config(
        tmp_path,
        "prm_argument.json",
        train_dataset_path=subset(tmp_path, SAMPLE, "prm_train.jsonl", 12),
        max_steps=3,
        learning_rate=1e-2,
        lora_train_head=True,
        lora_merge=True,
    )
    trainer, before = train_in_process(cfg, REWARD_ARGUMENT_TYPES, build_reward_trainer, PADDLE_REWARD_NAMES)
    assert trainer.readouts_only
    moved = changed(trainer.model, before)
    rows = [n for n in moved if "trainable_tokens_delta" in n]
    assert len(rows) == 1 and all(".lora_" in n or n in rows for n in moved), sorted(moved)[:5]
    ids = trainer.reward_token_ids
    head = trainer.model.get_output_embeddings()
    assert head.token_adapter.token_indices["default"] == sorted(ids)

    out = tmp_path / "out"
    base = base_model(AutoModelForCausalLM, TINY_PRM)
    base_head = base.lm_head.weight.detach().clone()
    merged = load_model(AutoModelForCausalLM, str(out / MERGED_DIR), init_from_config=False, seed=0).eval()
    merged_head = merged.lm_head.weight.detach()
    others = torch.ones(base_head.shape[0], dtype=torch.bool)
    others[ids] = False
    assert torch.equal(merged_head[others], base_head[others])  # every row the PRM does not read is the base's
    assert max_diff(merged_head[ids], base_head[ids]) > 1e-4
    x = sample_ids()
    with torch.no_grad():
        want = trainer.model(input_ids=x).logits
        got = PeftModel.from_pretrained(base, str(out)).eval()(input_ids=x).logits
        from_merged = merged(input_ids=x).logits
    assert max_diff(got, want) <= TOL and max_diff(from_merged, want) <= TOL


def test_without_lora_train_head_a_prm_head_stays_frozen_and_unwrapped():
    model = apply_lora(tiny_model("llama"), ModelArgument(lora=True), "causal_lm", head_rows=[5, 6])
    assert isinstance(model.get_output_embeddings(), torch.nn.Linear)
    assert all(".lora_" in n for n, p in model.named_parameters() if p.requires_grad)


# --- DPO: the disabled-adapter reference ---------------------------------------------------------------


@pytest.fixture(scope="module")
def dpo_setup(tmp_path_factory):
    tok = tokenizer()
    records = read_records(os.path.join(SAMPLE, "pairs_train.jsonl"), "pair")[:8]
    examples = [
        encode_pair_for_lm(r, tok, EncodeConfig(1024, 256), i, OverlongCounter()) for i, r in enumerate(records)
    ]
    rows, _ = pack(examples, 700, "greedy")
    base = tiny_model("llama", seed=1, attention_dropout=0.1).eval()  # dropout: the reference must run in eval mode
    frozen = copy.deepcopy(base)  # the explicit reference: a frozen copy of the base
    policy = apply_lora(base, ModelArgument(lora=True, lora_dropout=0.1), "causal_lm")
    torch.manual_seed(5)
    with torch.no_grad():  # a policy that differs from its base (B starts at zero)
        for name, p in policy.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05)
    return SimpleNamespace(tok=tok, rows=rows, policy=policy, frozen=frozen, tmp=tmp_path_factory.mktemp("dpo"))


def dpo_trainer(setup, loss_type, ref_model):
    args = DPOTrainingArguments(
        output_dir=str(setup.tmp),
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        loss_type=loss_type,
        beta=0.5,
    )
    collator = lambda r: collate_pairs(r, pad_token_id=setup.tok.pad_token_id)
    return DPOTrainer(model=setup.policy, args=args, ref_model=ref_model, data_collator=collator)


REFERENCE_LOSSES = [name for name, spec in LOSSES.items() if spec.needs_reference]


def test_every_reference_loss_is_covered():
    assert {"sigmoid", "hinge", "ipo"} <= set(REFERENCE_LOSSES)


@pytest.mark.parametrize("loss_type", REFERENCE_LOSSES)
def test_disabled_adapter_reference_equals_a_frozen_copy_of_the_base(dpo_setup, loss_type):
    setup = dpo_setup
    adapter_ref = dpo_trainer(setup, loss_type, None)
    explicit = dpo_trainer(setup, loss_type, setup.frozen)
    assert adapter_ref.adapter_reference and not explicit.adapter_reference
    assert adapter_ref.ref_model is None  # no second model in memory
    batch = collate_pairs(setup.rows, pad_token_id=setup.tok.pad_token_id)
    setup.policy.train()  # as in training: dropout of the adapters on, the reference runs in eval mode
    torch.manual_seed(0)
    a = adapter_ref.forward_items(setup.policy, batch)
    torch.manual_seed(0)
    b = explicit.forward_items(setup.policy, batch)
    assert setup.policy.training  # the reference context restored the mode (and re-enabled the adapter)
    assert max_diff(a.loss, b.loss) <= 1e-6
    for key in ("chosen_reward", "rejected_reward"):
        assert max_diff(a.values[key], b.values[key]) <= 1e-6
    ref_c, _ = adapter_ref.reference_log_probs(batch)
    assert max_diff(ref_c, a.values["chosen_logps"]) > 1e-3  # the reference is not the policy
    a.loss.sum().backward()
    grads = [p.grad for n, p in setup.policy.named_parameters() if p.requires_grad]
    assert all(g is not None for g in grads)
    setup.policy.zero_grad(set_to_none=True)

    # precomputed once: the base with the adapter disabled, equal to the frozen copy's log-probs
    setup.policy.eval()
    pre_a = collate_pairs(adapter_ref.with_reference_log_probs(setup.rows, 1), pad_token_id=0)
    pre_b = collate_pairs(explicit.with_reference_log_probs(setup.rows, 1), pad_token_id=0)
    assert max_diff(pre_a.ref_chosen, pre_b.ref_chosen) <= 1e-6
    assert max_diff(pre_a.ref_rejected, pre_b.ref_rejected) <= 1e-6
    with torch.no_grad():
        on_the_fly = explicit.forward_items(setup.policy, batch).loss
        assert max_diff(adapter_ref.forward_items(setup.policy, pre_a).loss, on_the_fly) <= 1e-6


def test_dpo_lora_run_keeps_no_reference_copy(tmp_path):
    cfg = config(
        tmp_path,
        "dpo_argument.json",
        train_dataset_path=subset(tmp_path, SAMPLE, "pairs_train.jsonl", 8),
        max_steps=2,
        precompute_ref_log_probs=False,
    )
    model_args, data_args, training_args = parse_arguments([cfg], DPO_ARGUMENT_TYPES)
    validate_arguments(model_args, data_args, training_args)
    trainer, train, _ = build_dpo_trainer(RunContext.load(model_args, data_args, training_args))
    assert trainer.ref_model is None and trainer.adapter_reference
    train_and_evaluate(trainer, data_args, training_args, train)
    assert all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)


# --- resume, DDP ---------------------------------------------------------------------------------------


def test_resume_continues_the_adapter_and_its_optimizer(tmp_path):
    common = {
        "train_dataset_path": subset(tmp_path, SFT_DATA, "sft_train.jsonl", 16),
        "max_steps": 4,
        "save_strategy": "steps",
        "save_steps": 2,
        "learning_rate": 1e-2,
        "lr_scheduler_type": "linear",
    }
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    sft_main([config(tmp_path, "sft_argument.json", output_dir=str(full), **common)])
    index = read_json(full / "checkpoint-2" / "sharded_state" / "state.json")
    saved = json.dumps(index["tree"]["model"])
    assert "lora_A" in saved and "embed_tokens" not in saved  # only the trainable parameters, not the base
    for path in (full / "checkpoint-2").rglob("*"):
        assert path.suffix not in (".pt", ".pth", ".pkl", ".distcp"), path
    shutil.copytree(full / "checkpoint-2", resumed / "checkpoint-2")
    sft_main([config(tmp_path, "sft_argument.json", output_dir=str(resumed), resume_from_checkpoint="auto", **common)])
    wa = load_file(full / "adapter_model.safetensors")
    wb = load_file(resumed / "adapter_model.safetensors")
    assert wa.keys() == wb.keys() and max(max_diff(wa[k], wb[k]) for k in wa) <= 1e-6
    # the optimizer state went on too: without it (a fresh AdamW at step 2) the adapter would differ
    moved = max(max_diff(wa[k], load_file(full / "checkpoint-2" / "adapter_model.safetensors")[k]) for k in wa)
    assert moved > 1e-4


@pytest.mark.slow
def test_torchrun_two_processes_equal_one_process_double_batch(tmp_path):
    common = {
        "train_dataset_path": subset(tmp_path, SAMPLE, "pairs_train.jsonl", 8),
        "max_steps": 2,
        "optim": "sgd",
        "learning_rate": 0.5,
        "lr_scheduler_type": "constant",
        "max_grad_norm": 0.0,
        "zero_padding": False,
        "greedy_zero_padding": False,
        "precompute_ref_log_probs": False,  # the disabled-adapter reference on the fly, under DDP
    }
    one, two = tmp_path / "one", tmp_path / "two"
    dpo_main([config(tmp_path, "dpo_argument.json", output_dir=str(one), per_device_train_batch_size=2, **common)])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    cfg = config(tmp_path, "dpo_argument.json", output_dir=str(two), per_device_train_batch_size=1, **common)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone"]
    proc = subprocess.run(
        [*launcher, os.path.join(ROOT, "llm", "run_dpo.py"), cfg],
        env=env,
        timeout=300,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    wa, wb = load_file(one / "adapter_model.safetensors"), load_file(two / "adapter_model.safetensors")
    assert max(max_diff(wa[k], wb[k]) for k in wa) <= 1e-5
    assert max(wa[k].abs().max().item() for k in wa if "lora_B" in k) > 1e-4


# --- start-up checks -----------------------------------------------------------------------------------


def run_exit_2(main, cfg, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(main, [cfg])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err


def test_a_target_that_matches_no_module_names_the_modules_there_are(tmp_path, capsys):
    err = run_exit_2(sft_main, config(tmp_path, "sft_argument.json", target_modules=["q_proj", "qkv"]), capsys)
    assert "target_modules: 'qkv' matches no module" in err and "q_proj" in err and "down_proj" in err, err


def test_the_lm_head_as_a_target_is_refused(tmp_path, capsys):
    err = run_exit_2(sft_main, config(tmp_path, "sft_argument.json", target_modules="q_proj,lm_head"), capsys)
    assert "'lm_head' is the model's head" in err and "lora_train_head" in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA QLoRA is wired; this is the CPU refusal")
def test_qlora_on_a_cpu_stops_at_start_up(tmp_path, capsys):
    err = run_exit_2(dpo_main, config(tmp_path, "dpo_argument.json", weight_quantize_algo="nf4"), capsys)
    assert "weight_quantize_algo='nf4' (QLoRA)" in err and "CUDA" in err, err
    assert "bitsandbytes" not in sys.modules  # imported only when QLoRA can run


@pytest.mark.parametrize(
    "main, name, overrides, needle",
    [
        (sft_main, "sft_argument.json", {"lora_rank": 0}, "lora_rank must be > 0"),
        (sft_main, "sft_argument.json", {"lora_alpha": 0}, "lora_alpha must be > 0"),
        (sft_main, "sft_argument.json", {"lora_dropout": 1.0}, "lora_dropout must be in [0, 1)"),
        (sft_main, "sft_argument.json", {"lora": False, "lora_rank": 16}, "lora_rank only take(s) effect with lora"),
        (dpo_main, "dpo_argument.json", {"weight_quantize_algo": "int3"}, "weight_quantize_algo must be one of nf4"),
        (reward_main, "rm_argument.json", {"lora_path": "/nonexistent/adapter"}, "no PEFT adapter there"),
    ],
)
def test_bad_lora_settings_exit_2_with_message(tmp_path, capsys, main, name, overrides, needle):
    err = run_exit_2(main, config(tmp_path, name, **overrides), capsys)
    assert needle in err, err


def test_fsdp_and_tensor_parallel_stop_with_a_message():
    for layout in (Layout(2, tp=2), Layout(2, shard=2, stage=3)):
        with pytest.raises(UserError, match="not available for LoRA"):
            check_lora_arguments(ModelArgument(lora=True), SimpleNamespace(layout=layout))


def test_lora_path_continues_an_adapter(tmp_path):
    first = tmp_path / "first"
    train = subset(tmp_path, SFT_DATA, "sft_train.jsonl", 8)
    sft_main(
        [
            config(
                tmp_path,
                "sft_argument.json",
                output_dir=str(first),
                train_dataset_path=train,
                max_steps=2,
                learning_rate=1e-2,
                lora_rank=4,
            )
        ]
    )
    cfg = config(
        tmp_path,
        "sft_argument.json",
        output_dir=str(tmp_path / "second"),
        train_dataset_path=train,
        max_steps=1,
        lora_path=str(first),
    )
    model_args, data_args, training_args = parse_arguments([cfg])
    validate_arguments(model_args, data_args, training_args)
    trainer, _, _ = build_sft_trainer(RunContext.load(model_args, data_args, training_args))
    saved = load_file(first / "adapter_model.safetensors")
    state = {k.replace(".default", ""): v for k, v in trainer.model.state_dict().items() if ".lora_" in k}
    assert len(saved) == len(state) and all(torch.equal(state[k], v) for k, v in saved.items())
    assert trainer.model.peft_config["default"].r == 4
    assert all(p.requires_grad for n, p in trainer.model.named_parameters() if ".lora_" in n)


@pytest.mark.parametrize("main, name", [(sft_main, "sft_lora_argument.json"), (dpo_main, "dpo_lora_argument.json")])
def test_the_tiny_lora_demo_configs_run(tmp_path, main, name):
    with open(os.path.join(TINY, name), encoding="utf-8") as f:
        assert json.load(f)["lora"] is True
    folder = SFT_DATA if name.startswith("sft") else SAMPLE
    train = subset(tmp_path, folder, "sft_train.jsonl" if name.startswith("sft") else "pairs_train.jsonl", 8)
    main([config(tmp_path, name, train_dataset_path=train, max_steps=2)])
    out = tmp_path / "out"
    assert (out / "adapter_model.safetensors").exists() and (out / MERGED_DIR / "model.safetensors").exists()


def test_an_adapter_directory_as_the_model_says_how_to_load_it(tmp_path, capsys):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    cfg = config(tmp_path, "sft_argument.json", lora=False, model_name_or_path=str(adapter), init_from_config=False)
    err = run_exit_2(sft_main, cfg, capsys)
    assert "holds a PEFT (LoRA) adapter" in err and "lora_path" in err, err
