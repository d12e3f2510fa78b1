"""Input -> expected-output tests: the recogniser, the trusted checks, the result codec.

The central property is differential: for every test source in the subset, the io path (driver in a
separate process -> serialised results -> checks in this process) gives each test the same pass/fail
as running the tests in-process with pytest semantics, for honest and for wrong solutions.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flywheel.io_grading import NotIO, compile_io, decode_value
from flywheel.sandbox import discover_tests

HARNESS = Path(__file__).resolve().parents[2] / "flywheel" / "sandbox" / "_harness_codec.py"


def _harness():
    spec = importlib.util.spec_from_file_location("harness_under_test", HARNESS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ENCODE, UNENCODABLE = _harness()._encoder()


def run_driver(tmp_path: Path, solution: str, tests: str) -> dict[str, str]:
    """The io path without namespaces: the real driver in a subprocess, judged here."""
    plan = compile_io(tests)
    work = tmp_path / f"w{abs(hash(solution + tests))}"
    work.mkdir()
    (work / "solution.py").write_text(solution)
    setup = {"workdir": str(work), **plan.driver_setup()}
    r_fd, w_fd = os.pipe()
    code = (
        "import sys, marshal; sys.path.insert(0, sys.argv[1]); import _sandbox_harness as h; "
        "h._worker_io(marshal.loads(sys.stdin.buffer.read()), int(sys.argv[2]))"
    )
    import marshal

    proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", code, str(HARNESS.parent), str(w_fd)],
                            stdin=subprocess.PIPE, pass_fds=(w_fd,), cwd=work)
    os.close(w_fd)
    proc.communicate(marshal.dumps(setup, 4), timeout=60)
    raw = b""
    while chunk := os.read(r_fd, 1 << 16):
        raw += chunk
    os.close(r_fd)
    from flywheel.sandbox import _judge_io

    per_test, integrity = _judge_io(plan, raw.decode(), None)
    assert integrity == [], integrity
    return per_test


def run_in_process(solution: str, tests: str) -> dict[str, str]:
    """The reference: the same tests run the ordinary way (pytest semantics for pytest.raises)."""
    names = discover_tests(tests)
    mod = types.ModuleType("solution")
    old = sys.modules.get("solution")
    sys.modules["solution"] = mod
    try:
        ns: dict = {"__name__": "tests"}
        try:
            exec(compile(solution, "solution.py", "exec"), mod.__dict__)
            exec(compile(tests, "tests.py", "exec"), ns)
        except BaseException as e:  # noqa: BLE001 - the test module does not load: every test fails
            return {n: f"failed: {type(e).__name__}" for n in names}
        out = {}
        for name in names:
            cls, _, meth = name.partition(".")
            try:
                getattr(ns[cls](), meth)() if meth else ns[cls]()
                out[name] = "passed"
            except BaseException as e:  # noqa: BLE001
                out[name] = f"failed: {type(e).__name__}"
        return out
    finally:
        if old is None:
            sys.modules.pop("solution", None)
        else:
            sys.modules["solution"] = old


CASES = [
    (  # plain equality, keyword arguments, module alias, constants
        """
        import solution
        from solution import add
        WANT = 5

        def test_eq():
            assert add(2, 3) == WANT

        def test_kw():
            assert add(a=-4, b=1) == -3
            assert solution.add(0, 0) == 0
        """,
        ["def add(a, b):\n    return a + b\n", "def add(a, b):\n    return a - b\n", "def add(a, b):\n    return 5\n"],
    ),
    (  # container types: tuple != list, sets, dicts with tuple keys, bytes, nested
        """
        from solution import f

        def test_tuple():
            assert f('t') == (1, 2)

        def test_set_dict():
            assert f('s') == {1, 2}
            assert f('d') == {(1, 'a'): [b'x', None]}

        def test_len_sorted_index():
            r = f('l')
            assert len(r) == 3 and sorted(r) == [1, 2, 3] and r[0] == 3
        """,
        [
            "def f(k):\n    return {'t': (1, 2), 's': {2, 1}, 'd': {(1, 'a'): [b'x', None]}, 'l': [3, 1, 2]}[k]\n",
            "def f(k):\n    return {'t': [1, 2], 's': frozenset({1, 2}), 'd': {(1, 'a'): [b'x']}, 'l': [1, 2, 3]}[k]\n",
        ],
    ),
    (  # numbers: 0.1 + 0.2, isclose, bool == int, type checks, nan, huge ints, complex
        """
        import math
        from solution import g

        def test_float_exact():
            assert g('f') == 0.3

        def test_close():
            assert math.isclose(g('f'), 0.3) and abs(g('f') - 0.3) < 1e-9

        def test_types():
            r = g('i')
            assert type(r) is int and r == 1
            assert g('b') == 1 and isinstance(g('b'), int)

        def test_specials():
            assert math.isnan(g('nan'))
            assert g('big') % 1000 == 1 and g('big') > 10**6
            assert g('c') == 1 + 2j
        """,
        [
            "def g(k):\n    return {'f': 0.1 + 0.2, 'i': 1, 'b': True, 'nan': float('nan'), 'big': 10**5000 + 1, 'c': 1+2j}[k]\n",
            "def g(k):\n    return {'f': 0.3, 'i': 1.0, 'b': 1, 'nan': 0.0, 'big': 3, 'c': 1j}[k]\n",
        ],
    ),
    (  # is None / True, not, or, !=, in, strings with escapes and surrogates
        """
        from solution import h

        def test_identity():
            assert h(None) is None
            assert h(1) is True
            assert not h(0)

        def test_strings():
            assert h('s') == 'é "q" \\n \\ud800 😀'
            assert 'q' in h('s') and h('s') != ''
            assert h('x') == 1 or h('y') == 2
        """,
        [
            "def h(x):\n    return {None: None, 1: True, 0: 0, 's': 'é \"q\" \\n \\ud800 😀', 'x': 0, 'y': 2}[x]\n",
            "def h(x):\n    return {None: 0, 1: 1, 0: [], 's': 'e', 'x': 0, 'y': 3}[x]\n",
        ],
    ),
    (  # exceptions: pytest.raises with classes, tuples and match; an unexpected raise fails
        """
        import pytest
        from solution import div

        def test_raises():
            with pytest.raises(ZeroDivisionError):
                div(1, 0)
            with pytest.raises((TypeError, ValueError), match="bad"):
                div("bad", 1)

        def test_no_raise():
            assert div(6, 3) == 2
        """,
        [
            "def div(a, b):\n    if isinstance(a, str):\n        raise ValueError('bad input')\n    return a // b\n",
            "def div(a, b):\n    if isinstance(a, str):\n        raise KeyError('bad')\n    return a / b if b else 0\n",
            "def div(a, b):\n    raise ArithmeticError('x')\n",
        ],
    ),
    (  # state across calls, in source order; a class of tests; an unused result of any type
        """
        from solution import tick, make

        class TestTicks:
            def test_first(self):
                assert tick() == 1

            def test_second(self):
                make()
                x = make()
                assert tick() == 2
        """,
        [
            "n = 0\ndef tick():\n    global n\n    n += 1\n    return n\ndef make():\n    return object()\n",
            "def tick():\n    return 1\ndef make():\n    return object()\n",
        ],
    ),
    (  # import failures: a missing name, a candidate that raises at import
        """
        from solution import missing, present

        def test_a():
            assert present() == 1
        """,
        ["def present():\n    return 1\n", "raise RuntimeError('boom')\n"],
    ),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_io_path_agrees_with_running_the_tests_in_process(case, tmp_path):
    tests, solutions = CASES[case]
    tests = textwrap.dedent(tests)
    for sol in solutions:
        truth = run_in_process(sol, tests)
        got = run_driver(tmp_path, sol, tests)
        assert {k: v == "passed" for k, v in got.items()} == {k: v == "passed" for k, v in truth.items()}, (
            sol, got, truth)


def test_import_failures_fail_every_test(tmp_path):
    tests, (missing_name, raising) = CASES[-1]
    tests = textwrap.dedent(tests)
    r = run_driver(tmp_path, missing_name, tests)
    assert r == {"test_a": "failed: importing solution failed: ImportError: cannot import name 'missing' from 'solution'"}
    r = run_driver(tmp_path, raising, tests)
    assert r["test_a"].startswith("failed: importing solution failed: RuntimeError: boom")


def test_results_that_are_not_plain_data_fail_the_checks_that_use_them(tmp_path):
    tests = "from solution import f\n\ndef test_a():\n    assert f() == 5\n\ndef test_b():\n    assert f() != 5\n"
    always_equal = (
        "class Any(int):\n    def __eq__(self, o):\n        return True\n    def __ne__(self, o):\n"
        "        return False\n    __hash__ = int.__hash__\ndef f():\n    return Any(5)\n"
    )
    r = run_driver(tmp_path, always_equal, tests)
    assert r["test_a"].startswith("failed: TypeError: the result of f() cannot be compared: a Any is not plain data")
    assert r["test_b"].startswith("failed")  # never "passes by being unequal to everything"
    gen = run_driver(tmp_path, "def f():\n    return (x for x in [5])\n", tests)
    assert all(v.startswith("failed") for v in gen.values())


@pytest.mark.parametrize(
    "src, why",
    [
        ("from solution import f\ndef test_a():\n    for i in range(3):\n        assert f(i)\n", "For statement"),
        ("from solution import f\ndef helper():\n    pass\ndef test_a():\n    assert f(1) == 1\n", "FunctionDef at module level"),
        ("from solution import f\ndef test_a():\n    x = f(1)\n    assert f(x) == 2\n", "passed back into a call"),
        ("from solution import *\ndef test_a():\n    assert f(1) == 1\n", "import *"),
        ("import os\nfrom solution import f\ndef test_a():\n    assert f(1) == 1\n", "imports 'os'"),
        ("from solution import f\nimport unittest\nclass TestA(unittest.TestCase):\n    def test_a(self):\n"
         "        self.assertEqual(f(1), 1)\n", "imports 'unittest'"),
        ("from solution import f\ndef test_a():\n    assert f(1) is 5\n", "'is' compares"),
        ("from solution import f\ndef test_a():\n    assert f(1).upper() == 'A'\n", "call of"),
        ("from solution import f\ndef test_a():\n    assert f(1) ** 2 == 4\n", r"\*\* on a result"),
        ("from solution import f\ndef test_a(tmp_path):\n    assert f(1) == 1\n", "takes parameters"),
        ("def test_a():\n    assert 1 == 1\n", "call nothing from solution"),
    ],
)
def test_sources_outside_the_subset_name_the_first_reason(src, why):
    with pytest.raises(NotIO, match=why):
        compile_io(src)


def test_plan_keeps_expected_values_out_of_what_the_sandbox_receives():
    plan = compile_io("from solution import slugify\nWANT = 'hello-world-7f3a'\n\n"
                      "def test_a():\n    assert slugify('Hello World') == WANT\n")
    sent = repr(plan.driver_setup())
    assert "Hello World" in sent and "7f3a" not in sent and "test_a" not in sent
    assert plan.names == discover_tests(
        "from solution import slugify\nWANT = 'x'\n\ndef test_a():\n    assert slugify('Hello World') == WANT\n")


def _plain():
    scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text() | st.binary() \
        | st.complex_numbers(allow_nan=False)
    hashable = st.none() | st.booleans() | st.integers() | st.text() | st.binary()
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
        | st.dictionaries(hashable, inner, max_size=4) | st.sets(hashable, max_size=4)
        | st.frozensets(hashable, max_size=4),
        max_leaves=20,
    )


def _same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@settings(max_examples=300, deadline=None)
@given(_plain())
def test_codec_round_trips_plain_data_exactly(value):
    assert _same(decode_value(ENCODE(value)), value)


@pytest.mark.parametrize("text", [
    "1.5", "NaN", '{"f": "1e400x"}', '{"x": 1}', '{"s": [[1]]}', '{"d": [[[1], 2]]}', '{"t": 3}',
    '{"c": [1, 2]}', '{"b": "zz"}', '{"f": "1", "b": ""}', "[" * 100 + "]" * 100, '"' + "a" * (1 << 20) + '"',
    "1" * 5000,
])
def test_decoder_refuses_what_an_honest_driver_never_writes(text):
    with pytest.raises(ValueError):
        decode_value(text)


def test_encoder_refuses_non_plain_and_oversized_values():
    for bad in (object(), [object()], {1: type}, 1 << 9_000_000, ["x" * (1 << 20)], True.__class__.__mro__):
        with pytest.raises(UNENCODABLE):
            ENCODE(bad)
    deep: list = []
    for _ in range(100):
        deep = [deep]
    with pytest.raises(UNENCODABLE):
        ENCODE(deep)
    assert decode_value(ENCODE(10**4000)) == 10**4000  # hex-tagged: no 4300-digit limit
