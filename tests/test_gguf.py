"""Training from a .gguf path in every script that loads models (SFT, LoRA, DPO, ORM, PRM, PPO's actor, reference,
critic and reward), on a tiny Llama written as a real Q8_0 GGUF file (tests/gguf_files.py); the saved models are
ordinary safetensors. Bad .gguf files (empty, not GGUF, truncated, corrupt) stop with one UserError."""

import json
import os
import shutil
import struct

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from llm.run_dpo import main as dpo_main
from llm.run_finetune import main as sft_main
from llm.run_ppo import main as ppo_main
from llm.run_reward import main as reward_main
from llm.utils.errors import UserError, run_cli
from llm.utils.modeling import load_model, load_tokenizer
from tests.gguf_files import VOCAB, write_tiny_gguf
from tests.helpers import ROOT, TOKENIZER_DIR, ppo_config_file, tiny_model, tokenizer

TINY = os.path.join(ROOT, "llm", "config", "tiny")
SAMPLE = os.path.join(ROOT, "llm", "data", "sample")
SAMPLE_SFT = os.path.join(ROOT, "llm", "data", "sample_sft")
LR = 1e-3  # AdamW's first step moves every weight with a gradient by about LR


@pytest.fixture(scope="module")
def source():
    """The tiny Llama the file is written from (seeded)."""
    return tiny_model(vocab=VOCAB, seed=0)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory, source) -> str:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf"
    write_tiny_gguf(path, source, TOKENIZER_DIR)
    return str(path)


@pytest.fixture(scope="module")
def initial(gguf) -> dict[str, torch.Tensor]:
    """The weights as every script loads them from the file (dequantised)."""
    return load_model(AutoModelForCausalLM, gguf, init_from_config=False, seed=0).state_dict()


@pytest.fixture
def saved(monkeypatch) -> dict[str, dict[str, torch.Tensor]]:
    """``{directory: the model's weights when it was saved there}``: what was trained, in memory. A final model
    is written into ``final.partial`` and moved into place; the key is where it ends up."""
    seen = {}
    save = transformers.PreTrainedModel.save_pretrained

    def recording(self, directory, *args, **kwargs):
        seen[str(directory).replace(os.sep + "final.partial", "")] = {
            k: v.detach().clone() for k, v in self.state_dict().items()
        }
        return save(self, directory, *args, **kwargs)

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", recording)
    return seen


