"""Text normalisers. Each is a different identity, not a copy of another: two texts equal under one
may differ under the next, and recorded ids or verdicts depend on which is used.

================================  ===========================================  =====================
function                          rule                                         decides
================================  ===========================================  =====================
:func:`failure_text`              whitespace runs -> one space, trimmed,       failure ids
                                  case-folded (no Unicode normalisation)       (``flywheel.classify``)
:func:`request_words`             NFKC, case-folded, every run of non-          request hashes and the
                                  alphanumerics -> one space, trimmed          split (``flywheel.split``)
:func:`answer_text`               NFKC, case-folded, whitespace collapsed      ``exact`` verdicts
================================  ===========================================  =====================

Two more live with their engines: ``flywheel.dedup.normalize_text`` (tokens, numbers canonicalised:
near-duplicate detection) and ``flywheel.verifiers.matching.standardize_string`` (BFCL's string
comparison).
"""

from __future__ import annotations

import re
import unicodedata

__all__ = ["failure_text", "request_words", "answer_text"]

_NON_ALNUM = re.compile(r"[\W_]+", re.UNICODE)


def failure_text(s: str) -> str:
    """Case-folded, whitespace-collapsed text: the unit of failure identity.

    ``" ".join(s.split())`` equals ``re.sub(r"\\s+", " ", s).strip()`` (both split on
    ``str.isspace`` characters) and is ~3x faster on short strings."""
    return " ".join(s.split()).casefold()


def request_words(text: str) -> str:
    """NFKC, casefold, non-alphanumeric runs -> one space, trimmed.

    ``"Weather in Porto, please!"`` -> ``"weather in porto please"``.
    """
    text = unicodedata.normalize("NFKC", text).casefold()
    return _NON_ALNUM.sub(" ", text).strip()


def answer_text(s: str) -> str:
    """Unicode NFKC, case-folded, whitespace collapsed: how an ``exact`` verifier compares answers."""
    return " ".join(unicodedata.normalize("NFKC", s).casefold().split())
