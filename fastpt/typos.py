"""What a mistyped name is, and what a sweep's next name is: the rule --resume's guard applies to a
run folder that does not exist (run_folder.typo_of).

A typo is one edit: a letter inserted, deleted or replaced, or two neighbours swapped (Damerau 1964:
most misspellings are one of these four). Names that differ only in their numbers and one-letter
labels are a sweep's runs, not typos: seed1 and seed2, run and run2, run-a and run-b, lr3e-4 and lr1e-3.
"""

from __future__ import annotations

import re

# A number, or a letter standing alone (between non-letters): what a sweep varies between its runs.
LABELS = re.compile(r"\d+|(?<![A-Za-z])[A-Za-z](?![A-Za-z])")


def one_edit_apart(a: str, b: str) -> bool:
    """`a` and `b` differ by one letter inserted, deleted or replaced, or two neighbours swapped."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))  # the first difference
    if len(a) == len(b):
        swapped = a[i : i + 2] == b[i : i + 2][::-1] and a[i + 2 :] == b[i + 2 :]
        return a[i + 1 :] == b[i + 1 :] or swapped
    short, long = sorted((a, b), key=len)
    return short[i:] == long[i + 1 :]


def sweep_siblings(a: str, b: str) -> bool:
    """Two names of one sweep: the same once their numbers and one-letter labels are taken out."""
    return LABELS.sub("", a) == LABELS.sub("", b)


def is_typo(typed: str, existing: str) -> bool:
    """`typed` is `existing` mistyped: one edit apart, and not two runs of a sweep."""
    return one_edit_apart(typed, existing) and not sweep_siblings(typed, existing)
