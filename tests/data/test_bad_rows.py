"""Bad dataset rows (issues 20, 36): each kind is rejected at load naming file and row (``bad_rows: raise``),
or skipped with the count and the first one logged (``bad_rows: skip``), the good rows kept in order."""

from __future__ import annotations

import json
import logging

import pytest

from megarl.data import DatasetRowError, load_rl_dataset

GOOD = {"gsm8k": {"question": "1+1?", "answer": "#### 2"}, "chat": {"prompt": "1+1?", "answer": "2"}}
# kind -> (dataset type, the bad line as written to the .jsonl file, what the error says)
BAD = {
    "missing-question": ("gsm8k", json.dumps({"answer": "#### 1"}), "row 1 (line 2) has no 'question'"),
    "missing-answer": ("gsm8k", json.dumps({"question": "q"}), "row 1 (line 2) has no 'answer'"),
    "empty-question": (
        "gsm8k",
        json.dumps({"question": "  ", "answer": "#### 1"}),
        "'question' must be non-empty text",
    ),
    "question-a-list": (
        "gsm8k",
        json.dumps({"question": ["q"], "answer": "#### 1"}),
        "'question' must be non-empty text",
    ),
    "unparsable-answer": ("gsm8k", json.dumps({"question": "q", "answer": "one"}), "no '#### <answer>' line"),
    "blank-final-answer": (
        "gsm8k",
        json.dumps({"question": "q", "answer": "She has none left. ####  "}),
        "final answer after '####' is blank",
    ),
    "final-answer-not-a-number": (
        "gsm8k",
        json.dumps({"question": "q", "answer": "#### seven"}),
        "final answer after '####' is not a number: 'seven'",
    ),
    "reward-argument-column": (
        "gsm8k",
        json.dumps({"question": "q", "answer": "#### 1", "prompt_ids": [1, 2]}),
        "row 1 (line 2) has column(s) ['prompt_ids'], which a reward function receives as its own arguments",
    ),
    "empty-prompt": ("chat", json.dumps({"prompt": "", "answer": "1"}), "'prompt' must be non-empty text"),
    "no-messages": ("chat", json.dumps({"messages": [], "answer": "1"}), "'messages' must be a non-empty list"),
    "message-not-text": (
        "chat",
        json.dumps({"messages": [{"role": "user", "content": 3}], "answer": "1"}),
        "'messages' must be a non-empty list",
    ),
    "empty-messages": (
        "chat",
        json.dumps({"messages": [{"role": "user", "content": ""}], "answer": "1"}),
        "every message of 'messages' is empty",
    ),
    "answer-a-dict": ("chat", json.dumps({"prompt": "p", "answer": {"x": 1}}), "'answer' must be a non-empty string"),
    "answer-a-bool": ("chat", json.dumps({"prompt": "p", "answer": True}), "'answer' must be a non-empty string"),
    "answer-not-finite": ("chat", json.dumps({"prompt": "p", "answer": float("nan")}), "'answer' must be a finite"),
    "unknown-role": (
        "chat",
        json.dumps(
            {"messages": [{"role": "system", "content": "s"}, {"role": "human", "content": "q"}], "answer": "1"}
        ),
        "row 1 (line 2): message 1 has role 'human'; a role is one of ['system', 'user', 'assistant', 'tool']",
    ),
    "not-json": ("chat", '{"prompt": "p", "answer": ', "line 2 is not a JSON object"),
    "json-list": ("chat", "[1, 2]", "line 2 is not a JSON object: a JSON list"),
    "invalid-utf8": ("chat", b'{"prompt": "caf\xe9", "answer": "1"}', "line 2 is not a JSON object"),
}


def write(tmp_path, type: str, bad_line) -> str:
    """A file of three rows: good, bad, good (the good ones numbered by their answer)."""
    good = [dict(GOOD[type], answer=GOOD[type]["answer"].replace("2", str(i))) for i in (1, 3)]
    bad = bad_line if isinstance(bad_line, bytes) else bad_line.encode()
    lines = [json.dumps(good[0]).encode(), bad, json.dumps(good[1]).encode()]
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


@pytest.mark.parametrize("kind", list(BAD))
def test_raise_names_file_and_row(tmp_path, kind):
    type, line, says = BAD[kind]
    path = write(tmp_path, type, line)
    with pytest.raises(DatasetRowError) as err:
        load_rl_dataset(path, "train", type=type)
    assert path in str(err.value) and says in str(err.value), str(err.value)


@pytest.mark.parametrize("kind", list(BAD))
def test_skip_keeps_the_good_rows_and_logs_the_first_bad_one(tmp_path, kind, caplog):
    type, line, says = BAD[kind]
    path = write(tmp_path, type, line)
    with caplog.at_level(logging.WARNING, logger="megarl.data.rl_dataset"):
        dataset = load_rl_dataset(path, "train", type=type, bad_rows="skip")
    assert list(dataset["answer"]) == ["1", "3"]
    assert f"{path}: skipped 1 bad rows of 3 (bad_rows=skip); the first: " in caplog.text and says in caplog.text


def test_a_file_of_bad_rows_only_fails_even_when_skipping(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "", "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match=r"no usable rows \(1 bad; the first: .*'prompt' must be non-empty text"):
        load_rl_dataset(str(path), "train", type="chat", bad_rows="skip")


def test_skipped_rows_are_handed_to_the_caller(tmp_path):
    """What the trainer shows on the console at start (``megarl.train``): every reason, in file order."""
    path = write(tmp_path, "gsm8k", json.dumps({"question": "q", "answer": "#### ?"}))
    skipped: list[str] = []
    load_rl_dataset(path, "train", bad_rows="skip", skipped=skipped)
    assert skipped == [f"{path}: row 1 (line 2): GSM8K solution's final answer after '####' is not a number: '?'"]


def test_a_chat_prompt_becomes_the_chat_and_does_not_reach_the_reward_twice(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "1+1?", "answer": 2, "level": "easy"}) + "\n")
    (row,) = load_rl_dataset(str(path), "train", type="chat")
    assert row == {"messages": [{"role": "user", "content": "1+1?"}], "answer": "2", "level": "easy"}

    def reward(prompt, completions, prompt_ids, completion_ids, **data):
        return float(completions == data["answer"])

    assert reward("1+1?", "2", [], [], **row) == 1.0
