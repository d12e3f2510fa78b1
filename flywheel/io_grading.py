"""Input -> expected-output tests: recognised in pytest-style source, judged outside the sandbox.

Most tests of a generated solution call a function with literal arguments and compare the result
with a literal (``assert slugify('Hello World') == 'hello-world'``: the shape of the ``outcome.tests``
that production traces carry, and of EvalPlus/MBPP-style suites). For those, nothing that decides the
verdict has to enter the candidate's process: :func:`compile_io` turns the test source into a
:class:`IOPlan` -- the calls to make (function name + literal arguments) and, kept back in the
trusted supervisor, the checks to apply to what comes back. The sandbox receives only the calls; a
driver imports the candidate, makes each call once, in source order, and writes the serialised
result (or the exception) to a channel; :meth:`IOPlan.judge` decodes those results into plain data
in the supervisor and evaluates every check there. The candidate never sees an expected value, a test
name, a nonce or the check code, so it cannot forge a pass; the best it can do is return the right
outputs.

Evals need no separate format: the test source stays the eval's contract (``python_tests`` spec
``tests``), and the supervisor decides per run. :func:`compile_io` either returns a plan or raises
:class:`NotIO` with the first construct outside the subset below; the sandbox then runs the tests
in a process of their own against a proxy of the candidate (``grading: proxy``, see
:mod:`flywheel.sandbox`), and the verdict says
which path graded it.

The recognised subset (anything else -> :class:`NotIO`)
-------------------------------------------------------
Module level: a docstring; ``from solution import f[ as g], ...``; ``import solution[ as s]``;
``import math``; ``import pytest``; ``NAME = <literal>`` constants; test functions ``def test*():``
(no parameters, no decorators); classes ``class Test*:`` with no bases or decorators whose body is a
docstring and ``def test*(self):`` methods.

Test bodies, statement by statement:

- ``x = <call>`` or ``x = <literal>``;
- ``assert <check>[, <message>]`` (the message is shown, never evaluated);
- a bare ``<call>`` (its exception fails the test);
- ``with pytest.raises(Exc | (Exc, ...)[, match=<str>]): <call>`` (or ``x = <call>``);
- ``pass`` and docstrings.

``<call>`` is ``f(...)`` or ``solution.f(...)`` where ``f`` comes from ``solution`` and every argument
is a literal (``ast.literal_eval``: numbers, strings, bytes, tuples, lists, dicts, sets, None, booleans)
or a name bound to one. ``<check>`` combines calls, bound names and literals with comparisons (``==
!= < <= > >= in not in``, ``is``/``is not`` against None/True/False or a type), ``and``/``or``/``not``,
``+ - * / // %``, unary ``-``, subscripts with a literal index, ``len abs round sorted min max sum any
all set frozenset list tuple str int float bool isinstance type`` on those values, the built-in type
names, and ``math.isclose``/``isnan``/``isinf``/``pi``/``e``/``inf``/``nan``.

Semantics, and where they differ from running the tests in-process
------------------------------------------------------------------
- Results travel as plain data of *exact* built-in types: None, bool, int, float, complex, str, bytes,
  and list/tuple/dict/set/frozenset of those (at most 64 levels deep, 1 MiB serialised per call). A
  result of any other type (a subclass of int, an object with its own ``__eq__``, a numpy scalar, a
  generator) cannot be compared and fails the check that uses it, where in-process it would run that
  type's own ``__eq__``. This is the point: ``class Any: __eq__ = lambda *a: True`` cannot pass.
- A set, frozenset or dict key set (decoded, or built by ``set``/``frozenset`` in a check) with more
  than 32 distinct items of one hash is refused as crafted: integers that are multiples of
  ``2**61 - 1`` all hash alike and would make building it quadratic in this process.
- Checks run on the decoded values with Python's own operators, so ``5 == 5.0`` and ``(1, 2) != [1,
  2]`` behave as in the tests.
- Every call of every test runs, once, in source order, in one process -- also the calls after a
  check that failed (in-process, a failed assert skips the rest of its test). State a solution keeps
  between calls is therefore seen in the same order, but a later call may observe an earlier call
  whose result a failed test never looked at.
- ``pytest.raises(E)`` passes when the call raised an exception whose class or any base class is
  *named* ``E`` (the driver reports the names of the exception's MRO) and, with ``match``, when
  ``re.search(match, str(exception))`` finds it.
- Import failures of ``solution`` (or a name missing from it) fail every test, as a failed module import
  of the test file would.
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["NotIO", "IOPlan", "IOCall", "compile_io", "decode_value", "MAX_RESULT_BYTES", "MAX_DEPTH"]

#: Serialised bytes of one call's result the supervisor accepts (the driver refuses larger ones).
MAX_RESULT_BYTES = 1 << 20
#: Nesting depth of a result (lists of lists ...); deeper results are refused by the driver.
MAX_DEPTH = 64
# Largest sequence a trusted ``*`` may build from candidate data (characters or items).
_MAX_PRODUCT = 10_000_000
# Largest integer operand of trusted arithmetic (division of two such numbers takes ~10 ms).
_MAX_INT_BITS = 100_000

# Distinct values sharing one hash that a set or dict built from candidate data may hold. CPython
# hashes ints modulo 2**61 - 1 (tuples, frozensets and floats from their values) without a secret,
# so a candidate can make every item of a result collide, and building n of them costs ~n**2/2
# comparisons in this process, outside every sandbox limit (8,000 took 0.46 s; 20,000 several
# seconds: issue 31, finding 7). Honest data has a handful per hash at most (-1 and -2 share one).
_MAX_SAME_HASH = 32


def _bounded_set(items: Any, kind: type = set) -> set | frozenset:
    """``set(items)`` (or ``frozenset``), refusing more than ``_MAX_SAME_HASH`` distinct items of one
    hash: each insertion then compares with at most that many, so the build is linear."""
    out: set = set()
    add, seen = out.add, {}
    for x in items:
        n = len(out)
        h = hash(x)
        add(x)
        if len(out) != n:
            c = seen.get(h, 0) + 1
            if c > _MAX_SAME_HASH:
                raise ValueError(f"more than {_MAX_SAME_HASH} distinct items collide on one hash (a crafted result)")
            seen[h] = c
    return out if kind is set else frozenset(out)


def _bounded_frozenset(items: Any = ()) -> frozenset:
    return _bounded_set(items, frozenset)  # type: ignore[return-value]


_HELPERS: dict[str, Any] = {
    "len": len, "abs": abs, "round": round, "sorted": sorted, "min": min, "max": max, "sum": sum,
    "any": any, "all": all, "set": _bounded_set, "frozenset": _bounded_frozenset, "list": list, "tuple": tuple, "str": str,
    "int": int, "float": float, "bool": bool, "isinstance": isinstance, "type": type,
}
_TYPES: dict[str, type] = {
    "int": int, "float": float, "str": str, "bool": bool, "list": list, "tuple": tuple, "dict": dict,
    "set": set, "frozenset": frozenset, "bytes": bytes, "complex": complex,
}
_MATH_FUNCS = {"isclose": math.isclose, "isnan": math.isnan, "isinf": math.isinf}
_MATH_CONSTS = {"pi": math.pi, "e": math.e, "inf": math.inf, "nan": math.nan}
_CMP = {
    ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b, ast.Lt: lambda a, b: a < b,
    ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b,
    ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
    ast.Is: lambda a, b: a is b, ast.IsNot: lambda a, b: a is not b,
}
_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod)


class NotIO(ValueError):
    """The test source is not (entirely) input -> expected-output checks; the message says where."""


@dataclass(frozen=True)
class IOCall:
    """One call the sandbox makes: ``solution.<func>(*args, **kwargs)``.

    ``bound``: the function was bound by ``from solution import`` (looked up once, right after the
    import, as the test module would) rather than looked up on the module at call time.
    """

    func: str
    args: tuple
    kwargs: dict
    bound: bool
    source: str


@dataclass
class _Ctx:
    """Per-test evaluation state in the supervisor."""

    results: list[tuple[str, Any]]
    env: dict[str, Any] = field(default_factory=dict)


class _Raised(Exception):
    """A call made by a check raised in the sandbox: the test fails with the candidate's exception."""

    def __init__(self, detail: str):
        super().__init__(detail)
        self.detail = detail


