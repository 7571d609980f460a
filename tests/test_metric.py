"""The bundled exact-match `evaluate` module loads offline by path; generation-based evaluation is correct."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from lazytrain_hf.data import build_embedded_tokenizer, encode_prompt, load_splits
from lazytrain_hf.metrics import EXACT_MATCH_PATH, evaluate_exact_match, generate_responses, load_exact_match

pytestmark = pytest.mark.usefixtures("evaluate_cache")


@pytest.fixture(scope="module")
def metric():
    return load_exact_match()


def test_loads_offline_by_path_from_the_package(metric, evaluate_cache):
    import evaluate

    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # set by conftest: no Hub access possible
    assert os.path.isfile(EXACT_MATCH_PATH) and EXACT_MATCH_PATH.endswith("lazytrain_hf/metrics/exact_match.py")
    assert isinstance(metric, evaluate.Metric)
    assert type(metric).__name__ == "ExactMatch" and metric.name == "exact_match"
    # evaluate imported its own copy of the file from the temp HF_HOME, not the default cache
    module_file = sys.modules[type(metric).__module__].__file__
    assert module_file.startswith(str(evaluate_cache)), module_file
    assert set(metric.features) == {"predictions", "references"}


def test_exact_match_normalises_answers(metric):
    predictions = [
        "Tom has 23 + 15 = 38 apples.\nThe answer is: 38.0",  # trailing .0
        "The answer is: 1,234",  # thousands separator
        "so the result is \\boxed{\\frac{6}{8}}",  # boxed LaTeX fraction, reduced
        "The answer is: +5",  # leading plus
        "The answer is: 41",  # wrong
        "Tom has 23 + 15 = 38 apples.",  # states no answer
    ]
    references = ["The answer is: 38", "1234", "The answer is: 0.75", "5", "42", "38"]
    result = metric.compute(predictions=predictions, references=references)
    assert result == {"exact_match": pytest.approx(4 / 6)}
    assert metric.compute(predictions=["7"], references=["7.00"]) == {"exact_match": 1.0}
    assert metric.compute(predictions=["The answer is: 3/4"], references=["The answer is: 4/3"]) == {
        "exact_match": 0.0
    }


def test_exact_match_accumulates_batches(metric):
    metric.add_batch(predictions=["The answer is: 1", "The answer is: 2"], references=["1", "3"])
    metric.add_batch(predictions=["The answer is: 4"], references=["4"])
    assert metric.compute() == {"exact_match": pytest.approx(2 / 3)}


def test_exact_match_errors(metric):
    with pytest.raises(ValueError):
        metric.compute(predictions=["1", "2"], references=["1"])


# ------------------------------------------------------------------------------------------------ generation


@pytest.fixture(scope="module")
def tok():
    return build_embedded_tokenizer()


def _tiny_model(tok):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "qwen3", vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config).eval()


def test_left_padded_batches_match_one_by_one_generation(tok):
    model = _tiny_model(tok)
    _, evals = load_splits("embedded", num_train_samples=1, num_eval_samples=5)
    queries = list(evals["query"])
    assert len({len(encode_prompt(q, tok)) for q in queries}) > 1  # prompts of different lengths get padded
    batched = generate_responses(model, tok, queries, max_new_tokens=12, batch_size=5)
    single = [generate_responses(model, tok, [q], max_new_tokens=12, batch_size=1)[0] for q in queries]
    assert batched == single
    assert any(batched)  # an untrained model still emits tokens
    assert not model.training  # left as it was


def test_evaluate_exact_match_scores_real_generations(tok, metric):
    model = _tiny_model(tok)
    _, evals = load_splits("embedded", num_train_samples=1, num_eval_samples=4)
    result = evaluate_exact_match(model, tok, evals, max_new_tokens=8, batch_size=2, metric=metric)
    assert len(result["predictions"]) == 4
    expected = metric.compute(predictions=result["predictions"], references=list(evals["response"]))
    assert result["exact_match"] == expected["exact_match"]
    model.train()
    generate_responses(model, tok, ["x"], max_new_tokens=2)
    assert model.training  # training mode restored


def test_generation_argument_errors(tok):
    model = _tiny_model(tok)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        generate_responses(model, tok, ["q"], max_new_tokens=0)
    with pytest.raises(ValueError, match="batch_size=0"):
        generate_responses(model, tok, ["q"], batch_size=0)
