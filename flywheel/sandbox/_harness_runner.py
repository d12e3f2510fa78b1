"""The proxy path's test runner (:func:`_worker_tests`), a worker of the sandbox harness
(:mod:`_sandbox_harness`): a process of its own, under its own throwaway uid, that never runs candidate
code. Its ``solution`` is a proxy module whose attributes are requested from the candidate's process;
it alone holds the result channel, and a ``PASS`` record carries that test's token.

Loaded in the sandbox as a top-level module next to the harness (``python -I -S``: standard library
only).
"""

import os
import sys

from _harness_codec import _decoder, _encoder, _one_line, _recv, _send  # type: ignore[import-not-found]


def _worker_tests(setup, result_fd, req_fd, resp_fd, ready=lambda: None):
    """The test runner on the proxy path: a process of its own (another uid) that never runs candidate
    code. ``solution`` is a proxy module whose attributes are requested from the candidate's process;
    results arrive as plain data of exact built-in types or as opaque handles (:class:`Remote`), so an
    object whose ``__eq__`` is always True, an int subclass, a patched builtin or a walk of
    ``object.__subclasses__()`` in the candidate's process cannot reach the tests (issue 31, finding 2)."""
    import builtins
    import types

    write, exit_ = os.write, os._exit
    tokens = list(setup["tokens"])
    done_token = setup["done_token"]
    names = list(setup["tests"])

    def report(line):
        try:
            write(result_fd, (line + "\n").encode("utf-8", "replace"))
        except BaseException:  # noqa: BLE001
            exit_(3)

    class CandidateGone(RuntimeError):
        pass

    state = {"gone": None}
    # Exceptions raised in the candidate's process come back by name; the tests see the built-in class
    # named first in the exception's MRO (a subclass of the same name when the candidate's own class
    # raised), so `pytest.raises(ValueError)` and `except KeyError` work as in one process.
    builtin_exc = {k: v for k, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}

    def rebuild(mro, msg):
        base = next((builtin_exc[n] for n in mro if n in builtin_exc), Exception)
        if base in (SystemExit, KeyboardInterrupt, GeneratorExit, BaseException):
            base = RuntimeError
        if not mro or mro[0] == base.__name__:
            return base(msg)
        return type(str(mro[0])[:100], (base,), {"__module__": "solution"})(msg)

    def ask(op, hid, a=None, b=None):
        if state["gone"]:
            raise CandidateGone(state["gone"])
        try:
            _send(req_fd, encode([op, hid, a, b]))
        except unencodable as e:
            raise TypeError(f"cannot pass this to the solution (tests and solution run in separate processes; "
                            f"only plain data and objects the solution returned cross): {e}") from None
        except OSError:
            state["gone"] = "the solution's process ended"
            raise CandidateGone(state["gone"]) from None
        try:
            reply = _recv(resp_fd, 1 << 21)
        except (OSError, ValueError) as e:
            state["gone"] = f"malformed reply from the solution's process ({e})"
            raise CandidateGone(state["gone"]) from None
        if reply is None:
            state["gone"] = "the solution's process ended"
            raise CandidateGone(state["gone"])
        status, _, payload = reply.partition(" ")
        if status == "ok":
            return decode(payload)
        if status == "raise":
            v = decode(payload)
            if not (type(v) is list and len(v) == 2 and type(v[0]) is list and type(v[1]) is str):
                raise ValueError("malformed exception from the solution's process")
            raise rebuild([str(x) for x in v[0]], v[1])
        if status == "bad":
            raise TypeError(f"the solution's result cannot cross to the tests: {decode(payload)}")
        raise ValueError(f"malformed reply status {status[:20]!r}")

    class Remote:
        """An object that lives in the candidate's process. Attribute access, calls, indexing, len,
        iteration and repr are forwarded; ``==``, ``hash``, ``bool``, ``type`` and ``isinstance`` are
        this process's own (identity): a candidate object cannot claim to equal anything."""

        __slots__ = ("_h",)

        def __init__(self, h):
            object.__setattr__(self, "_h", h)

        def __getattr__(self, name):
            if name.startswith("__") and name.endswith("__"):
                raise AttributeError(name)
            return ask("get", self._h, name)

        def __setattr__(self, name, value):
            ask("set", self._h, name, value)

        def __call__(self, *args, **kwargs):
            return ask("call", self._h, list(args), kwargs)

        def __getitem__(self, key):
            return ask("item", self._h, key)

        def __len__(self):
            n = ask("len", self._h)
            if type(n) is not int or n < 0:
                raise TypeError("len() of a solution object is not a non-negative int")
            return n

        def __bool__(self):
            return True

        def __iter__(self):
            return iter(ask("iter", self._h))

        def __repr__(self):
            r = ask("repr", self._h)
            return f"<solution object {r if type(r) is str else '?'}>"

    def on_other(v):
        if type(v) is Remote:
            return '{"h":' + str(object.__getattribute__(v, "_h")) + "}"
        raise unencodable(f"a {type(v).__name__} is not plain data")

    encode, unencodable = _encoder(on_other)
    decode = _decoder(Remote)

    class SolutionProxy(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__") and name.endswith("__"):
                raise AttributeError(name)
            try:
                return ask("get", 0, name)
            except AttributeError as e:
                raise AttributeError(str(e)) from None

    code = compile(setup["test_source"], "<tests>", "exec")
    sys.dont_write_bytecode = True
    ready()
    n_tests = len(names)
    try:
        first = _recv(resp_fd, 1 << 21)
    except (OSError, ValueError):
        first = None
    load_error = None
    if first is None:
        load_error = "the solution's process ended before importing solution"
    elif first != "ok":
        try:
            v = decode(first.partition(" ")[2])
            load_error = f"{v[0][0]}: {v[1]}"
        except Exception:  # noqa: BLE001 - the candidate's process wrote it: any malformed reply is its loss
            load_error = "malformed reply from the solution's process"
    if load_error is not None:
        for i in range(n_tests):
            report(f"FAIL {i} " + _one_line("importing solution failed: " + load_error))
        report("DONE " + done_token)
        exit_(0)
    sys.modules["solution"] = SolutionProxy("solution")
    namespace = {"__name__": "tests"}

    def describe(exc):
        try:
            return f"{type(exc).__name__}: {exc}"
        except BaseException:  # noqa: BLE001
            return type(exc).__name__

    try:
        exec(code, namespace)
        targets = []
        for name in names:
            cls_name, _, meth = name.partition(".")
            targets.append((namespace[cls_name], meth))
    except BaseException as e:  # noqa: BLE001
        for i in range(n_tests):
            report(f"FAIL {i} " + _one_line("loading tests failed: " + describe(e)))
        report("DONE " + done_token)
        exit_(0)
    testcase = getattr(sys.modules.get("unittest"), "TestCase", None)
    for i in range(n_tests):
        obj, meth = targets[i]
        try:
            if meth:
                if testcase is not None and isinstance(obj, type) and issubclass(obj, testcase):
                    inst = obj(meth)
                else:
                    inst = obj()
                setup_fn = getattr(inst, "setUp", None)
                if callable(setup_fn):
                    setup_fn()
                try:
                    getattr(inst, meth)()
                finally:
                    teardown = getattr(inst, "tearDown", None)
                    if callable(teardown):
                        teardown()
            else:
                obj()
        except BaseException as e:  # noqa: BLE001
            report(f"FAIL {i} " + _one_line(describe(e)))
            continue
        report(f"PASS {i} {tokens[i]}")
    report("DONE " + done_token)
    exit_(0)
