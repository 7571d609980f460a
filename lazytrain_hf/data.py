"""MetaMathQA data: loading, prompt/label formatting, answer extraction, and a bundled offline sample.

MetaMathQA rows have three string fields: ``query`` (the problem), ``response`` (a worked solution ending in
``"The answer is: X"``) and ``type`` (its origin, e.g. ``"GSM_Rephrased"``). Training sequences are
``prompt(query) + response + eos`` with labels only on ``response + eos``; the prompt is rendered with the tokenizer's
chat template when it has one, else with the Alpaca-style prompt MetaMath itself trained with.

The bundled sample (`dataset_name="embedded"`) is a deterministic generator of one- and two-digit addition and
subtraction word problems in MetaMathQA's format (worked column by column, then "The answer is: N"), with disjoint
train and eval splits, plus a byte-level BPE tokenizer
trained on it (`build_embedded_tokenizer`), so the recipe and the tests run with no network.

Heavy libraries (`datasets`, `tokenizers`, `transformers`, `torch`) are imported inside the functions that need them.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase

EMBEDDED = "embedded"
REQUIRED_FIELDS = ("query", "response")
ANSWER_PREFIX = "The answer is: "
IGNORE_INDEX = -100
OVERLONG_POLICIES = ("truncate", "drop", "error")

# MetaMath's own training prompt (Alpaca style), used for tokenizers that have no chat template.
PLAIN_PROMPT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{query}\n\n### Response:\n"
)


# ----------------------------------------------------------------------------------------------------------------------
# Answer extraction and normalisation
# ----------------------------------------------------------------------------------------------------------------------

_ANSWER_RE = re.compile(r"the answer is\s*:?", re.IGNORECASE)
_NUMBER_RE = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)$")
_FRACTION_RE = re.compile(r"^([+-]?)\(?([+-]?(?:\d+\.?\d*|\.\d+))\)?/\(?([+-]?(?:\d+\.?\d*|\.\d+))\)?$")
# thousands separators only (1,234,567); "1,2" stays a list
_THOUSANDS_RE = re.compile(r"(?<![\d.])(\d{1,3}(?:,\d{3})+)(?![\d,])")
_ASSIGNMENT_RE = re.compile(r"^[a-zA-Z]\s*=(?!=)")


def _braced(text: str, open_at: int) -> tuple[str, int] | None:
    """Content of the ``{...}`` group whose ``{`` is at ``open_at`` (nested braces matched) and the index after it."""
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : i], i + 1
    return None


def last_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` (or ``\fbox{...}``) in ``text``, nested braces matched; None if absent."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*(?={)", text)]
    for start in reversed(starts):
        group = _braced(text, start)
        if group is not None:
            return group[0]
    return None


def _replace_macro(text: str, macro: str, render) -> str:
    r"""Rewrite every ``\macro{a}{b}...`` (arity taken from ``render``) bottom-up, nested braces matched."""
    arity = render.__code__.co_argcount
    pattern = re.compile(re.escape(macro) + r"\s*(?={)")
    while True:
        m = None
        for m_ in pattern.finditer(text):
            m = m_  # the last one is innermost-or-later, so nested macros are rewritten first
        if m is None:
            return text
        args, pos = [], m.end()
        for _ in range(arity):
            group = _braced(text, pos) if pos < len(text) and text[pos] == "{" else None
            if group is None:
                return text  # malformed: leave as is rather than guess
            args.append(group[0])
            pos = group[1]
        text = text[: m.start()] + render(*args) + text[pos:]


def _canonical_number(text: str) -> str | None:
    """``"38.0"`` -> ``"38"``, ``"+5"`` -> ``"5"``, ``"6/8"`` -> ``"3/4"``, ``"0.5"`` -> ``"1/2"``; None if not a number.

    Every numeric value is written as a reduced fraction (``p/q``, or ``p`` when ``q == 1``) so equal values written
    as decimals, fractions or LaTeX fractions compare equal.
    """
    try:
        if _NUMBER_RE.match(text):
            value = Fraction(text)
        else:
            m = _FRACTION_RE.match(text)
            if m is None:
                return None
            sign, num, den = m.groups()
            if Fraction(den) == 0:
                return None
            value = Fraction(num) / Fraction(den) * (-1 if sign == "-" else 1)
    except (ValueError, ZeroDivisionError):
        return None
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def normalize_answer(text: str) -> str:
    r"""Canonical form of a final answer, so that equal answers written differently compare equal.

    - ``\boxed{...}`` / ``\fbox{...}``, ``$``, ``\text{...}``, ``\left``/``\right``, LaTeX spacing, ``\%``/``%``,
      degree marks, a trailing period and a leading ``x =`` are removed; all whitespace is removed.
    - Numbers: thousands separators (``1,234``), a leading ``+``, trailing zeros (``38.0``) are dropped;
      ``\frac{a}{b}``, ``\dfrac{a}{b}``, ``a/b`` and decimals become a reduced fraction (``\frac{6}{8}`` -> ``3/4``,
      ``0.5`` -> ``1/2``, ``\frac{4}{2}`` -> ``2``).
    - Anything else (expressions, intervals, words) keeps its characters, whitespace removed.
    """
    if not isinstance(text, str):
        raise TypeError(f"normalize_answer expects a str, got {type(text).__name__}: {text!r}")
    s = text.strip()
    boxed = last_boxed(s)
    if boxed is not None:
        s = boxed
    s = s.replace("\u2212", "-").replace("$", "")
    for macro in (r"\text", r"\textbf", r"\mathrm", r"\mbox"):
        s = _replace_macro(s, macro, lambda a: a)
    for macro in (r"\dfrac", r"\tfrac", r"\frac"):
        s = _replace_macro(s, macro, lambda a, b: f"({a})/({b})")
    s = re.sub(r"\\frac(\d)(\d)", r"(\1)/(\2)", s)  # \frac12 shorthand
    s = re.sub(r"\\(left|right)\b", "", s)
    s = re.sub(r"\\[,;:! ]", "", s)
    s = re.sub(r"\^\s*\{?\\circ\}?", "", s).replace("\\%", "").replace("%", "")
    s = s.strip().rstrip(".").strip()
    s = _ASSIGNMENT_RE.sub("", s).strip()
    s = _THOUSANDS_RE.sub(lambda m: m.group(1).replace(",", ""), s)
    s = re.sub(r"\s+", "", s)
    # "(3)/(4)" from \frac: drop parentheses around plain numbers ...
    s = re.sub(r"\(([+-]?(?:\d+\.?\d*|\.\d+))\)", r"\1", s)
    # ... and around single terms such as "(\sqrt{2})"; groups with operators or commas keep them
    s = re.sub(r"\(([^()+\-*/,=]+)\)", r"\1", s)
    number = _canonical_number(s)
    return number if number is not None else s


def extract_answer(text: str) -> str | None:
    r"""The normalised final answer of a solution, or None when it states none.

    Looks, in order, for the last ``"The answer is: X"`` (X = the rest of that line), the last ``\boxed{X}``, and
    the GSM8K marker ``"#### X"``; X goes through `normalize_answer`.

    Example:
        >>> extract_answer("She has 23 + 15 = 38 apples.\nThe answer is: 38")
        '38'
        >>> extract_answer("so x = \\boxed{\\frac{6}{8}}")
        '3/4'
    """
    if not isinstance(text, str):
        raise TypeError(f"extract_answer expects a str, got {type(text).__name__}: {text!r}")
    matches = list(_ANSWER_RE.finditer(text))
    if matches:
        rest = text[matches[-1].end() :].strip()
        line = rest.split("\n", 1)[0].strip()
        return normalize_answer(line) if line else None
    boxed = last_boxed(text)
    if boxed is not None:
        return normalize_answer(boxed)
    if "####" in text:
        line = text.rsplit("####", 1)[1].strip().split("\n", 1)[0]
        return normalize_answer(line) if line.strip() else None
    return None


def answer_of(text: str) -> str:
    """`extract_answer` when the text states an answer, else the whole text normalised (a bare reference like "38")."""
    extracted = extract_answer(text)
    return extracted if extracted is not None else normalize_answer(text)


# ----------------------------------------------------------------------------------------------------------------------
# Bundled offline sample: arithmetic word problems in MetaMathQA's format
# ----------------------------------------------------------------------------------------------------------------------

_NAMES = (
    ("Tom", "He"), ("Anna", "She"), ("Ben", "He"), ("Mia", "She"), ("Sam", "He"), ("Lily", "She"),
    ("Jack", "He"), ("Emma", "She"), ("Leo", "He"), ("Zoe", "She"), ("Max", "He"), ("Ella", "She"),
)  # fmt: skip
_ITEMS = ("apples", "books", "stickers", "marbles", "cookies", "pencils", "cards", "shells", "coins", "flowers")

# (query, response); {c} is the result. Responses work digit by digit ({work}, see `_worked_digits`) before stating
# the result, as a worked solution would: a small model learns one-digit facts and carries far sooner than
# whole two-digit sums.
_ADD_TEMPLATES = (
    (
        "{name} has {a} {item}. {pron} buys {b} more. How many {item} does {name} have now?",
        "{work}\n{name} has {a} + {b} = {c} {item} now.",
    ),
    (
        "{name} picked {a} {item} in the morning and {b} {item} in the afternoon. "
        "How many {item} did {name} pick in total?",
        "{work}\n{name} picked {a} + {b} = {c} {item} in total.",
    ),
    (
        "A box holds {a} {item} and a bag holds {b} {item}. How many {item} are there altogether?",
        "{work}\nThere are {a} + {b} = {c} {item} altogether.",
    ),
)
_SUB_TEMPLATES = (
    (
        "{name} has {a} {item}. {pron} gives {b} of them to a friend. How many {item} does {name} have left?",
        "{work}\n{name} has {a} - {b} = {c} {item} left.",
    ),
    (
        "There are {a} {item} in a basket. {name} takes {b} of them. How many {item} are left in the basket?",
        "{work}\nThere are {a} - {b} = {c} {item} left in the basket.",
    ),
    (
        "{name} had {a} {item} and lost {b} of them. How many {item} does {name} have now?",
        "{work}\n{name} has {a} - {b} = {c} {item} now.",
    ),
)


def _worked_digits(op: str, a: int, b: int) -> str:
    """Column arithmetic: ``"Ones: 7+5=12. Tens: 4+3+1=8."`` (carry) or ``"Ones: 12-5=7. Tens: 6-3-1=2."`` (borrow)."""
    (a10, a1), (b10, b1) = divmod(a, 10), divmod(b, 10)
    if op == "add":
        carry = (a1 + b1) // 10
        return f"Ones: {a1}+{b1}={a1 + b1}. Tens: {a10}+{b10}+{carry}={a10 + b10 + carry}."
    borrow = int(a1 < b1)
    return f"Ones: {a1 + 10 * borrow}-{b1}={a1 + 10 * borrow - b1}. Tens: {a10}-{b10}-{borrow}={a10 - b10 - borrow}."


# Every (operation, a, b) lands in exactly one split, so eval problems are never seen in training, even reworded.
_EVAL_FRACTION = 0.1
_MAX_OPERAND = 99


def _problem_pools(seed: int) -> dict[str, list[tuple[str, int, int]]]:
    problems = [("add", a, b) for a in range(1, _MAX_OPERAND + 1) for b in range(1, _MAX_OPERAND + 1)]
    problems += [("sub", a, b) for a in range(1, _MAX_OPERAND + 1) for b in range(1, a + 1)]
    random.Random(f"lazytrain-split-{seed}").shuffle(problems)
    n_eval = int(len(problems) * _EVAL_FRACTION)
    return {"eval": problems[:n_eval], "train": problems[n_eval:]}


def embedded_split_size(split: str, seed: int = 0) -> int:
    """How many distinct problems the bundled sample's ``split`` holds."""
    return len(_problem_pools(seed)[_check_split(split)])


def _check_split(split: str) -> str:
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r} is not a split of the embedded sample; use 'train' or 'eval'.")
    return split


