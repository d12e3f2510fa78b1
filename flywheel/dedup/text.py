"""Normalisation (what an exact duplicate is) and readable shingles: :func:`normalize_text`,
:func:`tokens`, :func:`exact_key`, word :func:`shingles` and :func:`char_shingles`.

The rules are in the :mod:`flywheel.dedup` docstring ("Normalisation"); :mod:`flywheel.dedup.minhash`
hashes the same tokens (:func:`_canon_token` on each distinct raw token) without building strings.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata

DEFAULT_NGRAM = 2

# A number: optional sign, digits with optional thousands separators, optional decimals. The sign
# is taken only when not glued to a word or number ("a-1", "3-4" keep the hyphen as a separator).
# Alternatives in order of frequency: a word starting with a letter (most tokens match here at once),
# a number, a word starting with a digit ("1st", "3d").
_TOKEN = re.compile(
    r"[^\W\d_][^\W_]*"
    r"|(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!\w)|(?<![\w.])[-+]?\.\d+(?!\w)"
    r"|\d[^\W_]*",
    re.UNICODE,
)
_NUM_START = frozenset("0123456789+-.")


def _canon_number(s: str) -> str:
    """``"1,000.50"`` -> ``"1000.5"``, ``"+007"`` -> ``"7"``, ``"-0.0"`` -> ``"0"``."""
    s = s.replace(",", "")
    neg = s.startswith("-")
    s = s.lstrip("+-")
    if "." in s:
        whole, frac = s.split(".", 1)
        frac = frac.rstrip("0")
        whole = whole.lstrip("0") or "0"
        s = f"{whole}.{frac}" if frac else whole
    else:
        s = s.lstrip("0") or "0"
    if neg and s != "0":
        s = "-" + s
    return s


def _fold(s: str) -> str:
    # NFKC is the identity on ASCII and casefold equals lower there (3-5x cheaper on long strings).
    if s.isascii():
        return s.lower()
    return unicodedata.normalize("NFKC", s).casefold()


def _tokens(s: str) -> list[str]:
    s = _fold(s or "")
    toks = _TOKEN.findall(s)
    for i, t in enumerate(toks):
        # Numbers are the tokens that start with a digit, a sign or a dot (words never do: the word
        # alternative is tried last and a word starting with a digit, "1st", fails the number's
        # (?!\w) and is matched as a word -- those are left alone by the isdigit test below).
        if t[0] in _NUM_START and not (t.isdigit() and (len(t) == 1 or t[0] != "0")):
            if t[0].isdigit() and not t.replace(",", "").replace(".", "").isdigit():
                continue  # a word like "1st" or "3d"
            toks[i] = _canon_number(t)
    return toks


def normalize_text(s: str) -> str:
    """The canonical form used by every check (see the module docstring).

    ``"Book  2 tables for 1,000.50 USD!"`` -> ``"book 2 tables for 1000.5 usd"``.
    """
    return " ".join(_tokens(s))


def tokens(s: str) -> list[str]:
    """Tokens of the normalised text (words and canonical numbers)."""
    return _tokens(s)


def exact_key(s: str) -> str:
    """SHA-256 (hex) of the normalised text: equal for exact duplicates up to formatting."""
    return hashlib.sha256(normalize_text(s).encode()).hexdigest()


def shingles(text: str, n: int = DEFAULT_NGRAM) -> set[str]:
    """Word ``n``-grams of the normalised text, joined by one space. A text shorter than ``n``
    tokens is a single shingle; an empty text has no shingles."""
    if n < 1:
        raise ValueError(f"shingle size must be >= 1, got {n}")
    t = tokens(text)
    if not t:
        return set()
    if len(t) <= n:
        return {" ".join(t)}
    return {" ".join(t[i : i + n]) for i in range(len(t) - n + 1)}


def _canon_token(t: str) -> str:
    """A raw regex token in canonical form: numbers canonicalised, words unchanged."""
    if t[0] in _NUM_START and not (t.isdigit() and (len(t) == 1 or t[0] != "0")):
        if t[0].isdigit() and not t.replace(",", "").replace(".", "").isdigit():
            return t  # a word like "1st" or "3d"
        return _canon_number(t)
    return t


def char_shingles(text: str, k: int) -> set[str]:
    """Character ``k``-grams of ``text`` as given; a text of at most ``k`` characters is its own single
    shingle (``""`` included)."""
    if len(text) <= k:
        return {text}
    return {text[i : i + k] for i in range(len(text) - k + 1)}
