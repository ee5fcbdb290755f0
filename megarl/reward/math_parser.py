"""Final-answer extraction and equivalence for GSM8K / MATH-style answers.

Extraction order (the first that finds something wins): the last ``\\boxed{...}``,
the last ``#### ...`` line (GSM8K references), the last ``answer is ...`` phrase,
then the last number anywhere. Numbers may carry thousands separators, a sign (ASCII
or Unicode minus), a decimal part, a ``a/b`` fraction, currency and unit decorations
(``$``, ``%``, ``dollars``, ``^\\circ``); those decorations are dropped.

Equivalence: plain numbers compare exactly as fractions (``3.50 == 7/2``); anything
else (LaTeX fractions, roots, pi, equations) goes to ``math_verify``. math-verify
bounds its own work with ``signal.alarm``, which only works in a main thread; off the
main thread its timeout is disabled here and the caller must bound the call (the
rollout side runs rewards in worker processes, whose tasks run on the main thread).
"""

from __future__ import annotations

import logging
import re
import threading
from fractions import Fraction

logger = logging.getLogger(__name__)

_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\u2013": "-", "\u2012": "-", "\u2014": "-"})
# A number: optional sign (not when it is a binary minus like "5-3"), digits with
# optional thousands groups, optional decimals, optional "/denominator"; or ".5".
_NUMBER = r"(?:(?<![\w)\]}])-\s?)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s?/\s?\d+(?:\.\d+)?)?|(?<![\w.])-?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_PLAIN_NUMBER_RE = re.compile(rf"^\s*(?:{_NUMBER})\s*$")
_HASH_RE = re.compile(r"####\s*(.+)")
# "answer is X" up to the end of its sentence, so later numbers in the text do not win.
_ANSWER_IS_RE = re.compile(r"answer\s*(?:is|:|=)\s*:?\s*(.+?)(?:\.\s|\.?\s*$)", re.IGNORECASE | re.MULTILINE)
_UNIT_WORDS = (
    r"dollars?|cents?|euros?|pounds?|percent|degrees?|hours?|minutes?|seconds?|days?|weeks?|years?"
    r"|months?|miles?|meters?|km|cm|mm|kg|g|lbs?|feet|foot|inches?|units?|people|students?|apples?"
)
_LATEX_DECORATIONS = [
    (re.compile(r"\\(?:text|textbf|mathrm|mbox|textrm)\{([^{}]*)\}"), r"\1"),
    (re.compile(r"\\(?:left|right|displaystyle|,|!|;)"), ""),
    (re.compile(r"\^\s*\{?\\circ\}?"), ""),
    (re.compile(r"\\?%|\\\$|\$"), ""),
    (re.compile(r"\*\*"), ""),
    (re.compile(rf"\b(?:{_UNIT_WORDS})\b\.?", re.IGNORECASE), ""),
]
_LATEX_MATH_RE = re.compile(r"\\(?:frac|dfrac|tfrac|sqrt|pi|cdot|times)|\^|[a-zA-Z]\s*=")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces included."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        rest = text[start + len("\\boxed") :].strip()  # "\boxed 5" form
        return rest.split()[0] if rest else None
    depth = 0
    for i in range(brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1 : i]
    return None  # unbalanced: the model stopped mid-answer


def strip_decorations(answer: str) -> str:
    """Drop currency, percent, unit words, ``\\text{}`` wrappers and trailing punctuation."""
    s = answer.translate(_MINUS_SIGNS)
    for pattern, repl in _LATEX_DECORATIONS:
        s = pattern.sub(repl, s)
    return s.strip().rstrip(".,;:!").strip()


def _canonical_number(s: str) -> str:
    return re.sub(r"[,\s]", "", s)


def _normalize(candidate: str) -> str | None:
    """A candidate answer string → a plain number, a LaTeX expression, or None."""
    s = strip_decorations(candidate)
    if not s:
        return None
    if _PLAIN_NUMBER_RE.match(s):
        return _canonical_number(s)
    if _LATEX_MATH_RE.search(s):
        return s
    numbers = _NUMBER_RE.findall(s)
    return _canonical_number(numbers[-1]) if numbers else None


def extract_answer(text: str, data_name: str | None = None, use_last_number: bool = True) -> str | None:
    """The final answer stated in ``text``, normalised, or None when there is none.

    A ``\\boxed{}``, a ``#### answer`` line or "the answer is ...", else (``use_last_number``) the last
    number in the text. ``data_name`` is AReaL's (its parser's dataset-specific rules); megarl's one parser
    serves every dataset, so calls written for AReaL (``extract_answer(text, "math", use_last_number=True)``)
    run unchanged.
    """
    if not text:
        return None
    text = text.translate(_MINUS_SIGNS)
    boxed = last_boxed(text)
    if boxed is not None:
        return _normalize(boxed)
    for pattern in (_HASH_RE, _ANSWER_IS_RE):
        matches = pattern.findall(text)
        if matches:
            found = _normalize(matches[-1].splitlines()[0] if matches[-1] else "")
            if found is not None:
                return found
    numbers = _NUMBER_RE.findall(text) if use_last_number else []
    return _canonical_number(numbers[-1]) if numbers else None


def to_fraction(s: str) -> Fraction | None:
    """``"1,000.50"``, ``"-3/4"``, ``".5"`` → an exact Fraction; None if not a plain number."""
    s = _canonical_number(s)
    try:
        if "/" in s:
            num, den = s.split("/", 1)
            return Fraction(num) / Fraction(den)
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def math_equal(pred: str, ref: str, timeout: bool = True, timeout_seconds: int | None = 5) -> bool:
    """Whether two extracted answers are mathematically equal.

    Plain numbers compare exactly; other forms go through math-verify with
    ``timeout_seconds`` (ignored off the main thread, where signals cannot be used).
    ``timeout=False`` (AReaL's argument) compares without a time limit.
    """
    if not timeout:
        timeout_seconds = None
    a, b = to_fraction(pred), to_fraction(ref)
    if a is not None and b is not None:
        return a == b
    import math_verify  # heavy import (sympy), only for non-numeric answers

    if threading.current_thread() is not threading.main_thread():
        timeout_seconds = None
    gold = math_verify.parse(f"${ref}$", parsing_timeout=timeout_seconds)
    target = math_verify.parse(f"${pred}$", parsing_timeout=timeout_seconds)
    if not gold or not target:
        return False
    return bool(math_verify.verify(gold, target, timeout_seconds=timeout_seconds))
