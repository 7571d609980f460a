"""MetaMathQA data: loading, prompt/label formatting, answer extraction, and a bundled offline sample.

MetaMathQA rows have three string fields: ``query`` (the problem), ``response`` (a worked solution ending in
``"The answer is: X"``) and ``type`` (its origin, e.g. ``"GSM_Rephrased"``). Training sequences are
``prompt(query) + response + eos`` with labels only on ``response + eos``; the prompt is rendered with the tokenizer's
chat template when it has one, else with the Alpaca-style prompt MetaMath itself trained with.

The bundled sample (`dataset_name="embedded"`) is a deterministic generator of one- and two-digit addition and
subtraction word problems in MetaMathQA's format (worked column by column, then "The answer is: N"), with disjoint
train and eval splits, plus a byte-level BPE tokenizer trained on it (`build_embedded_tokenizer`), so the recipe and
the tests run with no network.

One concept per module; every public name is importable from ``lazytrain_hf.data``:

- `schema`: the row and training-sequence format (field names, answer prefix, ignore index, MetaMath's prompt);
- `answers`: answer extraction and normalisation (what exact match compares);
- `sample`: the bundled arithmetic sample's generator and splits;
- `sources`: loading rows (bundled, local JSON / JSON Lines, Hub), validation, train/eval splits, offline errors;
- `tokenizer`: the bundled sample's BPE tokenizer;
- `formatting`: prompt + response + eos with labels on the response, and the padding collator.

Heavy libraries (`datasets`, `tokenizers`, `transformers`, `torch`) are imported inside the functions that need them.
"""

from __future__ import annotations

from .answers import answer_of, extract_answer, last_boxed, normalize_answer
from .formatting import CausalLMCollator, build_prompt, encode_prompt, format_dataset, tokenize_example
from .sample import embedded_split_size, make_arithmetic_sample
from .schema import ANSWER_PREFIX, EMBEDDED, IGNORE_INDEX, OVERLONG_POLICIES, PLAIN_PROMPT, REQUIRED_FIELDS
from .sources import (
    HubUnavailableError,
    hub_unavailable,
    is_local_dataset,
    is_offline_error,
    load_raw_dataset,
    load_splits,
    validate_rows,
)
from .tokenizer import EMBEDDED_CHAT_TEMPLATE, EMBEDDED_SPECIAL_TOKENS, build_embedded_tokenizer

__all__ = [
    "ANSWER_PREFIX",
    "CausalLMCollator",
    "EMBEDDED",
    "EMBEDDED_CHAT_TEMPLATE",
    "EMBEDDED_SPECIAL_TOKENS",
    "HubUnavailableError",
    "IGNORE_INDEX",
    "OVERLONG_POLICIES",
    "PLAIN_PROMPT",
    "REQUIRED_FIELDS",
    "answer_of",
    "build_embedded_tokenizer",
    "build_prompt",
    "embedded_split_size",
    "encode_prompt",
    "extract_answer",
    "format_dataset",
    "hub_unavailable",
    "is_local_dataset",
    "is_offline_error",
    "last_boxed",
    "load_raw_dataset",
    "load_splits",
    "make_arithmetic_sample",
    "normalize_answer",
    "tokenize_example",
    "validate_rows",
]