def make_arithmetic_sample(split: str, num_samples: int, seed: int = 0) -> list[dict[str, str]]:
    """Rows ``{"query", "response", "type"}`` of addition/subtraction word problems (operands 1-99), deterministic.

    The same ``(split, num_samples, seed)`` always gives the same rows; a smaller ``num_samples`` gives a prefix of a
    larger one. ``train`` and ``eval`` of one seed never share an ``(operation, a, b)`` problem.

    Args:
        split (`str`): ``"train"`` or ``"eval"``.
        num_samples (`int`): number of rows; at most `embedded_split_size(split, seed)`.
        seed (`int`, defaults to 0): selects the split partition, the problem order and the wording.
    """
    pool = _problem_pools(seed)[_check_split(split)]
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 1:
        raise ValueError(f"num_samples={num_samples!r} must be a positive int.")
    if num_samples > len(pool):
        raise ValueError(
            f"num_samples={num_samples} exceeds the {len(pool)} distinct problems of the embedded {split!r} split; "
            f"pass num_samples <= {len(pool)}."
        )
    rng = random.Random(f"lazytrain-wording-{split}-{seed}")
    rows = []
    for op, a, b in pool[:num_samples]:
        query_t, response_t = rng.choice(_ADD_TEMPLATES if op == "add" else _SUB_TEMPLATES)
        name, pron = rng.choice(_NAMES)
        item = rng.choice(_ITEMS)
        c = a + b if op == "add" else a - b
        fields = dict(name=name, pron=pron, item=item, a=a, b=b, c=c, work=_worked_digits(op, a, b))
        rows.append(
            {
                "query": query_t.format(**fields),
                "response": response_t.format(**fields) + "\n" + ANSWER_PREFIX + str(c),
                "type": f"EMBEDDED_{op}",
            }
        )
    return rows