@dataclass
class IOPlan:
    """What to call in the sandbox and, kept here, how to judge what comes back."""

    names: list[str]
    calls: list[IOCall]
    imports: list[str]
    _tests: list[list[tuple]] = field(repr=False)
    _consts: dict[str, Any] = field(repr=False)

    def driver_setup(self) -> dict:
        """The part of the plan the sandbox receives: imports and calls only (plain data)."""
        return {
            "imports": list(self.imports),
            "calls": [(c.func, tuple(c.args), dict(c.kwargs), c.bound) for c in self.calls],
        }

    def judge(self, load_error: str | None, results: dict[int, tuple[str, Any]]) -> dict[str, str]:
        """Per-test outcome (``"passed"`` or ``"failed: <why>"``) from the decoded call results.

        ``results[i]`` is ``("ok", value)``, ``("raise", (mro_names, message))`` or ``("bad",
        reason)``; a missing index means the call never answered (timeout, crash)."""
        out: dict[str, str] = {}
        for name, steps in zip(self.names, self._tests, strict=True):
            if load_error is not None:
                out[name] = "failed: importing solution failed: " + load_error
                continue
            ctx = _Ctx(results=[results.get(i, ("missing", None)) for i in range(len(self.calls))])
            ctx.env.update(self._consts)
            out[name] = _run_steps(steps, ctx)
        return out


