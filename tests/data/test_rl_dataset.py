"""load_rl_dataset: GSM8K bundled copy, local files and dirs, row mapping, DP splits, hub errors."""

from __future__ import annotations

import itertools
import json
import socket
import time

import datasets
import pytest

from megarl.data import DatasetRowError, HubUnreachableError, load_rl_dataset
from megarl.data.rows import GSM8K_INSTRUCTION, gsm8k_final_answer

FIRST_TRAIN_QUESTION = "Natalia sold clips to 48 of her friends in April"


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("split, rows", [("train", 7473), ("test", 1319)])
def test_bundled_gsm8k_row_counts(split, rows):
    assert len(load_rl_dataset("gsm8k", split)) == rows


def test_gsm8k_row_maps_to_messages_answer_and_solution():
    row = load_rl_dataset("gsm8k", "train")[0]
    assert set(row) == {"messages", "answer", "solution"}
    (message,) = row["messages"]
    assert message["role"] == "user"
    assert message["content"].startswith(FIRST_TRAIN_QUESTION)
    assert message["content"].endswith(GSM8K_INSTRUCTION)
    assert row["answer"] == "72"
    assert row["solution"].endswith("#### 72") and "48/2" in row["solution"]


def test_gsm8k_final_answer_drops_thousands_separators():
    assert gsm8k_final_answer("so 1,000+80 = 1,080\n#### 1,080") == "1080"
    assert gsm8k_final_answer("#### -3") == "-3"
    with pytest.raises(ValueError, match="####"):
        gsm8k_final_answer("no final line")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_rank_splits_are_disjoint_and_complete(world_size):
    full = list(load_rl_dataset("gsm8k", "test")["solution"])
    shards = [
        list(load_rl_dataset("gsm8k", "test", rank=r, world_size=world_size)["solution"]) for r in range(world_size)
    ]
    # 1319 rows do not divide evenly: shards differ by at most one row.
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    # Shards in rank order rebuild the dataset: every row on exactly one rank.
    assert list(itertools.chain(*shards)) == full


@pytest.mark.parametrize("rank, world_size", [(2, 2), (-1, 2), (0, 0)])
def test_bad_rank_is_rejected(rank, world_size):
    with pytest.raises(ValueError, match=f"rank={rank}"):
        load_rl_dataset("gsm8k", "test", rank=rank, world_size=world_size)


def test_chat_jsonl_file_with_prompt_or_messages(tmp_path):
    file = write_jsonl(
        tmp_path / "mine.jsonl",
        [
            {"prompt": "2+2?", "answer": 4, "topic": "add"},
            {
                "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+3?"}],
                "answer": "6",
                "topic": "add",
            },
        ],
    )
    rows = list(load_rl_dataset(str(file), "train", type="chat"))
    assert rows[0]["messages"] == [{"role": "user", "content": "2+2?"}]
    assert rows[0]["answer"] == "4"
    assert [m["role"] for m in rows[1]["messages"]] == ["system", "user"]
    assert [r["topic"] for r in rows] == ["add", "add"]  # extra columns reach reward fns


def test_directory_with_split_jsonl_uses_the_split_file(tmp_path):
    gsm_row = {"question": "Q?", "answer": "work\n#### 5"}
    write_jsonl(tmp_path / "train.jsonl", [gsm_row] * 3)
    write_jsonl(tmp_path / "test.jsonl", [gsm_row])
    assert len(load_rl_dataset(str(tmp_path), "train")) == 3
    assert load_rl_dataset(str(tmp_path), "test")[0]["answer"] == "5"
    with pytest.raises(ValueError, match="validation"):
        load_rl_dataset(str(tmp_path), "validation")


def test_directory_in_hub_layout_is_read_by_load_dataset(tmp_path):
    (tmp_path / "data").mkdir()
    rows = {"question": ["A?", "B?"], "answer": ["#### 1", "#### 2"]}
    datasets.Dataset.from_dict(rows).to_parquet(tmp_path / "data" / "test-00000-of-00001.parquet")
    assert list(load_rl_dataset(str(tmp_path), "test")["answer"]) == ["1", "2"]


def test_bad_row_error_names_file_row_and_key(tmp_path):
    file = write_jsonl(
        tmp_path / "broken.jsonl",
        [
            {"question": "fine", "answer": "#### 1"},
            {"question": "no answer here"},
        ],
    )
    with pytest.raises(DatasetRowError, match=r"broken\.jsonl: row 1 \(line 2\) has no 'answer' field \(keys present"):
        load_rl_dataset(str(file), "train")