# ----------------------------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------------------------


class HubUnavailableError(ConnectionError):
    """The HuggingFace Hub could not be reached (no network, or offline mode) for a name that needs it."""


def is_offline_error(exc: BaseException) -> bool:
    """True when ``exc`` or anything it was raised from is a failure to reach the Hub (not e.g. a missing repo)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        names = {cls.__name__ for cls in type(exc).__mro__}
        if names & {"ConnectionError", "OfflineModeIsEnabled", "LocalEntryNotFoundError", "ConnectError", "Timeout"}:
            return True
        message = str(exc)
        if "couldn't connect to" in message.lower() or "couldn't reach" in message.lower():
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def hub_unavailable(what: str, name: str, option: str, exc: BaseException) -> HubUnavailableError:
    """A `HubUnavailableError` that says what could not be fetched and how to pass a local path instead."""
    return HubUnavailableError(
        f"{option}={name!r} is a HuggingFace Hub name, but the Hub cannot be reached from this machine "
        f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). Download the {what} where there "
        f"is network (e.g. `hf download {name}{' --repo-type dataset' if what == 'dataset' else ''} --local-dir "
        f"DIR`) and pass {option}=DIR{' (or DIR/FILE.json)' if what == 'dataset' else ''}, or use "
        f"{option}={EMBEDDED!r} for the bundled offline {what}."
    )


def _read_json_rows(path: str) -> list[Any]:
    """Rows of a JSON list (``[{...}, ...]``, optionally under a ``"data"`` key) or a JSON Lines file."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".jsonl"):
        return _json_lines(path, text)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if text.lstrip().startswith("{"):  # JSON Lines without the .jsonl suffix
            return _json_lines(path, text)
        raise ValueError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}).") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}; expected a list of row objects or JSON Lines.")
    return data


