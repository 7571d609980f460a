"""Answer extraction and normalisation: the final answer of a MetaMathQA-style response, in a canonical form that
exact match compares (numbers, fractions, LaTeX ``\\boxed{}`` / ``\\frac``, thousands separators)."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    pass


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
