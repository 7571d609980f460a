"""The bundled offline sample (`dataset_name="embedded"`): a deterministic generator of one- and two-digit addition
and subtraction word problems in MetaMathQA's format (worked column by column, then "The answer is: N"), with
disjoint train and eval splits."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    pass

from .schema import ANSWER_PREFIX

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