def _json_lines(path: str, text: str) -> list[Any]:
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path}: line {lineno} is not valid JSON ({e.msg}); JSON Lines needs one object a line."
                ) from None
    return rows


def validate_rows(rows: Sequence[Any] | Dataset, source: str) -> None:
    """Check every row has non-empty string ``query`` and ``response`` fields.

    Raises:
        ValueError: no rows, or a row lacks a field (the message names the row, counted from 0, and the field).
        TypeError: a field is not a string.
    """
    n = len(rows)
    if n == 0:
        raise ValueError(f"dataset {source!r} has no rows; it needs rows with string fields 'query' and 'response'.")
    columns = getattr(rows, "column_names", None)
    if columns is not None:  # a datasets.Dataset: check whole columns, then values
        for field_name in REQUIRED_FIELDS:
            if field_name not in columns:
                raise ValueError(
                    f"dataset {source!r}: row 0 lacks field {field_name!r} (columns: {', '.join(columns)}); every "
                    f"row needs string fields 'query' and 'response' (MetaMathQA format)."
                )
        for field_name in REQUIRED_FIELDS:
            for i, value in enumerate(rows[field_name]):
                _check_value(source, i, field_name, value)
        return
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise TypeError(f"dataset {source!r}: row {i} is a {type(row).__name__}, expected an object with "
                            f"'query' and 'response'.")  # fmt: skip
        for field_name in REQUIRED_FIELDS:
            if field_name not in row:
                raise ValueError(
                    f"dataset {source!r}: row {i} lacks field {field_name!r} (has: {', '.join(map(str, row)) or '-'}); "
                    f"every row needs string fields 'query' and 'response' (MetaMathQA format)."
                )
            _check_value(source, i, field_name, row[field_name])