def test_a_row_is_named_by_its_line_too_where_the_file_has_lines(tmp_path):
    """Rows count from 0 and skip blank lines; the line is the one an editor shows."""
    (tmp_path / "blank.jsonl").write_text('{"prompt": "p", "answer": "1"}\n\n{"prompt": "q"}\n')
    with pytest.raises(DatasetRowError, match=r"blank\.jsonl: row 1 \(line 3\) has no 'answer' field"):
        load_rl_dataset(str(tmp_path / "blank.jsonl"), "train", type="chat")
    datasets.Dataset.from_dict({"prompt": ["p", "q"], "answer": ["1", None]}).to_parquet(tmp_path / "rows.parquet")
    with pytest.raises(DatasetRowError) as err:
        load_rl_dataset(str(tmp_path / "rows.parquet"), "train", type="chat")
    assert (
        str(err.value) == f"{tmp_path / 'rows.parquet'}: row 1: 'answer' is null; expected a non-empty string or number"
    )


def test_a_null_field_is_called_null_not_missing(tmp_path):
    file = write_jsonl(tmp_path / "null.jsonl", [{"question": None, "answer": "#### 1"}])
    with pytest.raises(
        DatasetRowError, match=r"null\.jsonl: row 0 \(line 1\): 'question' is null; expected non-empty text$"
    ):
        load_rl_dataset(str(file), "train")


def test_chat_row_without_prompt_or_messages_is_rejected(tmp_path):
    file = write_jsonl(tmp_path / "chat.jsonl", [{"question": "x", "answer": "1"}])
    with pytest.raises(DatasetRowError, match=r"row 0 \(line 1\) has neither 'messages' nor 'prompt'"):
        load_rl_dataset(str(file), "train", type="chat")


def test_unknown_type_and_missing_local_path():
    with pytest.raises(ValueError, match=r"unknown dataset type 'math'.*'chat', 'gsm8k'"):
        load_rl_dataset("gsm8k", "train", type="math")
    with pytest.raises(ValueError, match=r"'\./nope\.jsonl' does not exist"):
        load_rl_dataset("./nope.jsonl", "train")


@pytest.mark.parametrize("env", ["HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"])
def test_hub_name_offline_fails_fast_and_says_why(monkeypatch, env):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the Makefile sets both
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv(env, "1")
    start = time.monotonic()
    with pytest.raises(HubUnreachableError, match="hub cannot be reached") as err:
        load_rl_dataset("openai/gsm8k", "train")
    assert time.monotonic() - start < 5
    assert env in str(err.value) and "'gsm8k'" in str(err.value)


def test_unreachable_hub_endpoint_fails_fast(monkeypatch):
    from huggingface_hub import constants

    with socket.socket() as s:  # a port nobody listens on: connection refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    start = time.monotonic()
    with pytest.raises(HubUnreachableError, match="not a local path"):
        load_rl_dataset("someone/some-dataset", "train", type="chat")
    assert time.monotonic() - start < 10


def test_prompt_length_filter_counts_chat_templated_tokens(tmp_path, smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    sample = load_rl_dataset("gsm8k", "test").select(range(60))
    file = tmp_path / "sample.jsonl"
    sample.to_json(file)  # rows with messages + answer: the "chat" type

    def n_tokens(messages):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    lengths = [n_tokens(m) for m in sample["messages"]]
    limit = sorted(lengths)[30]
    kept = load_rl_dataset(str(file), "x", type="chat", max_prompt_tokens=limit, tokenizer=tokenizer)
    assert len(kept) == sum(n <= limit for n in lengths) < 60
    assert all(n_tokens(m) <= limit for m in kept["messages"])
    with pytest.raises(ValueError, match="needs a tokenizer"):
        load_rl_dataset("gsm8k", "test", max_prompt_tokens=10)
    shortest = min(lengths)  # a limit below every prompt: said so, not an empty dataset for the loader to refuse
    with pytest.raises(
        ValueError, match=rf"max_prompt_tokens={shortest - 1} drops all 60 rows .* has {shortest} tokens"
    ):
        load_rl_dataset(str(file), "x", type="chat", max_prompt_tokens=shortest - 1, tokenizer=tokenizer)


def test_a_field_of_two_types_is_named_with_a_row_of_each(tmp_path):
    rows = [
        {"question": "q", "answer": "#### 1", "id": i if i != 2 else "x2", "score": [1, 0.5][i % 2]} for i in range(4)
    ]
    file = tmp_path / "mixed.jsonl"
    file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(
        ValueError, match=r"rows cannot form one table \(field 'id' is number in row 0 and str in row 2\)"
    ):
        load_rl_dataset(str(file), "train")
