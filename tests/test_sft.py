"""SFT numerics: only response tokens are targets (checked on decoded text, plain and chat template, multi-turn);
the packed loss equals each example run alone and a naive full-LM-head cross-entropy oracle; chunked
readouts equal unchunked ones (values and gradients); the loss is a token mean, so accumulation
4 x 1 == batch 4; over-long conversations are cut or skipped and counted."""

import math
import os

import pytest
import torch
import torch.nn.functional as F

from llm.alignment.lm import readout_log_probs
from llm.alignment.sft.loss import perplexity
from llm.alignment.sft.trainer import SFTTrainer
from llm.data.encode_lm import encode_sft, render_conversation
from llm.data.encoding import EncodeConfig, OverlongCounter
from llm.data.packing import collate, pack
from llm.data.readers import SFTRecord, read_records
from llm.settings.flat import TrainingArguments
from tests.helpers import ROOT, tiny_model, tokenizer, twin

SFT_TRAIN = os.path.join(ROOT, "llm", "data", "sample_sft", "sft_train.jsonl")


def args(tmp_path, **kw):
    base = {
        "output_dir": str(tmp_path),
        "report_to": "none",
        "use_cpu": True,
        "disable_tqdm": True,
        "save_strategy": "no",
        "logging_strategy": "no",
        "seed": 0,
        "dataloader_num_workers": 0,
    }
    base.update(kw)
    return TrainingArguments(**base)


def conversation(*turns: str) -> SFTRecord:
    roles = ["user", "assistant"] * len(turns)
    return SFTRecord([{"role": r, "content": t} for r, t in zip(roles, turns)], "mem", 0)


def encode(records, chat=False, max_len=1024, policy="truncate"):
    tok = tokenizer()
    cfg = EncodeConfig(max_len, min(256, max_len - 1), policy, chat)
    counter = OverlongCounter()
    return [encode_sft(r, tok, cfg, i, counter) for i, r in enumerate(records)], counter


def target_text(ex) -> str:
    return tokenizer().decode([ex.input_ids[p + 1] for p in ex.readout_position])


def test_targets_are_the_responses_plain_text():
    record = conversation("What is 2 + 3?", "2 + 3 = 5.\nThe answer is 5.")
    (ex,), _ = encode([record])
    tok = tokenizer()
    # targets are the response and EOS, each predicted from the token before it
    assert target_text(ex) == "2 + 3 = 5.\nThe answer is 5.</s>"
    assert all(ex.input_ids[p + 1] == t for p, t in zip(ex.readout_position, ex.readout_target))
    # the prompt is exactly what render_prompt gives (BOS, question, newline) and carries no target
    first = ex.readout_position[0] + 1
    assert tok.decode(ex.input_ids[:first]) == "<s>What is 2 + 3?\n"


@pytest.mark.parametrize("chat", [False, True])
def test_every_assistant_turn_is_a_target_in_multi_turn(chat):
    record = conversation("Q one?", "A one.", "Q two?", "A two.")
    (ex,), _ = encode([record], chat=chat)
    if chat:  # the template's end-of-turn text belongs to the turn; the user turns and markup do not
        assert target_text(ex) == "A one.</s>\nA two.</s>\n"
        full = tokenizer().apply_chat_template(record.messages, tokenize=False)
        assert tokenizer().decode(ex.input_ids) == full
    else:
        assert target_text(ex) == "A one.</s>A two.</s>"
        assert tokenizer().decode(ex.input_ids) == "<s>Q one?\nA one.</s>Q two?\nA two.</s>"


def test_segments_of_a_rewriting_template_are_refused():
    tok = tokenizer()
    tok.chat_template = "{% for m in messages[-1:] %}{{ m.content }}{% endfor %}"  # keeps only the last message
    with pytest.raises(ValueError, match="growing prefixes"):
        render_conversation(conversation("q1", "a1", "q2", "a2").messages, tok, True)


def test_overlong_truncate_keeps_the_start_and_skip_drops():
    long = conversation("Q?", " ".join(["step"] * 200))
    (ex,), counter = encode([long], max_len=64)
    assert len(ex) == 64 and counter["truncated"] == 1
    assert target_text(ex).startswith("step step")
    (skipped,), counter = encode([long], max_len=64, policy="skip")
    assert skipped is None and counter["skipped"] == 1


@pytest.fixture(scope="module")
def examples():
    return encode(read_records(SFT_TRAIN, "sft")[:12])[0]