def _check_value(source: str, i: int, field_name: str, value: Any) -> None:
    if value is None:
        raise ValueError(
            f"dataset {source!r}: row {i} lacks field {field_name!r} (it is null); fill it or drop the row."
        )
    if not isinstance(value, str):
        raise TypeError(
            f"dataset {source!r}: row {i} field {field_name!r} is a {type(value).__name__} ({value!r}); expected a "
            f"string."
        )
    if not value.strip():
        raise ValueError(f"dataset {source!r}: row {i} field {field_name!r} is empty; fill it or drop the row.")


def _rows_to_dataset(rows: Iterable[dict[str, Any]]) -> Dataset:
    from datasets import Dataset

    rows = list(rows)
    return Dataset.from_dict(
        {
            "query": [r["query"] for r in rows],
            "response": [r["response"] for r in rows],
            "type": [str(r.get("type") or "") for r in rows],
        }
    )


def is_local_dataset(name: str) -> bool:
    return os.path.exists(name) or name.endswith((".json", ".jsonl"))


def load_raw_dataset(dataset_name: str, split: str = "train") -> Dataset:
    """All rows of a MetaMathQA-format dataset, validated, as a `datasets.Dataset` (columns query, response, type).

    Args:
        dataset_name (`str`): a local ``.json`` / ``.jsonl`` file, a directory of them (rows concatenated in file
            name order; row numbers in errors count across files), or a Hub dataset name such as
            ``"meta-math/MetaMathQA"`` (needs network or the Hub cache). ``"embedded"`` is not a file: use
            `load_splits`.
        split (`str`, defaults to ``"train"``): the Hub split to read (MetaMathQA has only ``train``).

    Raises:
        HubUnavailableError: a Hub name while the Hub cannot be reached; says how to pass a local file.
        ValueError / TypeError: see `validate_rows`; missing local files.
    """
    if is_local_dataset(dataset_name):
        path = os.path.expanduser(dataset_name)
        if os.path.isdir(path):  # e.g. a `hf download --local-dir DIR` of the dataset repository
            files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith((".json", ".jsonl")))
            if not files:
                raise ValueError(
                    f"dataset_name={dataset_name!r} is a directory with no .json/.jsonl files; pass a directory "
                    f"holding them, a file, a Hub name or {EMBEDDED!r}."
                )
        elif os.path.isfile(path):
            files = [path]
        else:
            raise ValueError(
                f"dataset_name={dataset_name!r}: no such file; pass an existing .json/.jsonl file, a Hub name or "
                f"{EMBEDDED!r}."
            )
        rows = [row for f in files for row in _read_json_rows(f)]
        validate_rows(rows, dataset_name)
        return _rows_to_dataset(rows)

    import datasets

    try:
        ds = datasets.load_dataset(dataset_name, split=split)
    except Exception as e:
        if is_offline_error(e):
            raise hub_unavailable("dataset", dataset_name, "dataset_name", e) from e
        raise
    validate_rows(ds, dataset_name)
    keep = [c for c in ds.column_names if c in ("query", "response", "type")]
    ds = ds.select_columns(keep)
    if "type" not in keep:
        ds = ds.add_column("type", [""] * len(ds))
    return ds