def _run_steps(steps: list[tuple], ctx: _Ctx) -> str:
    for step in steps:
        kind = step[0]
        try:
            if kind == "assign":
                node = step[2]
                # A result nobody compares may be of any type (as in-process); using it fails later.
                ctx.env[step[1]] = _unused_ok(node, ctx) if isinstance(node, _CallRef) else _eval(node, ctx)
            elif kind == "call":
                _unused_ok(step[1], ctx)
            elif kind == "assert":
                _, node, text = step
                if not _eval(node, ctx):
                    return f"failed: AssertionError: assert {text}"
            elif kind == "raises":
                _, names, match, call_index, text = step
                status, payload = ctx.results[call_index]
                if status in ("ok", "bad"):
                    return f"failed: Failed: DID NOT RAISE {' or '.join(names)} ({text})"
                if status != "raise":
                    return f"failed: {_describe_missing(status, payload, text)}"
                mro, message = payload
                if not any(n in mro for n in names):
                    return f"failed: {mro[0] if mro else 'exception'}: {message} (expected {' or '.join(names)})"
                if match is not None and re.search(match, message) is None:
                    return f"failed: AssertionError: regex {match!r} does not match {message!r}"
        except _Raised as e:
            return "failed: " + e.detail
        except RecursionError:
            return "failed: RecursionError while checking the result"
        except Exception as e:  # noqa: BLE001 - a check that errors fails, as it would in-process
            return f"failed: {type(e).__name__}: {e}"[:500]
    return "passed"


class _Uncomparable:
    """The value of a call whose result could not be serialised; any use of it fails the check."""

    def __init__(self, detail: str):
        self.detail = detail


def _unused_ok(ref: _CallRef, ctx: _Ctx) -> Any:
    status, payload = ctx.results[ref.index]
    if status == "bad":
        return _Uncomparable(_describe_missing(status, payload, ref.text))
    return _eval(ref, ctx)


def _describe_missing(status: str, payload: Any, text: str) -> str:
    if status == "bad":
        return f"TypeError: the result of {text} cannot be compared: {payload}"
    return f"no result for {text} (the candidate's process ended or timed out first)"


