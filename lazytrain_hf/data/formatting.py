"""Training sequences: the prompt (chat template or MetaMath's Alpaca-style prompt) + response + eos, labels on the
response only, overlong rows truncated / dropped / refused, and the collator that pads them into batches."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase

from .schema import IGNORE_INDEX, OVERLONG_POLICIES, PLAIN_PROMPT
from .sources import validate_rows


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
