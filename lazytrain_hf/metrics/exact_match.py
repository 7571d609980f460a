"""Exact match of final answers, as a local `evaluate` module (works offline).

Load it by path, ``evaluate.load(lazytrain_hf.metrics.EXACT_MATCH_PATH)`` or `lazytrain_hf.metrics.load_exact_match`;
``evaluate.load("exact_match")`` would need the Hub. evaluate copies this file under ``HF_HOME`` and imports the copy,
so it imports the normalisation from the installed package rather than relatively.
"""

from __future__ import annotations

import datasets
import evaluate

from lazytrain_hf.data import answer_of

_DESCRIPTION = """
Exact match of final answers. Each prediction and reference is reduced to its answer: the text after the last
"The answer is:" (or the last \\boxed{...}, or "#### X"), or the whole text when it states none (a bare reference
such as "38"). Answers are normalised before comparing: thousands separators, a leading "+", trailing zeros, "$",
\\text{}, "%" and whitespace are dropped, and numbers, decimals and fractions (\\frac{a}{b}, a/b) become a reduced
fraction, so "1,234.0" == "1234" and "\\frac{6}{8}" == "0.75" == "3/4". A prediction that states no answer only
matches when its whole text normalises to the reference answer.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list[str]`): model outputs (full worked solutions or bare answers).
    references (`list[str]`): reference solutions or bare answers.
Returns:
    exact_match (`float`): fraction of predictions whose answer equals the reference's, in [0, 1].
Examples:
    >>> metric = evaluate.load(EXACT_MATCH_PATH)
    >>> metric.compute(predictions=["so 23 + 15 = 38.\\nThe answer is: 38.0"], references=["38"])
    {'exact_match': 1.0}
"""

_CITATION = """
@article{yu2023metamath,
  title={MetaMath: Bootstrap Your Own Mathematical Questions for Large Language Models},
  author={Yu, Longhui and Jiang, Weisen and Shi, Han and Yu, Jincheng and Liu, Zhengying and Zhang, Yu and
          Kwok, James T and Li, Zhenguo and Weller, Adrian and Liu, Weiyang},
  journal={arXiv preprint arXiv:2309.12284},
  year={2023}
}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class ExactMatch(evaluate.Metric):
    """Exact match of extracted, normalised final answers (MetaMathQA's "The answer is: X" convention)."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
            reference_urls=["https://huggingface.co/datasets/meta-math/MetaMathQA"],
        )

    def _compute(self, predictions: list[str], references: list[str]) -> dict[str, float]:
        if len(predictions) == 0:
            raise ValueError("exact_match got no predictions; pass at least one prediction/reference pair.")
        hits = sum(answer_of(p) == answer_of(r) for p, r in zip(predictions, references))
        return {"exact_match": hits / len(predictions)}