def _eval(node: ast.AST, ctx: _Ctx) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, _CallRef):
        status, payload = ctx.results[node.index]
        if status == "ok":
            return payload
        if status == "raise":
            mro, message = payload
            raise _Raised(f"{mro[0] if mro else 'exception'}: {message}")
        raise _Raised(_describe_missing(status, payload, node.text))
    if isinstance(node, _Literal):
        return _copy(node.value)
    if isinstance(node, ast.Name):
        if node.id in ctx.env:
            v = ctx.env[node.id]
            if isinstance(v, _Uncomparable):
                raise _Raised(v.detail)
            return v
        if node.id in _TYPES:
            return _TYPES[node.id]
        raise NameError(f"name {node.id!r} is not defined")
    if isinstance(node, ast.Attribute):  # math.<const> (validated at compile time)
        return _MATH_CONSTS[node.attr]
    if isinstance(node, ast.Compare):
        left = _eval(node.left, ctx)
        for op, comp in zip(node.ops, node.comparators, strict=True):
            right = _eval(comp, ctx)
            if not _CMP[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.BoolOp):
        if isinstance(node.op, ast.And):
            v: Any = True
            for x in node.values:
                v = _eval(x, ctx)
                if not v:
                    return v
            return v
        v = False
        for x in node.values:
            v = _eval(x, ctx)
            if v:
                return v
        return v
    if isinstance(node, ast.UnaryOp):
        v = _eval(node.operand, ctx)
        if isinstance(node.op, ast.Not):
            return not v
        if isinstance(node.op, ast.USub):
            return -v
        return +v
    if isinstance(node, ast.BinOp):
        a, b = _eval(node.left, ctx), _eval(node.right, ctx)
        op = node.op
        # The operands may come from the candidate: no operation whose cost it controls without
        # bound (quadratic division of huge ints, '%0999999999d' % x formatting a gigabyte).
        for v in (a, b):
            if isinstance(v, int) and v.bit_length() > _MAX_INT_BITS:
                raise OverflowError("number too large to check")
        if isinstance(op, ast.Mod) and isinstance(a, str | bytes):
            raise TypeError("string formatting is not a check")
        if isinstance(op, ast.Add):
            return a + b
        if isinstance(op, ast.Sub):
            return a - b
        if isinstance(op, ast.Mult):
            for seq, n in ((a, b), (b, a)):
                if isinstance(seq, str | bytes | list | tuple) and isinstance(n, int) and len(seq) * n > _MAX_PRODUCT:
                    raise MemoryError("product too large to check")
            return a * b
        if isinstance(op, ast.Div):
            return a / b
        if isinstance(op, ast.FloorDiv):
            return a // b
        return a % b
    if isinstance(node, ast.Subscript):
        return _eval(node.value, ctx)[_eval(node.slice, ctx)]
    if isinstance(node, ast.Call):
        args = [_eval(a, ctx) for a in node.args]
        kwargs = {k.arg: _eval(k.value, ctx) for k in node.keywords}
        if isinstance(node.func, ast.Attribute):
            return _MATH_FUNCS[node.func.attr](*args, **kwargs)
        return _HELPERS[node.func.id](*args, **kwargs)
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        items = [_eval(e, ctx) for e in node.elts]
        return tuple(items) if isinstance(node, ast.Tuple) else (items if isinstance(node, ast.List) else set(items))
    raise NotIO(f"cannot evaluate {type(node).__name__}")  # unreachable: compile_io validated the tree


def _copy(v: Any) -> Any:
    # Literals are shared by every test of a plan; checks never mutate, but copy containers anyway.
    if isinstance(v, list):
        return [_copy(x) for x in v]
    if isinstance(v, dict):
        return {k: _copy(x) for k, x in v.items()}
    if isinstance(v, set):
        return set(v)
    return v


class _CallRef(ast.expr):
    """A solution call inside a check, replaced by the index of its result."""

    _fields = ()

    def __init__(self, index: int, text: str):
        super().__init__()
        self.index = index
        self.text = text


class _Literal(ast.expr):
    """A literal folded at compile time (``[1, 2]``, ``-3``, ``{'a': (1, 2)}``)."""

    _fields = ()

    def __init__(self, value: Any):
        super().__init__()
        self.value = value