@pytest.mark.parametrize("strategy", [None, "greedy"])
def test_packed_loss_equals_each_example_alone_and_the_naive_oracle(tmp_path, examples, strategy):
    model = tiny_model("llama").eval()
    stock = twin(model, "sdpa").eval()
    trainer = SFTTrainer(model=model, args=args(tmp_path))
    rows, _ = pack(examples, 1024, strategy)
    batch = collate(rows, pad_token_id=0)
    with torch.no_grad():
        out = trainer.forward_items(model, batch)
        packed = {ex["record"]: ex["nll"] for ex in trainer.example_outputs(batch, out)}
        alone = [trainer.forward_items(model, collate(pack([e], 1024, None)[0], 0)).loss.sum().item() for e in examples]
        # Oracle: each example alone, full LM head at every position, Hugging Face's own labels and loss.
        oracle = []
        for ex in examples:
            ids = torch.tensor([ex.input_ids])
            labels = torch.full_like(ids, -100)
            labels[0, [p + 1 for p in ex.readout_position]] = torch.tensor(ex.readout_target)
            hf = stock(input_ids=ids, labels=labels)
            naive = F.cross_entropy(hf.logits[0, :-1], ids[0, 1:], reduction="none")[labels[0, 1:] != -100]
            assert torch.allclose(naive.mean(), hf.loss, atol=1e-6)
            oracle.append(naive.sum().item())
    tokens = sum(len(ex.readout_position) for ex in examples)
    assert out.loss.numel() == tokens and len(packed) == len(examples)
    for i in range(len(examples)):  # summed NLL of each example, ~1e2: fp32 agreement ~1e-5 relative
        assert abs(packed[i] - oracle[i]) <= 1e-5 * oracle[i] and abs(alone[i] - oracle[i]) <= 1e-5 * oracle[i]
    assert abs(out.loss.mean().item() - sum(oracle) / tokens) <= 1e-5  # the token-mean loss
    ppl = trainer.metrics(trainer.example_outputs(batch, out))["ppl"]
    assert abs(ppl - math.exp(sum(oracle) / tokens)) <= 1e-5 * ppl


def test_chunked_readouts_equal_unchunked_with_gradients():
    torch.manual_seed(0)
    hidden = torch.randn(50, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    targets = torch.randint(0, 40, (50,))
    grads, hits = [], []
    for chunk in (1000, 7):
        out, hit = readout_log_probs(hidden, targets, weight, None, chunk_size=chunk)
        (g_h, g_w) = torch.autograd.grad((out * torch.linspace(0.5, 1.5, 50)).sum(), (hidden, weight))
        grads.append((out.detach(), g_h, g_w))
        hits.append(hit)
    for a, b in zip(grads[0], grads[1]):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)
    # the naive form
    logits = hidden @ weight.T
    assert torch.allclose(grads[0][0], logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0], atol=1e-6)
    assert torch.equal(hits[0], logits.argmax(-1) == targets) and torch.equal(hits[0], hits[1])


def test_token_accuracy_metric_counts_argmax_hits_over_answer_tokens():
    # two examples: 3 answer tokens with 2 hits, 1 token with 0 hits -> 2 / 4 over all answer tokens
    # (a token mean, not a mean of per-example accuracies, which would give (2/3 + 0) / 2)
    examples = [{"record": 0, "nll": 3.0, "tokens": 3, "hits": 2}, {"record": 1, "nll": 1.0, "tokens": 1, "hits": 0}]
    metrics = SFTTrainer.metrics(None, examples)
    assert metrics["accuracy"] == 0.5 and abs(metrics["ppl"] - math.exp(1.0)) < 1e-12


def test_perplexity():
    assert perplexity(0.0, 10) == 1.0
    assert abs(perplexity(10 * math.log(4), 10) - 4.0) < 1e-12
    assert perplexity(1e6, 1) == math.inf


def one_sgd_step(tmp_path, rows, batch_size, accumulation):
    model = tiny_model("llama", seed=3)
    trainer = SFTTrainer(
        model=model,
        args=args(
            tmp_path,
            per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=accumulation,
            max_steps=1,
            optim="sgd",
            learning_rate=0.5,
            max_grad_norm=0.0,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
        ),
        train_dataset=rows,
        data_collator=lambda r: collate(r, pad_token_id=0),
        readout_chunk=64,  # exercises the checkpointed chunks in backward too
    )
    trainer.train()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_accumulation_4x1_equals_batch_4(tmp_path, examples):
    # Rows holding different numbers of target tokens, so a per-micro-batch mean would give a different update.
    rows, _ = pack(examples, 300, "sequential")
    rows = rows[:4]
    counts = [len(r.readout_position) for r in rows]
    assert len(set(counts)) > 1, counts
    init = tiny_model("llama", seed=3).state_dict()
    big = one_sgd_step(tmp_path / "a", rows, 4, 1)
    small = one_sgd_step(tmp_path / "b", rows, 1, 4)
    moved = max((big[k] - init[k]).abs().max().item() for k in big)
    assert moved > 1e-4
    worst = max((big[k] - small[k]).abs().max().item() for k in big)
    assert worst <= 1e-6 * max(1.0, moved) + 1e-7, worst
