"""Exact-match evaluation: the local `evaluate` module, batched greedy generation, and the two put together.

`evaluate` and `torch` are imported on first use, so importing this package is cheap.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..data import encode_prompt

if TYPE_CHECKING:  # pragma: no cover
    import evaluate
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

EXACT_MATCH_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "exact_match.py")

__all__ = ["EXACT_MATCH_PATH", "evaluate_exact_match", "generate_responses", "load_exact_match"]


def load_exact_match(**kwargs: Any) -> evaluate.EvaluationModule:
    """The bundled exact-match metric, loaded by path with ``evaluate.load`` (no Hub access needed).

    Keyword arguments go to ``evaluate.load`` (e.g. ``experiment_id``, ``keep_in_memory``).
    """
    import evaluate

    return evaluate.load(EXACT_MATCH_PATH, **kwargs)


def generate_responses(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    queries: Sequence[str],
    max_new_tokens: int = 64,
    batch_size: int = 32,
) -> list[str]:
    """Greedy completions of ``queries`` (prompts built as in training), in batches with left padding.

    Left padding keeps every prompt's last token at the end of the row, so all rows continue from the same
    position; the attention mask hides the padding. Returns the decoded new text (special tokens removed).
    """
    import torch

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1.")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1.")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError("the tokenizer has neither a pad_token nor an eos_token; set tokenizer.pad_token.")
    device = model.device
    was_training = model.training
    model.eval()
    outputs: list[str] = []
    try:
        for start in range(0, len(queries), batch_size):
            prompts = [encode_prompt(q, tokenizer) for q in queries[start : start + batch_size]]
            width = max(len(p) for p in prompts)
            input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
            attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
            with torch.no_grad():
                generated = model.generate(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=pad_id,
                    eos_token_id=tokenizer.eos_token_id,
                )
            outputs.extend(tokenizer.batch_decode(generated[:, width:], skip_special_tokens=True))
    finally:
        model.train(was_training)
    return outputs


def evaluate_exact_match(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    dataset: Any,
    max_new_tokens: int = 64,
    batch_size: int = 32,
    metric: evaluate.EvaluationModule | None = None,
) -> dict[str, Any]:
    """Exact match of the model's greedy answers on a query/response dataset.

    Returns ``{"exact_match": float, "predictions": list[str]}``; ``metric`` defaults to `load_exact_match()`.
    """
    predictions = generate_responses(model, tokenizer, dataset["query"], max_new_tokens, batch_size)
    metric = metric if metric is not None else load_exact_match()
    score = metric.compute(predictions=predictions, references=list(dataset["response"]))
    return {"exact_match": score["exact_match"], "predictions": predictions}
