"""llm.data.readers: formats, schemas, multi-turn order, validation messages, mixing, lazy reading."""

import dataclasses
import json
import os
import random
import re
import tracemalloc
from collections import Counter
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

from llm.data import readers
from llm.data.readers import (
    PairRecord,
    PRMRecord,
    PromptRecord,
    iter_records,
    load_dataset_records,
    read_records,
)
from llm.utils.errors import UserError

datasets.disable_progress_bars()

SAMPLE_DIR = Path(readers.__file__).parent.parent / "sample"

PRM = [
    {"src": ["What is 2 + 3?"], "tgt": [], "responses": ["2 + 3 = 5.", "The answer is 5."], "labels": ["+", "+"]},
    {
        "src": ["What is 4 * 2?", "And minus 1?"],
        "tgt": ["4 * 2 = 8."],
        "responses": ["8 - 1 = 6.", "The answer is 6."],
        "labels": ["-", "-"],
    },
    {"src": ["Hi?"], "tgt": [], "responses": ["one"], "labels": ["+"], "system": "Be brief."},
]
PAIR = [
    {"src": ["Q0"], "tgt": [], "response": ["bad", "good"], "sort": [0, 1]},
    {"src": ["Q1 first", "Q1 second"], "tgt": ["A1 first"], "response": ["best", "worse"], "sort": [2.5, -1]},
]
PROMPT = [{"src": "P0", "tgt": "10"}, {"src": "P1", "tgt": "11"}]
# Math-Shepherd without a separate prompt: PaddleNLP's conversion and the Hugging Face rows.
SHEPHERD = [
    {"src": [""], "tgt": [], "responses": ["What is 2 + 3? Step 1: 2 + 3 = 5.", "Step 2: 5"], "labels": ["+", "-"]},
    {
        "input": "What is 2 + 3? Step 1: 2 + 3 = 5. ки\nStep 2: 5 ки",
        "label": "What is 2 + 3? Step 1: 2 + 3 = 5. +\nStep 2: 5 -",
        "task": "GSM8K",
    },
]


def strip_source(records):
    return [{k: v for k, v in dataclasses.asdict(r).items() if k != "source"} for r in records]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return str(path)


def write_json_list(path, records):
    path.write_text(json.dumps(records, ensure_ascii=False, indent=2), encoding="utf-8")
    return str(path)


def write_parquet(path, records):
    columns = list(dict.fromkeys(k for r in records for k in r))  # from_pylist only looks at the first row
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in columns} for r in records]), path)
    return str(path)


def write_hf(path, records, split=None):
    columns = list(dict.fromkeys(k for r in records for k in r))  # from_list only looks at the first row
    ds = datasets.Dataset.from_list([{k: r.get(k) for k in columns} for r in records])
    (datasets.DatasetDict({split: ds}) if split else ds).save_to_disk(str(path))
    return str(path)


# ---------------------------------------------------------------------------------------------
# Formats
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind,records",
    [("prm", PRM), ("prm", SHEPHERD), ("pair", PAIR), ("prompt", PROMPT)],
    ids=["prm", "prm-shepherd", "pair", "prompt"],
)
def test_every_format_reads_the_same_records(tmp_path, kind, records):
    files = [
        write_jsonl(tmp_path / "d.jsonl", records),
        write_jsonl(tmp_path / "lines.json", records),  # JSON lines in a .json file
        write_json_list(tmp_path / "list.json", records),
        write_json_list(tmp_path / "list.jsonl", records),  # a list in a .jsonl file
        write_parquet(tmp_path / "d.parquet", records),
        write_hf(tmp_path / "hf_ds", records),
        write_hf(tmp_path / "hf_dict", records, split="train"),
    ]
    expected = strip_source(read_records(files[0], kind))
    assert len(expected) == len(records)
    assert [r["index"] for r in expected] == list(range(len(records)))
    for f in files:
        got = read_records(f, kind)
        assert strip_source(got) == expected, f
        assert {r.source for r in got} == {f}
        assert strip_source(iter_records(f, kind)) == expected, f
        assert strip_source(load_dataset_records(f, kind, lazy=True)) == expected, f


def test_sample_files_read():
    assert len(read_records(SAMPLE_DIR / "prm_train.jsonl", "prm")) == 6000
    path = SAMPLE_DIR / "pairs_train.jsonl"
    pairs = read_records(str(path), "pair")
    two_turn = sum(len(json.loads(line)["src"]) == 2 for line in path.read_text().splitlines())
    assert len(pairs) == 800 and sum(len(p.prompt) == 3 for p in pairs) == two_turn > 0
    prompts = read_records(str(SAMPLE_DIR / "prompts.jsonl"), "prompt")
    assert len(prompts) == 300 and all(p.reference for p in prompts)


def test_blank_lines_and_bom_in_json_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\xef\xbb\xbf\n" + json.dumps(PROMPT[0]).encode() + b"\r\n\r\n" + json.dumps(PROMPT[1]).encode())
    recs = read_records(str(path), "prompt")
    assert [(r.index, r.reference) for r in recs] == [(0, "10"), (1, "11")]


def test_json_list_streaming_matches_json_load_at_any_chunk_size(tmp_path, monkeypatch):
    rng = random.Random(0)
    records = [
        {
            "src": f'q{i} \u00e9\u4e2d \\ "x" {"y" * rng.randrange(40)}',
            "tgt": str(rng.randrange(10 ** rng.randrange(1, 12))),
        }
        for i in range(60)
    ]
    path = tmp_path / "d.json"
    path.write_text(
        "\n[\n" + ",\n  ".join(json.dumps(r, ensure_ascii=i % 2 == 0) for i, r in enumerate(records)) + "]\n"
    )
    want = [(r["src"], r["tgt"]) for r in json.loads(path.read_text())]
    for chunk in (1, 2, 3, 7, 64, 1 << 20):
        monkeypatch.setattr(readers.sources, "_JSON_CHUNK", chunk)
        got = read_records(str(path), "prompt")
        assert [(r.prompt[0]["content"], r.reference) for r in got] == want, chunk


def test_number_reference_is_not_cut_at_a_chunk_boundary(tmp_path, monkeypatch):
    path = tmp_path / "d.json"
    path.write_text('[{"prompt": "p", "answer": 1234567890}]')
    for chunk in range(1, 40):
        monkeypatch.setattr(readers.sources, "_JSON_CHUNK", chunk)
        assert read_records(str(path), "prompt")[0].reference == "1234567890"