# ----------------------------------------------------------------------------------------- compiler


class _Compiler:
    def __init__(self, source: str):
        self.source = source
        self.bound: dict[str, str] = {}  # local name -> solution attribute (from-import)
        self.module_aliases: set[str] = set()
        self.helper_modules: set[str] = set()
        self.consts: dict[str, Any] = {}
        self.calls: list[IOCall] = []
        self.names: list[str] = []
        self.tests: list[list[tuple]] = []

    def fail(self, node: ast.AST, why: str) -> NotIO:
        return NotIO(f"line {getattr(node, 'lineno', '?')}: {why}")

    def text(self, node: ast.AST) -> str:
        return (ast.get_source_segment(self.source, node) or ast.unparse(node))[:200]

    def module(self, tree: ast.Module) -> None:
        body = tree.body
        if body and _is_docstring(body[0]):
            body = body[1:]
        for node in body:  # imports and constants first: names may be used above their binding
            if isinstance(node, ast.ImportFrom):
                if node.module != "solution" or node.level:
                    raise self.fail(node, f"imports from {node.module!r}, not from solution")
                for a in node.names:
                    if a.name == "*":
                        raise self.fail(node, "from solution import * hides which names are used")
                    self.bound[a.asname or a.name] = a.name
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "solution":
                        self.module_aliases.add(a.asname or "solution")
                    elif a.name in ("math", "pytest") and a.asname is None:
                        self.helper_modules.add(a.name)
                    else:
                        raise self.fail(node, f"imports {a.name!r}")
            elif isinstance(node, ast.Assign):
                if len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name):
                    raise self.fail(node, "module-level assignment is not NAME = <literal>")
                self.consts[node.targets[0].id] = self.literal(node.value, {})
        for node in body:
            if isinstance(node, ast.ImportFrom | ast.Import | ast.Assign):
                continue
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
                self.function(node, node.name, self_arg=False)
            elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                if node.bases or node.keywords or node.decorator_list:
                    raise self.fail(node, f"class {node.name} has bases or decorators")
                cbody = node.body[1:] if node.body and _is_docstring(node.body[0]) else node.body
                for item in cbody:
                    if not (isinstance(item, ast.FunctionDef) and item.name.startswith("test")):
                        raise self.fail(item, f"class {node.name} holds more than test methods")
                    self.function(item, f"{node.name}.{item.name}", self_arg=True)
            else:
                raise self.fail(node, f"{type(node).__name__} at module level")
        if not self.names:
            raise NotIO("no test functions")
        if not self.calls:
            raise NotIO("the tests call nothing from solution")

    def function(self, fn: ast.FunctionDef, name: str, *, self_arg: bool) -> None:
        a = fn.args
        params = [p.arg for p in a.posonlyargs + a.args]
        if fn.decorator_list or a.vararg or a.kwarg or a.kwonlyargs or a.defaults or params != (["self"] if self_arg else []):
            raise self.fail(fn, f"{name} takes parameters or has decorators")
        env: dict[str, str] = {}  # name -> "literal" | "observed"
        literals: dict[str, Any] = {}
        steps: list[tuple] = []
        body = fn.body[1:] if fn.body and _is_docstring(fn.body[0]) else fn.body
        for st in body:
            if isinstance(st, ast.Pass):
                continue
            if isinstance(st, ast.Assign):
                if len(st.targets) != 1 or not isinstance(st.targets[0], ast.Name):
                    raise self.fail(st, "assignment is not NAME = <value>")
                var = st.targets[0].id
                if self.is_call(st.value):
                    steps.append(("assign", var, self.call(st.value, env, literals)))
                    env[var] = "observed"
                    literals.pop(var, None)
                else:
                    literals[var] = self.literal(st.value, literals)
                    steps.append(("assign", var, _Literal(literals[var])))
                    env[var] = "literal"
            elif isinstance(st, ast.Assert):
                steps.append(("assert", self.check(st.test, env, literals), self.text(st.test)))
            elif isinstance(st, ast.Expr) and self.is_call(st.value):
                steps.append(("call", self.call(st.value, env, literals)))
            elif isinstance(st, ast.With):
                steps.append(self.raises(st, env, literals))
            else:
                raise self.fail(st, f"{type(st).__name__} statement in {name}")
        self.names.append(name)
        self.tests.append(steps)

    def raises(self, st: ast.With, env: dict, literals: dict) -> tuple:
        if len(st.items) != 1 or st.items[0].optional_vars is not None or "pytest" not in self.helper_modules:
            raise self.fail(st, "with-statement other than pytest.raises(...)")
        cm = st.items[0].context_expr
        if not (isinstance(cm, ast.Call) and isinstance(cm.func, ast.Attribute) and cm.func.attr == "raises"
                and isinstance(cm.func.value, ast.Name) and cm.func.value.id == "pytest" and len(cm.args) == 1):
            raise self.fail(st, "with-statement other than pytest.raises(...)")
        exc = cm.args[0]
        elts = exc.elts if isinstance(exc, ast.Tuple) else [exc]
        names = []
        for e in elts:
            if isinstance(e, ast.Name):
                names.append(self.bound.get(e.id, e.id))
            elif isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id in self.module_aliases:
                names.append(e.attr)
            else:
                raise self.fail(e, "pytest.raises needs exception class names")
        match = None
        for kw in cm.keywords:
            if kw.arg != "match":
                raise self.fail(kw, f"pytest.raises({kw.arg}=...) is not supported")
            match = self.literal(kw.value, literals)
            if not isinstance(match, str):
                raise self.fail(kw, "pytest.raises(match=...) must be a string")
            re.compile(match)
        if len(st.body) != 1:
            raise self.fail(st, "pytest.raises block must hold exactly one call")
        inner = st.body[0]
        value = inner.value if isinstance(inner, ast.Expr | ast.Assign) else None
        if value is None or not self.is_call(value) or (isinstance(inner, ast.Assign) and len(inner.targets) != 1):
            raise self.fail(inner, "pytest.raises block must hold exactly one call")
        ref = self.call(value, env, literals)
        return ("raises", names, match, ref.index, self.text(value))

    def is_call(self, node: ast.AST) -> bool:
        if not isinstance(node, ast.Call):
            return False
        f = node.func
        if isinstance(f, ast.Name):
            return f.id in self.bound
        return isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in self.module_aliases

    def call(self, node: ast.Call, env: dict, literals: dict) -> _CallRef:
        f = node.func
        if isinstance(f, ast.Name):
            func, bound = self.bound[f.id], True
        else:
            func, bound = f.attr, False
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            raise self.fail(node, "*args/**kwargs in a call")
        args = tuple(self.literal(a, literals, env) for a in node.args)
        kwargs = {k.arg: self.literal(k.value, literals, env) for k in node.keywords}
        text = self.text(node)
        self.calls.append(IOCall(func, args, kwargs, bound, text))
        return _CallRef(len(self.calls) - 1, text)

    def literal(self, node: ast.AST, literals: dict, env: dict | None = None) -> Any:
        if isinstance(node, ast.Name):
            if node.id in literals:
                return _copy(literals[node.id])
            if node.id in self.consts:
                return _copy(self.consts[node.id])
            if env is not None and env.get(node.id) == "observed":
                raise self.fail(node, f"{node.id!r} (a result) is passed back into a call")
            raise self.fail(node, f"{node.id!r} is not a literal")
        try:
            return ast.literal_eval(node)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            pass
        try:
            return _fold(node)
        except (ValueError, TypeError, ArithmeticError):
            raise self.fail(node, f"{self.text(node)!r} is not a literal") from None

    def check(self, node: ast.AST, env: dict, literals: dict) -> ast.AST:
        """Validate a check expression and replace calls by result references."""
        if self.is_call(node):
            return self.call(node, env, literals)
        if isinstance(node, ast.Constant):
            return node
        if isinstance(node, ast.Name):
            if node.id in env or node.id in self.consts or node.id in _TYPES:
                if node.id in self.consts and node.id not in env:
                    return _Literal(self.consts[node.id])
                return node
            raise self.fail(node, f"unknown name {node.id!r}")
        if isinstance(node, ast.Tuple | ast.List | ast.Set | ast.Dict):
            try:
                return _Literal(ast.literal_eval(node))
            except (ValueError, TypeError, SyntaxError):
                if isinstance(node, ast.Dict):
                    raise self.fail(node, "dict display with non-literal values") from None
                node.elts = [self.check(e, env, literals) for e in node.elts]
                return node
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not | ast.USub | ast.UAdd):
            node.operand = self.check(node.operand, env, literals)
            return node
        if isinstance(node, ast.BoolOp):
            node.values = [self.check(v, env, literals) for v in node.values]
            return node
        if isinstance(node, ast.BinOp) and isinstance(node.op, _BINOPS + (ast.Pow,)):
            try:
                return _Literal(_fold(node))  # constant arithmetic: 10**9 + 7
            except (ValueError, TypeError, ArithmeticError):
                if isinstance(node.op, ast.Pow):
                    raise self.fail(node, "** on a result") from None
            node.left, node.right = self.check(node.left, env, literals), self.check(node.right, env, literals)
            return node
        if isinstance(node, ast.Compare):
            for op, comp in zip(node.ops, node.comparators, strict=True):
                if isinstance(op, ast.Is | ast.IsNot) and not (
                    (isinstance(comp, ast.Constant) and comp.value in (None, True, False))
                    or (isinstance(comp, ast.Name) and comp.id in _TYPES)
                    or (isinstance(comp, ast.Call) and isinstance(comp.func, ast.Name) and comp.func.id == "type")
                ):
                    raise self.fail(node, "'is' compares with something other than None/True/False or a type")
            node.left = self.check(node.left, env, literals)
            node.comparators = [self.check(c, env, literals) for c in node.comparators]
            return node
        if isinstance(node, ast.Subscript):
            if isinstance(node.slice, ast.Slice):
                raise self.fail(node, "slices in checks")
            node.value = self.check(node.value, env, literals)
            node.slice = _Literal(self.literal(node.slice, literals, env))
            return node
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "math" and "math" in self.helper_modules \
                    and node.attr in _MATH_CONSTS:
                return node
            raise self.fail(node, f"attribute {self.text(node)!r}")
        if isinstance(node, ast.Call):
            f = node.func
            ok = (isinstance(f, ast.Name) and f.id in _HELPERS and f.id not in env) or (
                isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "math"
                and "math" in self.helper_modules and f.attr in _MATH_FUNCS
            )
            if not ok or any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
                raise self.fail(node, f"call of {self.text(f)!r} in a check")
            node.args = [self.check(a, env, literals) for a in node.args]
            for k in node.keywords:
                k.value = self.check(k.value, env, literals)
            return node
        raise self.fail(node, f"{type(node).__name__} in a check")


