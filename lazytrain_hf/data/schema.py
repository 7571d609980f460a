"""The MetaMathQA row format and the training-sequence format every other data module shares.

Rows have three string fields: ``query`` (the problem), ``response`` (a worked solution ending in
``"The answer is: X"``) and ``type`` (its origin, e.g. ``"GSM_Rephrased"``); `REQUIRED_FIELDS` must be present.
Training sequences are ``prompt(query) + response + eos`` with labels `IGNORE_INDEX` on the prompt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    pass


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
