"""DocVQA scoring as the paper runs it: ANLS and final-answer extraction.

ANLS (Average Normalized Levenshtein Similarity, Biten et al. 2019) per question: both strings are
NFKC-folded (full-width / compatibility characters: '１２３' is '123'), lower-cased, every non-alphanumeric character becomes a space and whitespace runs collapse to one space
(stripped); d = Levenshtein(pred, ans) / max(len(pred), len(ans)); the score is 1 - d when d < 0.5, else 0;
the maximum over the accepted answers counts. An answer that normalises to nothing is skipped (it would
accept any punctuation), and a prediction that normalises to nothing scores 0. Thresholded accuracy (ANLS > 0.5) is a diagnostic only.
"""
from __future__ import annotations

import re
import unicodedata

THRESHOLD = 0.5
# the last "Final answer: ..." / "Answer: ..." line (English or full-width colon); markdown bold tolerated
_FINAL = re.compile(r"^[ \t>*#_]*(?:final\s+answer|answer)[ \t*_]*[:：][ \t*_]*(.*?)[ \t*_]*$",
                    re.IGNORECASE | re.MULTILINE)


def normalize(s: str) -> str:
    """NFKC, lower-case, every non-alphanumeric character -> space, whitespace collapsed and stripped."""
    return " ".join("".join(c if c.isalnum() else " " for c in unicodedata.normalize("NFKC", s).lower()).split())


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insert, delete, substitute: cost 1 each), two-row dynamic programme."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def nls(pred: str, answer: str) -> float:
    """One (prediction, answer) pair: 1 - d if d < 0.5 else 0, on normalised strings."""
    p, a = normalize(pred), normalize(answer)
    if not p or not a:
        return 0.0  # nothing to compare: an empty answer is no answer
    d = levenshtein(p, a) / max(len(p), len(a))
    return 1.0 - d if d < THRESHOLD else 0.0


def anls(pred: str | None, answers: list[str]) -> float:
    """The best similarity over the accepted answers (empty ones skipped); 0 for no or an empty prediction."""
    if pred is None or not normalize(pred):
        return 0.0
    return max((nls(pred, a) for a in answers if normalize(a)), default=0.0)


def extract_final_answer(text: str) -> str | None:
    """The content of the last ``Final answer:`` / ``Answer:`` line (``:`` or ``：``), or None."""
    found = _FINAL.findall(text)
    return found[-1].strip() if found else None