def load_splits(
    dataset_name: str = EMBEDDED,
    num_train_samples: int | None = None,
    num_eval_samples: int = 200,
    seed: int = 0,
) -> tuple[Dataset, Dataset]:
    """Disjoint train and eval datasets (columns query, response, type).

    ``"embedded"`` draws from the bundled generator's own train/eval splits. A file or Hub dataset is shuffled with
    ``seed`` and the first ``num_eval_samples`` rows become the eval split, the next ``num_train_samples`` (all the
    rest when None) the train split, so no row is in both.
    """
    if num_eval_samples is None or num_eval_samples < 1:
        raise ValueError(f"num_eval_samples={num_eval_samples!r} must be >= 1.")
    if num_train_samples is not None and num_train_samples < 1:
        raise ValueError(f"num_train_samples={num_train_samples!r} must be >= 1 (or None for all rows).")
    if dataset_name == EMBEDDED:
        n_train = num_train_samples if num_train_samples is not None else embedded_split_size("train", seed)
        train = _rows_to_dataset(make_arithmetic_sample("train", n_train, seed))
        return train, _rows_to_dataset(make_arithmetic_sample("eval", num_eval_samples, seed))

    full = load_raw_dataset(dataset_name)
    if num_eval_samples >= len(full):
        raise ValueError(
            f"num_eval_samples={num_eval_samples} leaves no training rows: {dataset_name!r} has {len(full)} rows; pass "
            f"num_eval_samples < {len(full)}."
        )
    shuffled = full.shuffle(seed=seed)
    eval_ds = shuffled.select(range(num_eval_samples))
    end = len(full) if num_train_samples is None else min(len(full), num_eval_samples + num_train_samples)
    return shuffled.select(range(num_eval_samples, end)), eval_ds


# ----------------------------------------------------------------------------------------------------------------------
# Tokenizer for the bundled sample
# ----------------------------------------------------------------------------------------------------------------------

EMBEDDED_SPECIAL_TOKENS = {"pad": "<|pad|>", "bos": "<|bos|>", "eos": "<|im_end|>", "im_start": "<|im_start|>"}
EMBEDDED_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_embedded_tokenizer(vocab_size: int = 512, num_samples: int = 4000, seed: int = 0):
    """A byte-level BPE tokenizer trained on the bundled sample's train split, as a `PreTrainedTokenizerFast`.

    Digits are split one per token (as Qwen's tokenizer does) so numbers are spelled, not memorised. Pad, bos and
    eos are distinct tokens: with pad == eos, collators that mask padding would also mask the real eos. The chat
    template is ChatML-like: ``<|bos|><|im_start|>user\\n{query}<|im_end|>\\n<|im_start|>assistant\\n``.
    Training is deterministic: the same arguments give the same vocabulary.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = list(EMBEDDED_SPECIAL_TOKENS.values())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    rows = make_arithmetic_sample("train", min(num_samples, embedded_split_size("train", seed)), seed)
    # the role names are trained too, so the chat template's "user"/"assistant" are single tokens
    texts = (f"user\n{r['query']}\nassistant\n{r['response']}" for r in rows)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EMBEDDED_SPECIAL_TOKENS["bos"],
        eos_token=EMBEDDED_SPECIAL_TOKENS["eos"],
        pad_token=EMBEDDED_SPECIAL_TOKENS["pad"],
        additional_special_tokens=[EMBEDDED_SPECIAL_TOKENS["im_start"]],
        chat_template=EMBEDDED_CHAT_TEMPLATE,
        model_max_length=2048,
    )


# ----------------------------------------------------------------------------------------------------------------------
# Formatting: prompt + response, labels on the response only
# ----------------------------------------------------------------------------------------------------------------------


def build_prompt(query: str, tokenizer: PreTrainedTokenizerBase) -> str:
    """The prompt text for ``query``: the chat template's user turn + assistant header, else MetaMath's prompt."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": query}], tokenize=False, add_generation_prompt=True
        )
    return PLAIN_PROMPT.format(query=query)


