"""The "sft" record kind: PaddleNLP src/tgt (multi-turn) and TRL messages, validation messages naming file,
record, field and fix, mixing with probabilities, and the bundled generated SFT sample data."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llm.data import make_sft_data
from llm.data.readers import SFTRecord, load_dataset_records, read_records
from llm.utils.errors import UserError

GOOD = {"src": "What is 2 + 3?", "tgt": "2 + 3 = 5."}


def write_jsonl(path: Path, records) -> str:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return str(path)


def msgs(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


def test_formats_give_the_same_conversation(tmp_path):
    records = [
        GOOD,
        {"src": ["Q1", "Q2"], "tgt": ["A1", "A2"], "system": "Be brief."},
        {
            "messages": msgs(
                ("system", "Be brief."), ("user", "Q1"), ("assistant", "A1"), ("user", "Q2"), ("assistant", "A2")
            )
        },
        {
            "messages": msgs(("user", "Q1"), ("assistant", "A1"), ("user", "Q2"), ("assistant", "A2")),
            "system": "Be brief.",
        },
    ]
    got = read_records(write_jsonl(tmp_path / "d.jsonl", records), "sft")
    assert all(isinstance(r, SFTRecord) for r in got)
    assert got[0].messages == msgs(("user", "What is 2 + 3?"), ("assistant", "2 + 3 = 5."))
    multi = msgs(("system", "Be brief."), ("user", "Q1"), ("assistant", "A1"), ("user", "Q2"), ("assistant", "A2"))
    assert got[1].messages == got[2].messages == got[3].messages == multi  # src[0], tgt[0], src[1], tgt[1]
    assert [r.index for r in got] == [0, 1, 2, 3]


def test_parquet_and_mixing(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"src": f"qa{i}", "tgt": f"aa{i}"} for i in range(5)])
    b = tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist([{"src": [f"qb{i}"], "tgt": [f"ab{i}"]} for i in range(3)]), b)
    mixed = load_dataset_records(f"{a},{b}", "sft", probs="0.5,0.5", seed=1)
    sources = {r.source for r in mixed}
    assert sources == {a, str(b)} and len(mixed) >= 8
    assert mixed == list(load_dataset_records(f"{a},{b}", "sft", probs="0.5,0.5", seed=1, lazy=True))


BAD = [
    ("turn-count", {"src": ["q1", "q2"], "tgt": ["a1"]}, "'tgt'", ["src has 2 turn(s) and tgt has 1", "one tgt turn"]),
    ("tgt-missing", {"src": "q"}, "'tgt'", ["missing required field(s) 'tgt'", "PaddleNLP SFT"]),
    ("tgt-empty", {"src": ["q"], "tgt": [" "]}, "'tgt'", ["turn 0 is empty"]),
    ("src-empty", {"src": ["q", ""], "tgt": ["a", "b"]}, "'src'", ["turn 1 is empty"]),
    ("tgt-type", {"src": "q", "tgt": 5}, "'tgt'", ["string or a list of strings", "got number"]),
    ("mixed", {"src": "q", "tgt": "a", "messages": msgs(("user", "q"))}, None, ["mixes PaddleNLP", "TRL"]),
    ("none", {"question": "q"}, None, ["missing required fields", "'question'", '"messages"']),
    (
        "ends-user",
        {"messages": msgs(("user", "q"), ("assistant", "a"), ("user", "q2"))},
        "'messages'",
        ["ends with a user message", "Fix: end the conversation"],
    ),
    (
        "starts-assistant",
        {"messages": msgs(("assistant", "a"), ("user", "q"))},
        "'messages'",
        ["does not start with a user message"],
    ),
    ("only-system", {"messages": msgs(("system", "s"))}, "'messages'", ["no user message"]),
    (
        "late-system",
        {"messages": msgs(("user", "q"), ("system", "s"), ("assistant", "a"))},
        "'messages'",
        ["message 1 is a system message"],
    ),
    (
        "empty-content",
        {"messages": msgs(("user", "q"), ("assistant", " "))},
        "'messages'",
        ["message 1 (assistant) has empty content"],
    ),
    ("bad-role", {"messages": msgs(("human", "q"), ("assistant", "a"))}, "'messages'", ["role 'human'"]),
    ("not-list", {"messages": "hello"}, "'messages'", ["non-empty list of messages"]),
    (
        "two-systems",
        {"messages": msgs(("system", "s"), ("user", "q"), ("assistant", "a")), "system": "t"},
        "'system'",
        ["keep only one"],
    ),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_records_name_file_record_field_and_fix(tmp_path, case):
    _, bad, field, texts = case
    path = tmp_path / "bad_sft.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + json.dumps(bad) + "\n", encoding="utf-8")
    with pytest.raises(UserError) as exc:
        read_records(str(path), "sft")
    msg = str(exc.value)
    assert f"{path}: record 1 (line 3)" in msg and "Fix:" in msg, msg
    if field:
        assert f"field {field}" in msg, msg
    for text in texts:
        assert text in msg, msg


def test_empty_file_names_the_sft_formats(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(UserError, match=r"no records found.*'sft'.*messages"):
        read_records(str(path), "sft")


def test_bundled_sample_data_is_generated_and_valid(tmp_path):
    files = make_sft_data.generate(tmp_path)
    for name in ("sft_train", "sft_dev"):
        committed = make_sft_data.SFT_SAMPLE_DIR / f"{name}.jsonl"
        assert (tmp_path / f"{name}.jsonl").read_bytes() == committed.read_bytes(), name
    train = read_records(str(make_sft_data.SFT_SAMPLE_DIR / "sft_train.jsonl"), "sft")
    dev = read_records(str(make_sft_data.SFT_SAMPLE_DIR / "sft_dev.jsonl"), "sft")
    assert len(train) == len(files["sft_train"]) == make_sft_data.N_SFT_TRAIN and len(dev) == make_sft_data.N_SFT_DEV
    assert any(len(r.messages) == 4 for r in train)  # two-turn conversations
    assert any("messages" in r for r in files["sft_train"]) and any("src" in r for r in files["sft_train"])
    first_question = lambda records: {r.messages[0]["content"] for r in records}
    assert not first_question(train) & first_question(dev)
    for r in train[:50]:
        answer = r.messages[-1]["content"]
        assert answer.splitlines()[-1].startswith("The answer is ")
