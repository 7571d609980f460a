"""MetaMathQA data: formatting and label masking, answer extraction, the bundled sample, loading and its errors."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch

from lazytrain_hf.data import (
    ANSWER_PREFIX,
    IGNORE_INDEX,
    PLAIN_PROMPT,
    CausalLMCollator,
    HubUnavailableError,
    answer_of,
    build_embedded_tokenizer,
    build_prompt,
    embedded_split_size,
    encode_prompt,
    extract_answer,
    format_dataset,
    load_raw_dataset,
    load_splits,
    make_arithmetic_sample,
    normalize_answer,
    tokenize_example,
    validate_rows,
)


@pytest.fixture(scope="module")
def tok():
    return build_embedded_tokenizer()


@pytest.fixture(scope="module")
def plain_tok(tok):
    t = copy.deepcopy(tok)
    t.chat_template = None
    return t


# ------------------------------------------------------------------------------------------------ tokenizer


def test_embedded_tokenizer_special_tokens_are_distinct(tok):
    ids = {tok.pad_token_id, tok.eos_token_id, tok.bos_token_id}
    assert None not in ids and len(ids) == 3, (tok.pad_token, tok.eos_token, tok.bos_token)
    assert 256 < len(tok) <= 512
    # digits are one token each, so numbers are spelled digit by digit
    assert tok.convert_ids_to_tokens(tok("1234", add_special_tokens=False)["input_ids"]) == ["1", "2", "3", "4"]
    text = "Anna has 17 + 25 = 42 coins.\nThe answer is: 42"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_embedded_tokenizer_is_deterministic(tok):
    again = build_embedded_tokenizer()
    assert again.get_vocab() == tok.get_vocab()
    assert again.chat_template == tok.chat_template


# ------------------------------------------------------------------------------------------------ formatting


def test_chat_prompt_rendered_with_template(tok):
    prompt = build_prompt("What is 2 + 3?", tok)
    assert prompt == "<|bos|><|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"


def test_labels_cover_exactly_the_response_and_eos(tok):
    query, response = (
        "Tom has 23 apples. He buys 15 more. How many apples does Tom have now?",
        "23 + 15 = 38\n" + (ANSWER_PREFIX + "38"),
    )
    ex = tokenize_example(query, response, tok, max_seq_length=256)
    prompt_ids = encode_prompt(query, tok)
    response_ids = tok(response, add_special_tokens=False)["input_ids"]
    n = len(prompt_ids)
    assert ex["input_ids"] == prompt_ids + response_ids + [tok.eos_token_id]
    assert ex["attention_mask"] == [1] * len(ex["input_ids"])
    assert ex["labels"][:n] == [IGNORE_INDEX] * n
    assert ex["labels"][n:] == ex["input_ids"][n:]
    assert tok.decode(ex["labels"][n:]) == response + tok.eos_token
    assert ex["labels"][-1] == tok.eos_token_id  # the model learns to stop


def test_plain_prompt_without_chat_template(plain_tok):
    ex = tokenize_example("What is 2 + 3?", "The answer is: 5", plain_tok, max_seq_length=256)
    n = sum(label == IGNORE_INDEX for label in ex["labels"])
    assert plain_tok.decode(ex["input_ids"][:n]) == PLAIN_PROMPT.format(query="What is 2 + 3?")
    assert plain_tok.decode(ex["input_ids"][n:]) == "The answer is: 5" + plain_tok.eos_token


def test_overlong_truncate_drop_error(tok):
    query, response = "Q?", " ".join(["apples"] * 50) + "\nThe answer is: 1"
    prompt_len = len(encode_prompt(query, tok))
    ex = tokenize_example(query, response, tok, max_seq_length=prompt_len + 5, overlong="truncate")
    assert len(ex["input_ids"]) == prompt_len + 5
    assert ex["labels"][:prompt_len] == [IGNORE_INDEX] * prompt_len and IGNORE_INDEX not in ex["labels"][prompt_len:]
    assert tokenize_example(query, response, tok, max_seq_length=prompt_len + 5, overlong="drop") is None
    with pytest.raises(ValueError, match=r"row 7 .*longer than max_seq_length=\d+"):
        tokenize_example(query, response, tok, max_seq_length=prompt_len + 5, overlong="error", row=7)
    # truncation never cuts the prompt: a prompt that alone fills the limit is an error naming the row
    with pytest.raises(ValueError, match=r"row 3 .*max_seq_length"):
        tokenize_example(query, response, tok, max_seq_length=prompt_len, overlong="truncate", row=3)
    with pytest.raises(ValueError, match="overlong='cut'"):
        tokenize_example(query, response, tok, max_seq_length=64, overlong="cut")


def test_format_dataset_and_collator(tok):
    train, _ = load_splits("embedded", num_train_samples=6, num_eval_samples=1)
    ds = format_dataset(train, tok, max_seq_length=256)
    assert ds.column_names == ["input_ids", "attention_mask", "labels"] and len(ds) == 6
    for row, raw in zip(ds, train):
        assert row == tokenize_example(raw["query"], raw["response"], tok, 256)
    batch = CausalLMCollator(tok.pad_token_id)([ds[i] for i in range(6)])
    lengths = [len(ds[i]["input_ids"]) for i in range(6)]
    assert batch["input_ids"].shape == (6, max(lengths))
    for i, n in enumerate(lengths):
        assert batch["input_ids"][i, :n].tolist() == ds[i]["input_ids"]
        assert (batch["input_ids"][i, n:] == tok.pad_token_id).all()
        assert batch["attention_mask"][i].tolist() == [1] * n + [0] * (max(lengths) - n)
        assert batch["labels"][i].tolist() == ds[i]["labels"] + [IGNORE_INDEX] * (max(lengths) - n)


def test_collator_keeps_eos_label_when_pad_equals_eos():
    eos = 2
    features = [{"input_ids": [5, 6, eos], "labels": [-100, 6, eos]}, {"input_ids": [5, eos], "labels": [-100, eos]}]
    batch = CausalLMCollator(pad_token_id=eos, pad_to_multiple_of=4)(features)
    assert batch["labels"].tolist() == [[-100, 6, eos, -100], [-100, eos, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]
    assert batch["input_ids"].dtype == torch.long


def test_format_dataset_drop_all_is_an_error(tok):
    train, _ = load_splits("embedded", num_train_samples=3, num_eval_samples=1)
    with pytest.raises(ValueError, match="overlong='drop' dropped them all"):
        format_dataset(train, tok, max_seq_length=8, overlong="drop")
    with pytest.raises(ValueError, match=r"row 0 .*longer than max_seq_length=8"):
        format_dataset(train, tok, max_seq_length=8, overlong="error")


# ------------------------------------------------------------------------------------------------ answers


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so she has 38 apples.\nThe answer is: 38", "38"),
        ("The answer is: 1,234", "1234"),
        ("The answer is: 1,234,567.00", "1234567"),
        ("The answer is: 38.0", "38"),
        ("The answer is: +5", "5"),
        ("The answer is:  4 2 ", "42"),
        ("The answer is: -7.", "-7"),
        ("The answer is: \\frac{6}{8}", "3/4"),
        ("The answer is: \\dfrac{10}{4}", "5/2"),
        ("The answer is: -\\frac{3}{4}", "-3/4"),
        ("The answer is: \\frac{4}{2}", "2"),
        ("The answer is: 6/8", "3/4"),
        ("The answer is: 0.75", "3/4"),
        ("The answer is: $\\boxed{12}$", "12"),
        ("The answer is: 50\\%", "50"),
        ("The answer is: x = 3", "3"),
        ("The answer is: 2\\sqrt{3}", "2\\sqrt{3}"),
        ("The answer is: 1,2", "1,2"),  # a list, not a thousands separator
        ("First 1.\nThe answer is: 3\nThe answer is: 4\nmore text", "4"),  # the last statement, its line only
        ("We get \\boxed{\\frac{1}{2}} in the end", "1/2"),
        ("nested \\boxed{\\frac{\\sqrt{2}}{2}}", "\\sqrt{2}/2"),
        ("GSM8K style\n#### 72", "72"),
        ("no answer stated here", None),
        ("The answer is:", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_normalize_and_answer_of():
    assert normalize_answer("  $1,000$. ") == "1000"
    assert answer_of("38") == answer_of("The answer is: 38.00") == "38"
    assert answer_of("\\frac12") == answer_of("0.5") == "1/2"
    with pytest.raises(TypeError, match="expects a str"):
        normalize_answer(38)


# ------------------------------------------------------------------------------------------------ bundled sample


def test_generator_is_deterministic_and_prefix_stable():
    a = make_arithmetic_sample("train", 50, seed=0)
    assert a == make_arithmetic_sample("train", 50, seed=0)
    assert make_arithmetic_sample("train", 20, seed=0) == a[:20]
    assert a != make_arithmetic_sample("train", 50, seed=1)


def test_generator_rows_are_metamath_format_and_correct():
    rows = make_arithmetic_sample("train", 300) + make_arithmetic_sample("eval", 300)
    ops = set()
    for row in rows:
        assert set(row) == {"query", "response", "type"}
        m = re.search(r"(\d+) ([+-]) (\d+) = (\d+)", row["response"])
        a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
        assert c == (a + b if op == "+" else a - b) >= 0
        assert 1 <= a <= 99 and 1 <= b <= 99
        assert f"{a} " in row["query"] and f"{b} " in row["query"]
        assert row["response"].endswith(f"\n{ANSWER_PREFIX}{c}") and extract_answer(row["response"]) == str(c)
        assert row["type"] == ("EMBEDDED_add" if op == "+" else "EMBEDDED_sub")
        # the column work is right and leads to the result: ones digit, then tens with the carry / borrow
        w = re.match(r"Ones: (\d+)([+-])(\d+)=(\d+)\. Tens: (\d+)[+-](\d+)[+-]([01])=(\d+)\.\n", row["response"])
        o1, _, o2, ones, t1, t2, cb, tens = (int(x) if x.isdigit() else x for x in w.groups())
        assert ones == (o1 + o2 if op == "+" else o1 - o2) and 0 <= ones <= 18
        assert tens == (t1 + t2 + cb if op == "+" else t1 - t2 - cb) >= 0
        assert (o1 % 10, o2, t1, t2) == (a % 10, b % 10, a // 10, b // 10)
        assert cb == (ones >= 10 if op == "+" else o1 >= 10)
        assert c == 10 * tens + ones % 10
        ops.add(op)
    assert ops == {"+", "-"}


def test_generator_splits_are_disjoint():
    def problems(rows):
        return {re.search(r"\d+ [+-] \d+", r["response"])[0] for r in rows}

    n_train, n_eval = embedded_split_size("train"), embedded_split_size("eval")
    assert n_train > 10_000 and n_eval > 1_000
    train = make_arithmetic_sample("train", n_train)
    evals = make_arithmetic_sample("eval", n_eval)
    assert problems(train).isdisjoint(problems(evals))
    assert {r["query"] for r in train}.isdisjoint({r["query"] for r in evals})
    assert len(problems(train)) == n_train and len(problems(evals)) == n_eval  # no duplicates inside a split


def test_generator_errors():
    with pytest.raises(ValueError, match="split='test'"):
        make_arithmetic_sample("test", 5)
    with pytest.raises(ValueError, match=r"num_samples=100000 exceeds .* pass num_samples <= \d+"):
        make_arithmetic_sample("eval", 100_000)
    with pytest.raises(ValueError, match="num_samples=0"):
        make_arithmetic_sample("train", 0)


# ------------------------------------------------------------------------------------------------ loading


ROWS = [{"query": f"What is {i} + 1?", "response": f"{i} + 1 = {i + 1}\nThe answer is: {i + 1}", "type": "T"}
        for i in range(10)]  # fmt: skip


def test_load_local_json_and_jsonl(tmp_path):
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    as_list = tmp_path / "rows.json"
    as_list.write_text(json.dumps(ROWS))
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"data": ROWS}))
    no_suffix = tmp_path / "lines.json"  # JSON Lines under a .json name
    no_suffix.write_text("\n".join(json.dumps(r) for r in ROWS))
    for path in (jsonl, as_list, wrapped, no_suffix):
        ds = load_raw_dataset(str(path))
        assert ds.column_names == ["query", "response", "type"]
        assert ds.to_list() == ROWS, path

    folder = tmp_path / "downloaded"  # a dataset repository downloaded with `hf download --local-dir`
    folder.mkdir()
    (folder / "README.md").write_text("# card")
    (folder / "b.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS[5:]))
    (folder / "a.json").write_text(json.dumps(ROWS[:5]))
    assert load_raw_dataset(str(folder)).to_list() == ROWS
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match="directory with no .json/.jsonl files"):
        load_raw_dataset(str(tmp_path / "empty_dir"))

    train, evals = load_splits(str(jsonl), num_train_samples=5, num_eval_samples=3, seed=1)
    assert len(train) == 5 and len(evals) == 3
    assert set(train["query"]).isdisjoint(evals["query"])
    all_train, _ = load_splits(str(jsonl), num_eval_samples=3, seed=1)
    assert len(all_train) == 7 and set(all_train["query"]) | set(evals["query"]) == {r["query"] for r in ROWS}
    assert load_splits(str(jsonl), 5, 3, seed=1)[1]["query"] == evals["query"]  # deterministic


def test_missing_type_field_is_filled(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"query": r["query"], "response": r["response"]}) for r in ROWS))
    assert load_raw_dataset(str(path))["type"] == [""] * len(ROWS)


@pytest.mark.parametrize(
    ("row", "error", "pattern"),
    [
        ({"query": "Q"}, ValueError, r"row 4 lacks field 'response' \(has: query\)"),
        ({"response": "R"}, ValueError, r"row 4 lacks field 'query'"),
        ({"query": None, "response": "R"}, ValueError, r"row 4 lacks field 'query' \(it is null\)"),
        ({"query": "Q", "response": 5}, TypeError, r"row 4 field 'response' is a int"),
        ({"query": "  ", "response": "R"}, ValueError, r"row 4 field 'query' is empty"),
    ],
)
def test_bad_rows_name_row_and_field(tmp_path, row, error, pattern):
    rows = ROWS[:4] + [row] + ROWS[4:]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(error, match=pattern):
        load_raw_dataset(str(path))


def test_dataset_errors(tmp_path, tok):
    from datasets import Dataset

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="has no rows"):
        load_raw_dataset(str(empty))
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        load_raw_dataset(str(broken))
    with pytest.raises(ValueError, match="no such file"):
        load_raw_dataset(str(tmp_path / "missing.jsonl"))
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps(ROWS))
    with pytest.raises(ValueError, match=r"num_eval_samples=10 leaves no training rows: .* has 10 rows"):
        load_splits(str(ok), 1, 10)
    with pytest.raises(ValueError, match=r"row 0 lacks field 'response' \(columns: query, answer\)"):
        validate_rows(Dataset.from_dict({"query": ["Q"], "answer": ["A"]}), "mine")
    with pytest.raises(ValueError, match="has no rows"):
        format_dataset(Dataset.from_dict({"query": [], "response": []}), tok)


def test_hub_name_offline_error_says_how_to_pass_a_local_file():
    # a real Hub request: the tests run offline (conftest sets HF_HUB_OFFLINE=1), so datasets cannot reach the Hub
    with pytest.raises(
        HubUnavailableError, match=r"dataset_name='meta-math/MetaMathQA' .*DIR \(or DIR/FILE\.json\).*'embedded'"
    ):
        load_raw_dataset("meta-math/MetaMathQA")


def test_non_connectivity_hub_errors_pass_through(monkeypatch):
    import datasets

    def missing(*args, **kwargs):
        raise FileNotFoundError("Dataset 'someone/nothing' doesn't exist on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", missing)
    with pytest.raises(FileNotFoundError, match="doesn't exist"):
        load_raw_dataset("someone/nothing")