def test_json_list_records_get_line_numbers(tmp_path):
    bad = PRM[:2] + [{**PRM[0], "labels": ["+"]}]
    path = write_json_list(tmp_path / "d.json", bad)
    starts = [i + 1 for i, line in enumerate(json.dumps(bad, indent=2).splitlines()) if line == "  {"]
    with pytest.raises(UserError) as exc:
        read_records(path, "prm")
    assert len(starts) == 3 and f"record 2 (line {starts[2]})" in str(exc.value)


# ---------------------------------------------------------------------------------------------
# Prompts, multi-turn and TRL formats
# ---------------------------------------------------------------------------------------------


def test_multi_turn_order_is_src0_tgt0_src1(tmp_path):
    rec = {"src": ["u0", "u1", "u2"], "tgt": ["a0", "a1"], "response": ["x", "y"], "sort": [1, 0]}
    (pair,) = read_records(write_jsonl(tmp_path / "d.jsonl", [rec]), "pair")
    assert pair.prompt == [
        {"role": "user", "content": "u0"},
        {"role": "assistant", "content": "a0"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
    ]
    assert (pair.chosen, pair.rejected) == ("x", "y")
    prm = read_records(write_jsonl(tmp_path / "p.jsonl", PRM), "prm")
    assert [m["role"] for m in prm[1].prompt] == ["user", "assistant", "user"]
    assert [m["content"] for m in prm[1].prompt] == ["What is 4 * 2?", "4 * 2 = 8.", "And minus 1?"]
    assert prm[2].prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    assert prm[1].labels == ["-", "-"] and prm[1].steps == ["8 - 1 = 6.", "The answer is 6."]


def test_paddle_pair_higher_sort_is_chosen(tmp_path):
    recs = read_records(write_jsonl(tmp_path / "d.jsonl", PAIR), "pair")
    assert [(r.chosen, r.rejected) for r in recs] == [("good", "bad"), ("best", "worse")]
    assert all(isinstance(r, PairRecord) for r in recs)


def test_trl_stepwise_prm(tmp_path):
    rec = {"prompt": "Q?", "completions": ["s1", "s2", "s3"], "labels": [True, False, False]}
    (r,) = read_records(write_jsonl(tmp_path / "d.jsonl", [rec]), "prm", reward_tokens="good,bad")
    assert isinstance(r, PRMRecord)
    assert r.prompt == [{"role": "user", "content": "Q?"}]
    assert r.steps == ["s1", "s2", "s3"] and r.labels == ["good", "bad", "bad"]
    # booleans survive parquet
    (p,) = read_records(write_parquet(tmp_path / "d.parquet", [rec]), "prm")
    assert p.labels == ["+", "-", "-"]


def test_math_shepherd_layouts_have_no_separate_prompt(tmp_path):
    a, b = read_records(write_jsonl(tmp_path / "d.jsonl", SHEPHERD), "prm")
    assert a.prompt == b.prompt == []
    assert a.steps == b.steps == ["What is 2 + 3? Step 1: 2 + 3 = 5.", "Step 2: 5"]
    assert a.labels == b.labels == ["+", "-"]
    # the steps re-joined as the trainer does are exactly the Hugging Face row's input
    from llm.data.encode_reward import prm_response_text

    assert prm_response_text(b.steps, "ки") == SHEPHERD[1]["input"]
    # src as an empty string, other placeholder and reward tokens, a label mark that is a prefix of the other
    records = [
        {"src": "", "responses": ["q s1", "s2"], "labels": [True, False]},
        {"input": "q s1 <step>\ns2 <step>\n", "label": "q s1 ok\ns2 okay\n"},
    ]
    a, b = read_records(
        write_jsonl(tmp_path / "e.jsonl", records), "prm", reward_tokens="okay,ok", placeholder="<step>"
    )
    assert a.prompt == b.prompt == [] and a.steps == b.steps == ["q s1", "s2"]
    assert a.labels == ["okay", "ok"] and b.labels == ["ok", "okay"]


def test_trl_pair_forms(tmp_path):
    user = [{"role": "system", "content": "sys"}, {"role": "user", "content": "Q?"}]
    records = [
        {"prompt": "Q?", "chosen": "yes", "rejected": "no"},
        {  # explicit prompt, answers as one assistant message
            "prompt": user,
            "chosen": [{"role": "assistant", "content": "yes"}],
            "rejected": [{"role": "assistant", "content": "no"}],
        },
        {  # implicit prompt: full conversations sharing the prompt
            "chosen": user + [{"role": "assistant", "content": "yes"}],
            "rejected": user + [{"role": "assistant", "content": "no"}],
        },
        {  # ultrafeedback style: string prompt, chosen holds the whole conversation
            "prompt": "Q?",
            "chosen": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "yes"}],
            "rejected": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "no"}],
            "system": "sys",
        },
    ]
    recs = read_records(write_jsonl(tmp_path / "d.jsonl", records), "pair")
    assert all((r.chosen, r.rejected) == ("yes", "no") for r in recs)
    assert recs[0].prompt == [{"role": "user", "content": "Q?"}]
    assert recs[1].prompt == recs[2].prompt == recs[3].prompt == user
    # message lists through parquet (list<struct>; the absent prompt becomes null)
    got = read_records(write_parquet(tmp_path / "d.parquet", records[1:3]), "pair")
    assert strip_source(got) == [{**r, "index": r["index"] - 1} for r in strip_source(recs[1:3])]


def test_prompt_kind_references(tmp_path):
    records = [
        {"src": "q"},
        {"src": ["u0", "u1"], "tgt": ["a0"]},
        {"src": ["u0", "u1"], "tgt": ["a0", "ref"]},
        {"prompt": "q", "reference": "r"},
        {"prompt": "q", "answer": 42},
        {"prompt": [{"role": "user", "content": "q"}], "tgt": "t"},
        {"src": "q", "answer": "from answer"},
        {"prompt": "q", "system": "sys"},
    ]
    recs = read_records(write_jsonl(tmp_path / "d.jsonl", records), "prompt")
    assert all(isinstance(r, PromptRecord) for r in recs)
    assert [r.reference for r in recs] == [None, None, "ref", "r", "42", "t", "from answer", None]
    assert [m["role"] for m in recs[2].prompt] == ["user", "assistant", "user"]
    assert recs[2].prompt == recs[1].prompt
    assert recs[7].prompt[0] == {"role": "system", "content": "sys"}