def encode_prompt(query: str, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Token ids of the prompt; generation continues right after them, exactly as the training sequences do."""
    templated = bool(getattr(tokenizer, "chat_template", None))
    # a chat template already writes its special tokens; a plain prompt gets the tokenizer's own (e.g. bos)
    return tokenizer(build_prompt(query, tokenizer), add_special_tokens=not templated)["input_ids"]


def _eos_id(tokenizer: PreTrainedTokenizerBase) -> int:
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no eos_token; set tokenizer.eos_token so "
            f"training teaches the model where a response ends."
        )
    return tokenizer.eos_token_id


def tokenize_example(
    query: str,
    response: str,
    tokenizer: PreTrainedTokenizerBase,
    max_seq_length: int,
    overlong: str = "truncate",
    row: int | None = None,
) -> dict[str, list[int]] | None:
    """``{"input_ids", "attention_mask", "labels"}`` for one row; labels are `IGNORE_INDEX` on the prompt.

    ``overlong`` says what happens when prompt + response + eos exceeds ``max_seq_length`` tokens:
    ``"truncate"`` cuts the response from the right (the prompt is kept whole; a prompt that alone fills the limit
    raises), ``"drop"`` returns None, ``"error"`` raises. Errors name the row.
    """
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"overlong={overlong!r} is not supported; use one of {', '.join(OVERLONG_POLICIES)}.")
    if max_seq_length < 2:
        raise ValueError(f"max_seq_length={max_seq_length} must be >= 2.")
    prompt_ids = encode_prompt(query, tokenizer)
    target_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [_eos_id(tokenizer)]
    total = len(prompt_ids) + len(target_ids)
    where = f"row {row}" if row is not None else "example"
    if total > max_seq_length:
        if overlong == "drop":
            return None
        if overlong == "error" or len(prompt_ids) >= max_seq_length:
            raise ValueError(
                f"{where} is {total} tokens (prompt {len(prompt_ids)}), longer than max_seq_length={max_seq_length}; "
                f"raise max_seq_length, or use overlong='drop' to skip such rows"
                + (" or overlong='truncate' to cut the response." if overlong == "error" else ".")
            )
        target_ids = target_ids[: max_seq_length - len(prompt_ids)]
    input_ids = prompt_ids + target_ids
    return {
        "input_ids": input_ids,
        "attention_mask": [1] * len(input_ids),
        "labels": [IGNORE_INDEX] * len(prompt_ids) + target_ids,
    }


def format_dataset(
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    max_seq_length: int = 512,
    overlong: str = "truncate",
    source: str = "dataset",
) -> Dataset:
    """Tokenize a query/response dataset for causal-LM training (see `tokenize_example`); other columns are dropped.

    Raises:
        ValueError: no rows, a row lacks ``query``/``response``, or (``overlong="error"``) a row is too long; the
            message names the row. Also when ``overlong="drop"`` leaves no rows.

    ``source`` names the dataset in error messages.
    """
    validate_rows(dataset, source)
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"overlong={overlong!r} is not supported; use one of {', '.join(OVERLONG_POLICIES)}.")

    def _batch(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        out: dict[str, list] = {"input_ids": [], "attention_mask": [], "labels": []}
        for q, r, i in zip(batch["query"], batch["response"], indices):
            ex = tokenize_example(q, r, tokenizer, max_seq_length, overlong, row=i)
            if ex is not None:
                for k in out:
                    out[k].append(ex[k])
        return out

    # An explicit fingerprint: hashing the tokenizer inside the closure is slow and not always stable.
    key = json.dumps(
        [dataset._fingerprint, getattr(tokenizer, "name_or_path", ""), len(tokenizer), tokenizer.chat_template,
         max_seq_length, overlong, PLAIN_PROMPT],
        default=str,
    )  # fmt: skip
    formatted = dataset.map(
        _batch,
        with_indices=True,
        batched=True,
        remove_columns=dataset.column_names,
        new_fingerprint=hashlib.sha256(key.encode()).hexdigest()[:16],
        desc="Tokenizing",
    )
    if len(formatted) == 0:
        raise ValueError(
            f"every row is longer than max_seq_length={max_seq_length} tokens and overlong='drop' dropped them all; "
            f"raise max_seq_length."
        )
    return formatted


@dataclass
class CausalLMCollator:
    """Right-pads ``input_ids`` (with ``pad_token_id``), ``attention_mask`` (0) and ``labels`` (-100) to a batch.

    Labels come from the features, never from comparing ids with the pad id, so a real eos equal to the pad id is
    still learned.
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        import torch

        longest = max(len(f["input_ids"]) for f in features)
        if self.pad_to_multiple_of:
            longest = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = {"input_ids": [], "attention_mask": [], "labels": []}
        for f in features:
            pad = longest - len(f["input_ids"])
            batch["input_ids"].append(list(f["input_ids"]) + [self.pad_token_id] * pad)
            batch["attention_mask"].append(list(f.get("attention_mask") or [1] * len(f["input_ids"])) + [0] * pad)
            batch["labels"].append(list(f["labels"]) + [IGNORE_INDEX] * pad)
        return {k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()}