def _fold(node: ast.AST) -> Any:
    """Value of arithmetic on number constants (``10**9 + 7``, ``-2**31``); ValueError otherwise."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float, complex):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        v = _fold(node.operand)
        return -v if isinstance(node.op, ast.USub) else +v
    if isinstance(node, ast.BinOp) and isinstance(node.op, _BINOPS + (ast.Pow,)):
        a, b = _fold(node.left), _fold(node.right)
        if isinstance(node.op, ast.Pow):
            # Bounded so that a test cannot make the supervisor build a huge number.
            if not (isinstance(b, int) and 0 <= b <= 10_000 and (not isinstance(a, int) or a.bit_length() * b <= 100_000)):
                raise ValueError("exponent too large to fold")
            return a**b
        return _eval(ast.BinOp(_Literal(a), node.op, _Literal(b)), _Ctx(results=[]))
    raise ValueError("not constant arithmetic")


def _is_docstring(node: ast.AST) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def compile_io(tests: str) -> IOPlan:
    """The :class:`IOPlan` of ``tests``, or :class:`NotIO` naming the first construct outside the
    subset (see the module docstring). Test names and their order equal
    :func:`flywheel.sandbox.discover_tests`."""
    try:
        tree = ast.parse(tests)
    except SyntaxError as e:
        raise NotIO(f"test source does not parse: {e}") from None
    c = _Compiler(tests)
    c.module(tree)
    imports = sorted({c.bound[n] for n in c.bound})
    return IOPlan(names=c.names, calls=c.calls, imports=imports, _tests=c.tests, _consts=c.consts)


# ------------------------------------------------------------------------------------------- codec


def decode_value(text: str) -> Any:
    """Decode one result serialised by the sandbox driver (tagged JSON, see below) into plain data.

    Raises ``ValueError`` on anything an honest driver would not have written: the channel is
    written by the candidate's process, so this is a trust boundary. Tags: JSON null/true/false/
    integers/strings/arrays as themselves (arrays are lists); ``{"x": hex}`` an integer over 10,000
    bits, ``{"f": repr}`` float, ``{"c": [re, im]}`` complex, ``{"b": hex}`` bytes, ``{"t": [...]}``
    tuple, ``{"s": [...]}`` set, ``{"fs": [...]}`` frozenset, ``{"d": [[k, v], ...]}`` dict.
    """
    if len(text) > MAX_RESULT_BYTES:
        raise ValueError("result too large")
    try:
        raw = json.loads(text, parse_float=_no_float, parse_constant=_no_float)
    except RecursionError:
        raise ValueError("result nested too deeply") from None
    return _untag(raw, 0)


def _no_float(s: str) -> Any:
    raise ValueError(f"untagged float {s!r}")


def _untag(v: Any, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise ValueError("result nested too deeply")
    if v is None or isinstance(v, bool | int | str):
        return v
    if isinstance(v, list):
        return [_untag(x, depth + 1) for x in v]
    if not isinstance(v, dict) or len(v) != 1:
        raise ValueError("malformed result")
    (tag, body), = v.items()
    if tag == "f" and isinstance(body, str):
        if not re.fullmatch(r"-?(inf|nan|\d+(\.\d+)?(e[-+]?\d+)?)", body):
            raise ValueError(f"malformed float {body[:40]!r}")
        return float(body)
    if tag == "c" and isinstance(body, list) and len(body) == 2:
        re_, im = (_untag(x, depth + 1) for x in body)
        if not (isinstance(re_, float) and isinstance(im, float)):
            raise ValueError("malformed complex")
        return complex(re_, im)
    if tag == "x" and isinstance(body, str) and re.fullmatch(r"-?0x[0-9a-f]+", body):
        return int(body, 16)
    if tag == "b" and isinstance(body, str):
        return bytes.fromhex(body)
    if tag in ("t", "s", "fs") and isinstance(body, list):
        items = [_untag(x, depth + 1) for x in body]
        try:
            return tuple(items) if tag == "t" else _bounded_set(items, set if tag == "s" else frozenset)
        except TypeError:
            raise ValueError("unhashable set element") from None
    if tag == "d" and isinstance(body, list):
        out = {}
        same_hash: dict[int, int] = {}  # as in _bounded_set: at most _MAX_SAME_HASH distinct keys per hash
        for kv in body:
            if not (isinstance(kv, list) and len(kv) == 2):
                raise ValueError("malformed dict item")
            key = _untag(kv[0], depth + 1)
            try:
                h = hash(key)
                n = len(out)
                out[key] = _untag(kv[1], depth + 1)
            except TypeError:
                raise ValueError("unhashable dict key") from None
            if len(out) != n:
                same_hash[h] = c = same_hash.get(h, 0) + 1
                if c > _MAX_SAME_HASH:
                    raise ValueError(f"more than {_MAX_SAME_HASH} distinct dict keys collide on one hash "
                                     "(a crafted result)")
        return out
    raise ValueError(f"unknown tag {tag!r}")