# ---------------------------------------------------------------------------------------------
# Bad input: every case has its own message naming file, record, line, field
# ---------------------------------------------------------------------------------------------

GOOD = {"prm": PRM[0], "pair": PAIR[0], "prompt": PROMPT[0]}
BAD_CASES = [
    # (id, kind, bad record, field, other expected text)
    ("length", "prm", {**PRM[0], "labels": ["+"]}, "'labels'", ["1 label(s)", "2 step(s)", "one label per step"]),
    ("label", "prm", {**PRM[0], "labels": ["+", "x"]}, "'labels'", ["label 1 is 'x'", "'+', '-'"]),
    ("label-int", "prm", {**PRM[0], "labels": ["+", 1]}, "'labels'", ["label 1 is 1", "reward tokens"]),
    ("placeholder", "prm", {**PRM[0], "responses": ["a ки", "b"]}, "'responses'", ["step 0", "placeholder text 'ки'"]),
    ("empty-step", "prm", {**PRM[0], "responses": ["a", "  "]}, "'responses'", ["step 1 is empty"]),
    ("no-steps", "prm", {**PRM[0], "responses": [], "labels": []}, "'responses'", ["no steps"]),
    ("labels-type", "prm", {**PRM[0], "labels": "++"}, "'labels'", ["must be a list", "got string"]),
    ("steps-type", "prm", {**PRM[0], "responses": "a. b."}, "'responses'", ["list of step strings"]),
    ("prm-missing", "prm", {"src": ["q"], "responses": ["a"]}, "'labels'", ["missing required field", "TRL"]),
    ("prm-none", "prm", {"question": "q"}, None, ["missing required fields", "'question'", "completions"]),
    ("trl-missing", "prm", {"prompt": "q", "labels": [True]}, "'completions'", ["TRL stepwise"]),
    ("trl-label", "prm", {"prompt": "q", "completions": ["a"], "labels": ["yes"]}, "'labels'", ["'yes'"]),
    ("mixed", "prm", {**PRM[0], "prompt": "q"}, None, ["mixes PaddleNLP", "TRL"]),
    ("sort-equal", "pair", {**PAIR[0], "sort": [1, 1]}, "'sort'", ["same sort value"]),
    ("sort-type", "pair", {**PAIR[0], "sort": ["1", "0"]}, "'sort'", ["two numbers"]),
    ("sort-bool", "pair", {**PAIR[0], "sort": [True, False]}, "'sort'", ["two numbers"]),
    (
        "response-3",
        "pair",
        {**PAIR[0], "response": ["a", "b", "c"]},
        "'response'",
        ["exactly two strings", "list of 3"],
    ),
    ("response-str", "pair", {**PAIR[0], "response": "a"}, "'response'", ["exactly two strings", "got string"]),
    ("response-empty", "pair", {**PAIR[0], "response": ["a", " "]}, "'response'", ["response 1 is empty"]),
    ("chosen-empty", "pair", {"prompt": "q", "chosen": " ", "rejected": "r"}, "'chosen'", ["answer is empty"]),
    ("rejected-empty", "pair", {"prompt": "q", "chosen": "c", "rejected": ""}, "'rejected'", ["answer is empty"]),
    ("rejected-missing", "pair", {"prompt": "q", "chosen": "c"}, "'rejected'", ["missing", "PaddleNLP"]),
    ("no-prompt", "pair", {"chosen": "c", "rejected": "r"}, "'prompt'", ["missing required field 'prompt'"]),
    (
        "implicit-differs",
        "pair",
        {
            "chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "c"}],
            "rejected": [{"role": "user", "content": "b"}, {"role": "assistant", "content": "r"}],
        },
        "'rejected'",
        ["share every message"],
    ),
    (
        "prompt-ends-assistant",
        "pair",
        {
            "prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "chosen": "c",
            "rejected": "r",
        },
        "'prompt'",
        ["ends with a assistant message"],
    ),
    (
        "bad-role",
        "pair",
        {"prompt": [{"role": "human", "content": "q"}], "chosen": "c", "rejected": "r"},
        "'prompt'",
        ["role 'human'"],
    ),
    ("turns", "pair", {**PAIR[0], "tgt": ["a"]}, "'tgt'", ["src has 1 turn(s) and tgt has 1", "exactly one turn more"]),
    ("turns-2", "prm", {**PRM[0], "src": ["a", "b"]}, "'tgt'", ["src has 2 turn(s) and tgt has 0"]),
    ("src-type", "pair", {**PAIR[0], "src": [1]}, "'src'", ["string or a list of strings"]),
    ("src-dict", "prm", {**PRM[0], "src": {"q": 1}}, "'src'", ["got object"]),
    ("empty-prompt", "pair", {**PAIR[0], "src": ["  "]}, "'src'", ["prompt is empty"]),
    ("empty-src-list", "prm", {**PRM[0], "src": []}, "'src'", ["prompt is empty"]),
    ("empty-trl-prompt", "pair", {"prompt": "", "chosen": "c", "rejected": "r"}, "'prompt'", ["prompt is empty"]),
    ("system-type", "prm", {**PRM[0], "system": ["s"]}, "'system'", ["must be a string"]),
    ("prompt-empty", "prompt", {"src": ""}, "'src'", ["prompt is empty"]),
    ("prompt-turns", "prompt", {"src": ["a"], "tgt": ["b", "c"]}, "'tgt'", ["src has 1 turn(s) and tgt has 2"]),
    ("prompt-ref-empty", "prompt", {"src": "q", "tgt": " "}, "'tgt'", ["reference answer is empty"]),
    ("prompt-ref-type", "prompt", {"prompt": "q", "reference": {"a": 1}}, "'reference'", ["got object"]),
    ("prompt-missing", "prompt", {"text": "q"}, None, ["missing required fields", "'text'", '"src"']),
    (
        "shepherd-differs",
        "prm",
        {**SHEPHERD[1], "label": "What is 2 + 3? Step 1: 2 + 3 = 6. +\nStep 2: 5 -"},
        "'label'",
        ["differs from 'input' outside the step marks at character 31", "input has '5. '", "label has '6. +"],
    ),
    (
        "shepherd-mark",
        "prm",
        {**SHEPHERD[1], "label": "What is 2 + 3? Step 1: 2 + 3 = 5. +\nStep 2: 5 ки"},
        "'label'",
        ["step 1: at the place of its 'ки' the label has 'ки'", "not start with a reward token '+' or '-'"],
    ),
    (
        "shepherd-no-mark",
        "prm",
        {"input": "What is 2 + 3? 5", "label": "What is 2 + 3? 5"},
        "'input'",
        ["has no placeholder 'ки'"],
    ),
    (
        "shepherd-tail",
        "prm",
        {"input": "q s1 ки\ns2", "label": "q s1 +\ns2"},
        "'input'",
        ["text after the last placeholder 'ки' ('s2')"],
    ),
    (
        "shepherd-label-tail",
        "prm",
        {"input": "q s1 ки", "label": "q s1 + extra"},
        "'label'",
        ["differs from 'input'", "label has ' extra'"],
    ),
    ("shepherd-empty-step", "prm", {"input": "q ки ки", "label": "q + +"}, "'input'", ["step 1 is empty"]),
    ("shepherd-type", "prm", {"input": ["q ки"], "label": "q +"}, "'input'", ["must be a string", "got list"]),
    ("shepherd-missing", "prm", {"input": "q ки"}, "'label'", ["missing required field", "Math-Shepherd"]),
    (
        "shepherd-mixed",
        "prm",
        {**SHEPHERD[1], "src": "q"},
        None,
        ["mixes PaddleNLP fields (src) with Math-Shepherd fields (input, label)"],
    ),
    ("empty-src-system", "prm", {**SHEPHERD[0], "system": "s"}, "'system'", ["src is empty"]),
    ("empty-src-turns", "prm", {**SHEPHERD[0], "src": ["", "q"], "tgt": ["a"]}, "'src'", ["turn 0 is empty"]),
    ("empty-src-pair", "pair", {**PAIR[0], "src": [""]}, "'src'", ["turn 0 is empty"]),
    ("not-object", "prm", ["q", "a"], None, ["JSON list, not an object"]),
    ("not-object-str", "pair", "q", None, ["JSON string, not an object"]),
]


