"""Loading MetaMathQA-format rows: the bundled sample, local JSON / JSON Lines files or a Hub dataset, validated
row by row, split into train and held-out eval rows; errors that say how to work offline."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from datasets import Dataset

from .sample import embedded_split_size, make_arithmetic_sample
from .schema import EMBEDDED, REQUIRED_FIELDS


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