def largest_change(trained: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> float:
    """max |trained - base| over the tensors both hold (the base's rows of a grown embedding)."""
    worst = 0.0
    for key, value in trained.items():
        if key in base:
            rows = tuple(slice(0, n) for n in base[key].shape)
            worst = max(worst, (value[rows] - base[key]).abs().max().item())
    return worst


def check_saved(directory, trained: dict[str, torch.Tensor], base: dict[str, torch.Tensor], auto_class) -> None:
    """The model saved in ``directory`` moved away from the file's weights by about a first AdamW step, and is
    plain safetensors: ``from_pretrained`` (no gguf) reloads exactly what was trained."""
    assert largest_change(trained, base) >= LR / 2
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
        assert "quantization_config" not in json.load(f)
    assert set(load_file(os.path.join(directory, "model.safetensors"))) <= set(trained)
    state = auto_class.from_pretrained(directory, dtype=torch.float32).state_dict()
    assert state.keys() == trained.keys()
    assert all(torch.equal(state[k], v) for k, v in trained.items())


def head(tmp_path, folder: str, name: str, n: int) -> str:
    with open(os.path.join(folder, name), encoding="utf-8") as f:
        lines = [line for _, line in zip(range(n), f)]
    path = tmp_path / f"{n}_{name}"
    path.write_text("".join(lines), encoding="utf-8")
    return str(path)


def flat_config(tmp_path, name: str, gguf: str, **overrides) -> str:
    """llm/config/tiny/``name`` on the GGUF file (model and tokenizer), two steps, no checkpoints or evaluation."""
    with open(os.path.join(TINY, name), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg.update(
        model_name_or_path=gguf,
        tokenizer_name_or_path=gguf,
        init_from_config=False,
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        learning_rate=LR,
        warmup_steps=0,
        lr_scheduler_type="constant",
        logging_steps=1,
        max_seq_len=256,
        max_prompt_len=128,
        do_eval=False,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    cfg.update(overrides)
    path = tmp_path / f"{len(list(tmp_path.glob('*_' + name)))}_{name}"
    path.write_text(json.dumps(cfg, ensure_ascii=False), encoding="utf-8")
    return str(path)


# --- the file itself -------------------------------------------------------------------------------------------


def test_gguf_loads_dequantized_as_an_ordinary_model(gguf, source):
    model = load_model(AutoModelForCausalLM, gguf, init_from_config=False, seed=0)
    # nothing of transformers' GGUF quantizer is left: Trainer and peft take it for an ordinary float model
    assert model.is_quantized is False and getattr(model, "hf_quantizer", None) is None
    assert "quantization_config" not in model.config.to_dict()
    transformers.trainer_utils.validate_quantization_for_training(model)  # "purely quantized models" before
    assert all(p.dtype == torch.float32 and p.requires_grad for p in model.parameters())
    # the weights written: Q8_0 stores each value as a multiple q (|q| <= 127) of its 32-value block's scale
    # d = max|w| / 127, d in fp16: off by at most d / 2 + 127 * d * 2**-11 (the scale's rounding) < 0.57 d. The q
    # and k rows come back in transformers' order (a wrong permutation is off by about max|w|).
    loaded, written = model.state_dict(), source.state_dict()
    assert loaded.keys() == written.keys()
    for key, value in written.items():
        bound = value.abs().max().item() / 127 * 0.57 if value.ndim == 2 else 0.0  # norms: F32
        assert (loaded[key] - value).abs().max().item() <= bound, key
    assert model.config.name_or_path == gguf
    tok, ref = load_tokenizer(gguf), tokenizer()
    assert tok.chat_template == ref.chat_template and len(tok) == VOCAB
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (ref.pad_token_id, ref.bos_token_id, 2)
    with pytest.raises(UserError, match=r"GGUF file, read as float weights.*weight_quantize_algo"):
        load_model(AutoModelForCausalLM, gguf, init_from_config=False, seed=0, quantization_config=object())


# --- every script trains from it -------------------------------------------------------------------------------

FLAT = {  # config, script, data (file, records), the saved model's class
    "sft": ("sft_argument.json", sft_main, (SAMPLE_SFT, "sft_train.jsonl", 8), AutoModelForCausalLM),
    "sft_lora": ("sft_lora_argument.json", sft_main, (SAMPLE_SFT, "sft_train.jsonl", 8), AutoModelForCausalLM),
    "dpo": ("dpo_argument.json", dpo_main, (SAMPLE, "pairs_train.jsonl", 8), AutoModelForCausalLM),
    "orm": ("rm_argument.json", reward_main, (SAMPLE, "pairs_train.jsonl", 8), AutoModelForSequenceClassification),
    "prm": ("prm_argument.json", reward_main, (SAMPLE, "prm_train.jsonl", 8), AutoModelForCausalLM),
}


@pytest.mark.parametrize("script", list(FLAT))
def test_each_flat_script_trains_from_gguf_and_saves_safetensors(tmp_path, gguf, initial, saved, script):
    name, main, (folder, data, n), auto_class = FLAT[script]
    # a PRM's placeholder ки is no token of the file's vocabulary (transformers drops a byte-level file's
    # non-ASCII added tokens): added, which grows the dequantised model's embeddings by a row
    extra = {"add_placeholder_token": True} if script == "prm" else {}
    main([flat_config(tmp_path, name, gguf, train_dataset_path=head(tmp_path, folder, data, n), **extra)])
    out = tmp_path / "out"
    if script == "sft_lora":  # the adapter names the file it was trained on; the merged model is plain
        with open(out / "adapter_config.json", encoding="utf-8") as f:
            assert json.load(f)["base_model_name_or_path"] == gguf
        out = out / "merged"
    check_saved(out, saved[str(out)], initial, auto_class)


@pytest.mark.parametrize("lora", [False, True])
def test_ppo_roles_train_from_gguf(tmp_path, gguf, initial, saved, lora):
    """Actor, reference (another copy of the file: another path), reward (an ORM) and critic (from the reward)
    all from .gguf files; with ``lora`` the actor and the critic are LoRA adapters on the file's weights (the
    reference: the actor's base)."""
    ref = tmp_path / "ref.gguf"
    shutil.copyfile(gguf, ref)
    roles = {
        "actor_rollout": {"model_name_or_path": gguf, "tokenizer_name_or_path": gguf, "init_from_config": False},
        "ref": {} if lora else {"model_name_or_path": str(ref)},
        "reward": {"type": "orm", "model_name_or_path": gguf, "init_from_config": False},
        "critic": {"lora_merge": True} if lora else {},
        "training": {"max_steps": 2},
    }
    small = {
        "actor_rollout": {"max_response_length": 8, "ppo_mini_batch_size": 4, "ppo_epochs": 1},
        "critic": {"critic_mini_batch_size": 4, "critic_update_epochs": 1},
        "data": {"rollout_batch_size": 4},
    }
    name = "ppo_lora_argument.json" if lora else "ppo_argument.json"
    path = ppo_config_file(tmp_path, os.path.join(TINY, name), "ppo", small, roles)
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["reward"].pop("rule", None)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    ppo_main([path])
    out = tmp_path / "out"
    merged = "merged" if lora else ""  # a LoRA role's adapter merged into the file's weights
    actor, critic = out / "actor" / merged, out / "critic" / merged
    check_saved(actor, saved[str(actor)], initial, AutoModelForCausalLM)
    check_saved(critic, saved[str(critic)], initial, AutoModelForSequenceClassification)


# --- bad files -------------------------------------------------------------------------------------------------


def _tensor_type_at(good: bytes) -> int:
    """Where the first tensor entry's ggml type is: name (u64 length + bytes), u32 dims, u64 x dims, u32 type."""
    name = b"token_embd.weight"
    at = good.index(name) + len(name)
    (dims,) = struct.unpack_from("<I", good, at)
    return at + 4 + 8 * dims


REFETCH = "download or convert the model again"
BAD = {  # what is done to a good file -> what the message says, and the fix it gives
    "empty": (lambda good: b"", "is empty (0 bytes), not a GGUF file", REFETCH),
    "not GGUF": (
        lambda good: b'{"model_type": "llama"}\n',
        "is not a GGUF file (it starts with b'{\"mo', not b'GGUF')",
        "give a GGUF file (llama.cpp's format) or a Hugging Face model directory",
    ),
    "truncated header": (lambda good: good[:100], "truncated or corrupt: it says 2", REFETCH),
    "truncated data": (lambda good: good[:-100], "the GGUF file is truncated: its 21 tensors end at byte", REFETCH),
    "corrupt string length": (
        lambda good: good[:24] + struct.pack("<Q", 2**62) + good[32:],
        "truncated or corrupt: it ends at byte",
        REFETCH,
    ),
    "corrupt tensor type": (
        lambda good: good[: _tensor_type_at(good)] + struct.pack("<I", 999) + good[_tensor_type_at(good) + 4 :],
        "tensor 'token_embd.weight' is of ggml type 999",
        REFETCH,
    ),
    "unknown version": (
        lambda good: good[:4] + struct.pack("<I", 9) + good[8:],
        "is GGUF version 9",
        "convert the model again with a current llama.cpp",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_gguf_file_is_one_user_error(tmp_path, capsys, gguf, case):
    """Each stops the run with exit 2 and one message naming the file and the fix, never a struct.error from
    inside transformers' reader; the tokenizer's and the model's loader say the same."""
    change, needle, fix = BAD[case]
    with open(gguf, "rb") as f:
        bad = tmp_path / "model.gguf"
        bad.write_bytes(change(f.read()))
    with pytest.raises(SystemExit) as exit_info:
        run_cli(sft_main, [flat_config(tmp_path, "sft_argument.json", str(bad))])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    assert str(bad) in err and needle in err and fix in err, err
    with pytest.raises(UserError, match="model.gguf") as raised:
        load_model(AutoModelForCausalLM, str(bad), init_from_config=False, seed=0)
    assert needle in str(raised.value)


def test_gguf_without_the_model_shape_stops_before_building_it(tmp_path, monkeypatch, source):
    """Without llama.block_count etc. transformers would fall back to its defaults, a 7B Llama, and exhaust
    the memory building it: the model the metadata describes is counted on the meta device first."""
    path = tmp_path / "no_shape.gguf"
    write_tiny_gguf(path, source, TOKENIZER_DIR, shape_keys=False)

    def never(*args, **kwargs):  # were the check gone, this test must fail, not take 26 GB
        raise AssertionError("from_pretrained was called: it would build a 7B model")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", never)
    with pytest.raises(UserError, match=r"describes a llama model of [\d,]+ parameters but the file holds") as raised:
        load_model(AutoModelForCausalLM, str(path), init_from_config=False, seed=0)
    assert str(path) in str(raised.value)