@pytest.mark.parametrize("case", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_record_messages(tmp_path, case):
    _, kind, bad, field, texts = case
    path = tmp_path / "bad_data.jsonl"
    # record 0 is good, a blank line, then the bad record: record 1 on line 3
    path.write_text(json.dumps(GOOD[kind]) + "\n\n" + json.dumps(bad) + "\n", encoding="utf-8")
    with pytest.raises(UserError) as exc:
        read_records(str(path), kind)
    msg = str(exc.value)
    assert f"{path}: record 1 (line 3)" in msg
    if field:
        assert f"field {field}" in msg
    assert "Fix:" in msg
    for text in texts:
        assert text in msg
    # the same problem in a JSON list names the record and its line, in parquet names the record
    path = tmp_path / "bad_list.json"
    path.write_text(json.dumps([GOOD[kind], bad]), encoding="utf-8")
    with pytest.raises(UserError, match=r"bad_list\.json: record 1 \(line 1\)"):
        read_records(str(path), kind)


def test_bad_record_in_parquet_names_record(tmp_path):
    path = write_parquet(tmp_path / "bad.parquet", [PRM[0], {**PRM[0], "labels": ["+", "?"]}])
    with pytest.raises(UserError, match=r"bad\.parquet: record 1, field 'labels': label 1 is '\?'"):
        read_records(path, "prm")


def test_custom_placeholder_and_reward_tokens(tmp_path):
    rec = {"src": "q", "responses": ["a <step>", "b"], "labels": ["good", "bad"]}
    path = write_jsonl(tmp_path / "d.jsonl", [rec])
    assert read_records(path, "prm", reward_tokens=("good", "bad"))[0].labels == ["good", "bad"]
    with pytest.raises(UserError, match="placeholder text '<step>'"):
        read_records(path, "prm", reward_tokens="good,bad", placeholder="<step>")
    with pytest.raises(UserError, match=r"label 0 is 'good'.*'\+', '-'"):
        read_records(path, "prm")
    with pytest.raises(UserError, match="reward_tokens"):
        read_records(path, "prm", reward_tokens="+")
    with pytest.raises(UserError, match="unknown data kind 'prn'.*'prm'"):
        read_records(path, "prn")


# ---------------------------------------------------------------------------------------------
# map_keys: rename the user's columns as they are read
# ---------------------------------------------------------------------------------------------

SFT = [
    {"src": ["hi", "and?"], "tgt": ["hello", "bye"]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
]
TRL_PAIR = [{"prompt": "q", "chosen": "c", "rejected": "r"}]
# (kind, records, map_keys {field: column}): the columns are the fields renamed
RENAMED = [
    ("prm", PRM, {"src": "question", "tgt": "history", "responses": "steps", "labels": "marks"}),
    ("prm", SHEPHERD[:1], {"src": "q", "responses": "steps"}),
    ("prm", SHEPHERD[1:], {"input": "text", "label": "marked"}),
    ("pair", PAIR, {"src": "query", "response": "answers", "sort": "scores"}),
    ("pair", TRL_PAIR, {"prompt": "instruction", "chosen": "good", "rejected": "bad"}),
    ("prompt", PROMPT, {"src": "question", "tgt": "answer_text"}),
    ("sft", SFT[:1], {"src": "user", "tgt": "assistant"}),
    ("sft", SFT[1:], {"messages": "conversation"}),
]


def rename(records, map_keys):
    """The records as the user's data has them: each field under its column name."""
    return [{map_keys.get(k, k): v for k, v in r.items()} for r in records]


@pytest.mark.parametrize("kind,records,map_keys", RENAMED, ids=[f"{c[0]}-{i}" for i, c in enumerate(RENAMED)])
def test_map_keys_reads_renamed_columns_in_every_format(tmp_path, kind, records, map_keys):
    expected = strip_source(read_records(write_jsonl(tmp_path / "plain.jsonl", records), kind))
    renamed = rename(records, map_keys)
    files = [
        write_jsonl(tmp_path / "d.jsonl", renamed),
        write_json_list(tmp_path / "d.json", renamed),
        write_parquet(tmp_path / "d.parquet", renamed),
        write_hf(tmp_path / "hf", renamed),
    ]
    for f in files:
        assert strip_source(read_records(f, kind, map_keys=map_keys)) == expected, f
        assert strip_source(load_dataset_records(f, kind, lazy=True, map_keys=map_keys)) == expected, f
    mixed = load_dataset_records(f"{files[0]},{files[2]}", kind, probs="0.5,0.5", map_keys=map_keys)
    lazy = load_dataset_records(f"{files[0]},{files[2]}", kind, probs="0.5,0.5", map_keys=map_keys, lazy=True)
    assert strip_source(mixed) == strip_source(lazy) and len(mixed) >= 2 * len(records)


def test_map_keys_the_mapped_column_wins_and_a_swap_works(tmp_path):
    # a column already named like a mapped field is not read; renaming is simultaneous
    rec = {"prompt": "not this", "question": "Q?", "chosen": "r", "rejected": "c"}
    (r,) = read_records(
        write_jsonl(tmp_path / "d.jsonl", [rec]),
        "pair",
        map_keys={"prompt": "question", "chosen": "rejected", "rejected": "chosen"},
    )
    assert r.prompt == [{"role": "user", "content": "Q?"}] and (r.chosen, r.rejected) == ("c", "r")


def test_map_keys_errors_name_file_record_and_column(tmp_path):
    path = write_jsonl(tmp_path / "mapped.jsonl", rename(PROMPT, {"src": "question"}) + [{"q": "x"}])
    with pytest.raises(UserError) as exc:
        read_records(path, "prompt", map_keys={"src": "question"})
    msg = str(exc.value)
    assert "mapped.jsonl: record 2 (line 3), field 'src' (column 'question' by map_keys)" in msg
    assert "the record has no column 'question' (it has: 'q')" in msg and "Fix: correct map_keys" in msg
    # a problem in a mapped field names the user's column too
    path = write_jsonl(tmp_path / "bad.jsonl", [{"question": 5}])
    with pytest.raises(UserError, match=r"record 0 \(line 1\), field 'src' \(column 'question' by map_keys\)"):
        read_records(path, "prompt", map_keys={"src": "question"})
    # every key must be a field of the kind; checked at once, lazy too, before any file is read
    with pytest.raises(UserError, match=r"'response' is not a field of 'prm' records \(closest: 'responses'\)"):
        load_dataset_records(path, "prm", lazy=True, map_keys={"response": "answers"})
    with pytest.raises(UserError, match="'messages' is not a field of 'pair' records"):
        read_records(path, "pair", map_keys={"messages": "conversation"})
    with pytest.raises(UserError, match="map_keys.*give an object"):
        read_records(path, "prompt", map_keys=[("src", "question")])
    with pytest.raises(UserError, match="map each field name to the name of a column"):
        read_records(path, "prompt", map_keys={"src": ""})
    # no file is needed to see a bad key
    with pytest.raises(UserError, match="not a field"):
        load_dataset_records(str(tmp_path / "nope.jsonl"), "sft", map_keys={"prompt": "q"})


def test_map_keys_is_threaded_from_data_argument(tmp_path):
    from llm.data.encode_reward import encode_prm
    from llm.data.encoding import EncodeConfig
    from llm.data.prepare import load_packed
    from llm.settings.flat import DataArgument
    from tests.helpers import tokenizer

    map_keys = {"input": "text", "label": "marked"}
    path = write_jsonl(tmp_path / "d.jsonl", rename(SHEPHERD[1:] * 3, map_keys))
    tok = tokenizer()
    args = DataArgument(max_seq_len=256, max_prompt_len=64, map_keys=map_keys)
    ph = tok.convert_tokens_to_ids("ки")
    cfg = EncodeConfig(256, 64)

    def encode(record, record_index, counter):
        return encode_prm(record, tok, cfg, ph, "ки", ("+", "-"), record_index, counter)

    for lazy in (False, True):
        data = load_packed(path, "prm", encode, args, batch_size=1, seed=0, lazy=lazy)
        rows = list(data.rows.one_pass() if lazy else data.rows)  # a lazy stream repeats without end
        assert sum(len(r.readout_position) for r in rows) == 6, lazy  # 3 records, 2 steps each


def test_invalid_json_lines_names_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(PROMPT[0]) + "\n\n" + '{"src": "q", "tgt": }\n')
    with pytest.raises(UserError) as exc:
        read_records(str(path), "prompt")
    assert "broken.jsonl: record 1 (line 3)" in str(exc.value)
    assert "invalid JSON at column" in str(exc.value)


@pytest.mark.parametrize(
    "text,expected",
    [
        ('[{"src": "q"},\n {"src": "r"} {"src": "s"}]', "line 2, column 15): invalid JSON: expected ',' or ']'"),
        ('[{"src": "q"},\n]', "trailing comma"),
        ('[{"src": "q"}', "not closed"),
        ('[{"src": "q"}] x', "extra data"),
        ('[{"src": "q"},\n {"src": "r", }]', "record 1 (line 2, column"),
    ],
)
def test_invalid_json_list(tmp_path, text, expected):
    path = tmp_path / "broken.json"
    path.write_text(text)
    with pytest.raises(UserError) as exc:
        read_records(str(path), "prompt")
    assert "broken.json" in str(exc.value) and expected in str(exc.value)


def test_pretty_printed_single_object_is_invalid_json(tmp_path):
    path = tmp_path / "one.json"
    path.write_text(json.dumps(PROMPT[0], indent=2))
    with pytest.raises(UserError, match=r"one\.json: record 0 \(line 1\): invalid JSON.*JSON list of objects"):
        read_records(str(path), "prompt")


@pytest.mark.parametrize("name,text", [("e.jsonl", ""), ("e.json", "  \n\n"), ("l.json", "[ ]"), ("l.jsonl", "\n[]\n")])
def test_empty_files(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(UserError, match=rf"{name}: no records found"):
        read_records(str(path), "pair")
    with pytest.raises(UserError, match="no records found"):
        list(load_dataset_records(str(path), "pair", lazy=True))


def test_empty_parquet_and_dataset(tmp_path):
    table = pa.table({"src": pa.array([], pa.string()), "tgt": pa.array([], pa.string())})
    pq.write_table(table, tmp_path / "e.parquet")
    with pytest.raises(UserError, match=r"e\.parquet: no records found"):
        read_records(str(tmp_path / "e.parquet"), "prompt")
    datasets.Dataset.from_dict({"src": []}).save_to_disk(str(tmp_path / "eds"))
    with pytest.raises(UserError, match="eds: no records found"):
        read_records(str(tmp_path / "eds"), "prompt")


def test_bad_paths(tmp_path):
    with pytest.raises(UserError, match=r"nope\.jsonl does not exist \(looked in: .*\); supported formats: \.json"):
        read_records(str(tmp_path / "nope.jsonl"), "prm")
    (tmp_path / "d.csv").write_text("src,tgt\n")
    with pytest.raises(UserError, match=r"d\.csv has an unsupported extension '\.csv'.*\.parquet"):
        read_records(str(tmp_path / "d.csv"), "prm")
    (tmp_path / "plain_dir").mkdir()
    with pytest.raises(UserError, match="plain_dir: the directory is not a Hugging Face dataset"):
        read_records(str(tmp_path / "plain_dir"), "prm")
    write_hf(tmp_path / "dd", PROMPT, split="validation")
    with pytest.raises(UserError, match="no 'train' split.*validation"):
        read_records(str(tmp_path / "dd"), "prompt")
    (tmp_path / "x.parquet").write_text("not parquet")
    with pytest.raises(UserError, match=r"x\.parquet: cannot read the file as Parquet"):
        read_records(str(tmp_path / "x.parquet"), "prompt")
    (tmp_path / "latin.jsonl").write_bytes('{"src": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(UserError, match="not valid UTF-8"):
        read_records(str(tmp_path / "latin.jsonl"), "prompt")
    # lazy mode checks paths at once, before iterating
    good = write_jsonl(tmp_path / "ok.jsonl", PRM)
    with pytest.raises(UserError, match=r"nope\.json does not exist"):
        load_dataset_records(f"{good},{tmp_path / 'nope.json'}", "prm", lazy=True)


# ---------------------------------------------------------------------------------------------
# Mixing
# ---------------------------------------------------------------------------------------------


def make_sources(tmp_path, sizes):
    paths = []
    for s, n in enumerate(sizes):
        recs = [{"src": f"s{s}-{i}", "tgt": str(i)} for i in range(n)]
        writer = [write_jsonl, write_json_list, write_parquet][s % 3]
        ext = [".jsonl", ".json", ".parquet"][s % 3]
        paths.append(writer(tmp_path / f"src{s}{ext}", recs))
    return paths


def keys(records):
    return [(Path(r.source).stem, r.index) for r in records]


def test_concatenate_without_probs(tmp_path):
    paths = make_sources(tmp_path, [3, 2])
    recs = load_dataset_records(",".join(paths), "prompt")
    assert keys(recs) == [("src0", 0), ("src0", 1), ("src0", 2), ("src1", 0), ("src1", 1)]
    assert keys(load_dataset_records(" , ".join(paths), "prompt", lazy=True)) == keys(recs)
    assert keys(load_dataset_records(paths, "prompt")) == keys(recs)


def test_mixing_is_deterministic_with_right_proportions(tmp_path):
    paths = ",".join(make_sources(tmp_path, [300, 40, 20]))
    a = load_dataset_records(paths, "prompt", probs="0.6,0.3,0.1", seed=7)
    b = load_dataset_records(paths, "prompt", probs="6,3,1", seed=7)  # normalised
    c = load_dataset_records(paths, "prompt", probs="0.6,0.3,0.1", seed=8)
    assert keys(a) == keys(b) and keys(a) != keys(c)
    counts = Counter(Path(r.source).stem for r in a)
    total = len(a)
    for name, p in [("src0", 0.6), ("src1", 0.3), ("src2", 0.1)]:
        assert abs(counts[name] / total - p) < 0.05, (counts, total)
    # all_exhausted: every record of every source appears; small sources are repeated
    assert {k for k in keys(a) if k[0] == "src0"} == {("src0", i) for i in range(300)}
    assert {k for k in keys(a) if k[0] == "src2"} == {("src2", i) for i in range(20)}
    # records keep their origin
    assert all(r.prompt[0]["content"] == f"s{Path(r.source).stem[3:]}-{r.index}" for r in a)
    # lazy mixing yields the same sequence
    assert keys(load_dataset_records(paths, "prompt", probs="0.6,0.3,0.1", seed=7, lazy=True)) == keys(a)


@pytest.mark.parametrize("probs,seed", [("0.7,0.3", 42), ("0.2,0.5,0.3", 0), ("1,1", 123)])
def test_mixing_equals_hf_interleave_datasets(tmp_path, probs, seed):
    sizes = [50, 13, 7][: len(probs.split(","))]
    paths = make_sources(tmp_path, sizes)
    ours = load_dataset_records(",".join(paths), "prompt", probs=probs, seed=seed)
    weights = [float(p) for p in probs.split(",")]
    weights = [w / sum(weights) for w in weights]
    hf = datasets.interleave_datasets(
        [datasets.Dataset.from_dict({"s": [f"src{s}"] * n, "i": list(range(n))}) for s, n in enumerate(sizes)],
        probabilities=weights,
        seed=seed,
        stopping_strategy="all_exhausted",
    )
    assert keys(ours) == list(zip(hf["s"], hf["i"]))


def test_zero_probability_source_is_not_read(tmp_path):
    paths = make_sources(tmp_path, [5, 3])
    recs = load_dataset_records(",".join(paths), "prompt", probs="1,0")
    assert keys(recs) == [("src0", i) for i in range(5)]


@pytest.mark.parametrize(
    "probs,expected",
    [
        ("0.5", "1 value(s) for 2 data path(s)"),
        ("0.5,0.3,0.2", "3 value(s) for 2 data path(s)"),
        ("0.5,-0.1", "must be a finite number >= 0"),
        ("0,0", "sum to 0"),
        ("a,b", "'a' is not a number"),
    ],
)
def test_bad_probs(tmp_path, probs, expected):
    paths = ",".join(make_sources(tmp_path, [2, 2]))
    with pytest.raises(UserError, match=re.escape(expected)):
        load_dataset_records(paths, "prompt", probs=probs)
    with pytest.raises(UserError, match=re.escape(expected)):
        load_dataset_records(paths, "prompt", probs=probs, lazy=True)


def test_empty_path_entry(tmp_path):
    paths = make_sources(tmp_path, [2])
    with pytest.raises(UserError, match="empty entry"):
        load_dataset_records(paths[0] + ",", "prompt")


def test_error_in_mixed_source_names_that_file(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", PRM)
    bad = write_jsonl(tmp_path / "bad.jsonl", [PRM[0], {**PRM[0], "labels": ["+"]}])
    with pytest.raises(UserError, match=r"bad\.jsonl: record 1 \(line 2\), field 'labels'"):
        load_dataset_records(f"{good},{bad}", "prm", probs="0.5,0.5")


# ---------------------------------------------------------------------------------------------
# Lazy reading
# ---------------------------------------------------------------------------------------------


def big_file(tmp_path, n=20_000, broken_last=False, as_list=False):
    lines = [
        json.dumps({"src": [f"question {i} " + "x" * 200], "tgt": [], "response": ["a", "b"], "sort": [1, 0]})
        for i in range(n)
    ]
    if broken_last:
        lines[-1] = lines[-1][:-5]
    path = tmp_path / ("big.json" if as_list else "big.jsonl")
    path.write_text(("[\n" + ",\n".join(lines) + "\n]") if as_list else "\n".join(lines) + "\n")
    return str(path)


def test_lazy_equals_eager_and_never_json_loads_the_file(tmp_path, monkeypatch):
    path = big_file(tmp_path)
    eager = read_records(path, "pair")
    assert len(eager) == 20_000

    def no_load(*args, **kwargs):
        raise AssertionError("json.load must not be called")

    monkeypatch.setattr(json, "load", no_load)
    lazy = load_dataset_records(path, "pair", lazy=True)
    assert not isinstance(lazy, list)
    assert list(lazy) == eager


@pytest.mark.parametrize("as_list", [False, True])
def test_lazy_yields_records_before_reading_everything(tmp_path, monkeypatch, as_list):
    monkeypatch.setattr(readers.sources, "_JSON_CHUNK", 1 << 16)
    path = big_file(tmp_path, broken_last=True, as_list=as_list)
    it = load_dataset_records(path, "pair", lazy=True)
    first = next(it)
    assert first.index == 0 and first.prompt[0]["content"].startswith("question 0 ")
    got = 1
    with pytest.raises(UserError, match=r"big\.jsonl?: record 19999 \(line 200\d\d"):
        for _ in it:
            got += 1
    assert got == 19_999  # every good record came out before the broken last one was read


@pytest.mark.parametrize("as_list", [False, True])
def test_lazy_memory_stays_small(tmp_path, monkeypatch, as_list):
    monkeypatch.setattr(readers.sources, "_JSON_CHUNK", 1 << 16)
    path = big_file(tmp_path, as_list=as_list)
    size = os.path.getsize(path)
    tracemalloc.start()
    try:
        n = sum(1 for _ in load_dataset_records(path, "pair", lazy=True))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert n == 20_000
    assert peak < size / 5, (peak, size)


def test_lazy_parquet_reads_by_batches(tmp_path, monkeypatch):
    records = [{"src": f"q{i}", "tgt": str(i)} for i in range(3000)]
    path = write_parquet(tmp_path / "d.parquet", records)
    monkeypatch.setattr(readers.sources, "_BATCH", 100)
    seen = []
    real = pq.ParquetFile.iter_batches

    def spy(self, *args, **kwargs):
        for batch in real(self, *args, **kwargs):
            seen.append(batch.num_rows)
            yield batch

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    it = iter_records(path, "prompt")
    assert next(it).reference == "0"
    assert seen == [100]
    assert [r.reference for r in it] == [str(i) for i in range(1, 3000)]


# --- evaluation layouts: ProcessBench and best-of-N candidates -------------------------------------------
def test_processbench_records(tmp_path):
    recs = [
        {
            "id": "gsm8k-0",
            "generator": "Qwen2-7B-Instruct",
            "problem": "P?",
            "steps": ["a", "b", "c", "d"],
            "final_answer_correct": False,
            "label": 1,
        },
        {
            "id": "math-12",
            "generator": "g",
            "problem": "Q?",
            "steps": ["x", "y"],
            "final_answer_correct": True,
            "label": -1,
        },
        {"id": "x", "problem": "R?", "steps": ["z"], "label": 0, "subset": "omnimath"},
    ]
    a, b, c = read_records(write_jsonl(tmp_path / "pb.jsonl", recs), "prm")
    assert a.prompt == [{"role": "user", "content": "P?"}] and a.steps == ["a", "b", "c", "d"]
    assert a.labels == ["+", "-", None, None] and a.first_error == 1 and a.subset == "gsm8k"
    assert a.generator == "Qwen2-7B-Instruct" and a.correct is None  # no answer: not a best-of-N candidate
    assert b.labels == ["+", "+"] and b.first_error == -1 and b.subset == "math"
    assert c.labels == ["-"] and c.subset == "omnimath"


@pytest.mark.parametrize(
    "record, field, text",
    [
        ({"problem": "P", "steps": ["a"], "label": 1}, "'label'", "index of the earliest wrong step (0 to 0) or -1"),
        ({"problem": "P", "steps": ["a"], "label": True}, "'label'", "earliest wrong step"),
        ({"problem": "P", "steps": ["a"]}, "'label'", "ProcessBench"),
        ({"src": "q", "responses": ["a"], "answer": "3"}, "'correct'", "needs both answer and correct"),
        ({"src": "q", "responses": ["a"], "answer": "3", "correct": "yes"}, "'correct'", "true or false"),
        ({"src": "q", "responses": ["a"], "correct": True}, "'answer'", "needs both"),
        ({"src": "q", "responses": ["a"]}, "'labels'", "missing required field"),
    ],
)
def test_bad_evaluation_records(tmp_path, record, field, text):
    with pytest.raises(UserError) as exc:
        read_records(write_jsonl(tmp_path / "bad.jsonl", [record]), "prm")
    msg = str(exc.value)
    assert f"field {field}" in msg and text in msg and "Fix:" in msg


def test_best_of_n_candidates_group_by_question_and_may_be_unlabelled(tmp_path):
    recs = [
        {"src": "Q1", "responses": ["a", "b"], "answer": 3, "correct": True},
        {"src": "Q1", "responses": ["c"], "answer": "4", "correct": False, "labels": ["-"]},
        {"src": "Q2", "responses": ["d"], "answer": "4", "correct": False, "group": "g2"},
        {"problem": "P", "steps": ["a"], "label": -1, "answer": "9", "final_answer_correct": True},
    ]
    r1, r2, r3, r4 = read_records(write_jsonl(tmp_path / "bon.jsonl", recs), "prm")
    assert r1.labels == [None, None] and r1.answer == "3" and r1.correct is True
    assert r2.labels == ["-"] and r1.group == r2.group != r3.group == "g2"
    assert (r4.answer, r4.correct, r4.group) == ("9", True, "P")  # ProcessBench's final_answer_correct


def _shepherd(question, steps, answer, correct, group=None, marks=None):
    """A Hugging Face Math-Shepherd row (the question starts the first step) as a best-of-N candidate."""
    text = question + " " + "".join(f"{s} ки\n" for s in steps)
    marked = text
    for mark in marks or ["+"] * len(steps):
        marked = marked.replace("ки", mark, 1)
    rec = {"input": text, "label": marked, "answer": answer, "correct": correct}
    return rec if group is None else {**rec, "group": group}


# two problems x 3 candidates; the step scores each candidate is given below (``SHEPHERD_SCORES``)
SHEPHERD_BON = [
    ("a", "What is 2 + 3?", ["2 + 3 = 5.", "The answer is 5."], "5", True),
    ("a", "What is 2 + 3?", ["3 + 2 = 5.", "The answer is 5."], "5", True),
    ("a", "What is 2 + 3?", ["2 + 3 = 6.", "The answer is 6."], "6", False),
    ("b", "What is 4 * 2?", ["4 * 2 = 7.", "The answer is 7."], "7", False),
    ("b", "What is 4 * 2?", ["The answer is 7."], "7", False),
    ("b", "What is 4 * 2?", ["4 * 2 = 8.", "The answer is 8."], "8", True),
]
SHEPHERD_SCORES = [[0.9, 0.4], [0.7, 0.6], [0.95, 0.8], [0.3, 0.9], [0.2], [0.6, 0.55]]


def test_math_shepherd_candidates_without_group_stop_naming_record_and_field(tmp_path):
    """Before: such candidates all got group None, i.e. the candidates of every problem formed one group."""
    recs = [_shepherd(q, s, a, c, g) for g, q, s, a, c in SHEPHERD_BON]
    recs[3].pop("group")  # the first candidate of problem "b" has none
    with pytest.raises(UserError) as exc:
        read_records(write_jsonl(tmp_path / "shepherd_bon.jsonl", recs), "prm")
    msg = str(exc.value)
    assert "shepherd_bon.jsonl: record 3" in msg and "field 'group'" in msg and "is missing" in msg, msg
    assert "Fix: add a 'group' field" in msg
    # none has a group: stops at the first record
    recs = [_shepherd(q, s, a, c) for _, q, s, a, c in SHEPHERD_BON]
    with pytest.raises(UserError, match=r"shepherd_bon.jsonl: record 0 \(line 1\), field 'group'"):
        read_records(write_jsonl(tmp_path / "shepherd_bon.jsonl", recs), "prm")
    # PaddleNLP's conversion (src [""]) groups by nothing either: the first step holds the question *and* its text
    paddle = [
        {"src": [""], "tgt": [], "responses": [q + " " + s[0], *s[1:]], "answer": a, "correct": c}
        for _, q, s, a, c in SHEPHERD_BON
    ]
    with pytest.raises(UserError) as exc:
        read_records(write_jsonl(tmp_path / "paddle_bon.jsonl", paddle), "prm")
    msg = str(exc.value)
    assert "paddle_bon.jsonl: record 0" in msg and "field 'group'" in msg and "'src' is empty" in msg, msg
    # an empty group is no name either
    with pytest.raises(UserError, match=r"record 0 \(line 1\), field 'group': is empty"):
        read_records(write_jsonl(tmp_path / "empty.jsonl", [{**paddle[0], "group": " "}]), "prm")
    # records that are no candidates (no answer/correct) need no group: Math-Shepherd training data as before
    plain = [{k: v for k, v in r.items() if k not in ("answer", "correct")} for r in recs]
    assert [r.group for r in read_records(write_jsonl(tmp_path / "train.jsonl", plain), "prm")] == [None] * 6


def test_math_shepherd_candidates_with_group_form_their_problems_groups(tmp_path):
    """With ``group``: two groups of three, and best-of-N over them as computed by hand (at N = 3 every
    candidate of a group competes, so the drawn order does not matter)."""
    from llm.alignment.rm.evaluation import Candidate, best_of_n_metrics

    recs = [_shepherd(q, s, a, c, g) for g, q, s, a, c in SHEPHERD_BON]
    recs[2] = _shepherd(*SHEPHERD_BON[2][1:], group="a", marks=["-", "-"])  # labels are read as before
    read = read_records(write_jsonl(tmp_path / "shepherd_bon.jsonl", recs), "prm")
    assert [r.group for r in read] == ["a"] * 3 + ["b"] * 3
    assert read[0].prompt == [] and read[0].steps == ["What is 2 + 3? 2 + 3 = 5.", "The answer is 5."]
    assert read[2].labels == ["-", "-"] and read[0].labels == ["+", "+"]
    groups = {}
    for rec, scores in zip(read, SHEPHERD_SCORES):
        groups.setdefault(rec.group, []).append(Candidate(scores, rec.answer, rec.correct))
    m = best_of_n_metrics(groups, ["min"], seed=3)
    assert m["bon_groups"] == 2
    # min scores a: 0.4 (5, right), 0.6 (5, right), 0.8 (6, wrong); b: 0.3 (7, wrong), 0.2 (7, wrong), 0.55 (8, right)
    assert m["bon_min@3"] == pytest.approx(0.5)  # a picks 0.8 (wrong), b picks 0.55 (right)
    assert m["weighted_vote_min@3"] == pytest.approx(1.0)  # a: 5 has 1.0 > 0.8; b: 8 has 0.55 > 0.5
    assert m["majority_vote@3"] == pytest.approx(0.5)  # a: 5 (right); b: 7 (wrong)
    assert m["pass@3"] == pytest.approx(1.0)
    # the old behaviour (one group of all six) would have given one group whose best (0.8) is wrong
    assert best_of_n_metrics({None: [c for g in groups.values() for c in g]}, ["min"], 3)["bon_min@6"] == 0.0
