"""Trusted in-sandbox harness of :mod:`flywheel.sandbox` (runs as ``python -I -S _sandbox_harness.py``).

Never imported by the library; the supervisor executes this file, usually as pid 1 of fresh
pid/mount/network namespaces (``unshare``), with ``argv = [init_fd, result_fd]`` and the setup
(``marshal``, plain data) on stdin -- never in a file or on the command line. Roles:

- **init (this process, root)**: joins the sandbox's cgroup, mounts size-limited tmpfs over ``/tmp``
  and the other world-writable directories, writes the candidate into ``/tmp/work`` owned by a
  throwaway uid, forks the **worker**, waits for it (pidfd) and reports its exit status on the *init
  channel*, which the worker closes before any candidate code runs. In shell mode init then kills
  every candidate process, prepares a clean grader environment (fresh ``/tmp``, the work dir
  read-only, no symlinks followed) and runs the grader as a second throwaway uid. When init exits the
  kernel kills whatever is left in the pid namespace.
- **worker (forked, unprivileged, non-dumpable)**: drops to the throwaway uid, sets rlimits,
  ``no_new_privs`` and ``PR_SET_DUMPABLE=0`` (so not even its own ``/proc/self/mem`` or
  ``/proc/self/fd`` can be opened), then one of:

  - ``io``: the driver imports ``solution``, makes each requested call once and writes one line per
    result (``R <index> ok|raise|bad <json>``) to the result channel. It holds no secret: the
    expected values never enter the sandbox, the supervisor judges.
  - ``proxy`` (free-form tests): two workers, two throwaway uids. The *server* imports ``solution``
    and answers requests (attribute, call, index, len, iteration, repr) over a pipe pair with plain
    data or opaque handles; the *test runner* never runs candidate code: its ``solution`` is a proxy
    module, it alone holds the result channel, and a ``PASS`` record carries that test's token. No
    candidate object, builtin or class can enter the tests' interpreter (issue 31, finding 2).
  - ``shell``: execs bash on the candidate script.

In ``io`` the driver binds what it needs before the candidate's import; a candidate that rebinds
module attributes (``os.write``, this module's functions) changes only its own answers. Records are
``\n``-terminated text lines; the proxy's pipe pair carries length-framed messages.
"""

import os
import sys

# PR_SET_NO_NEW_PRIVS = 38, PR_SET_DUMPABLE = 4 (linux/prctl.h).
_PR_SET_NO_NEW_PRIVS, _PR_SET_DUMPABLE = 38, 4
# mount(2) flags (linux/mount.h).
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_NOSYMFOLLOW = 32, 4096, 16384, 256
_MNT_DETACH = 2
# Inodes of the scratch tmpfs: bounds what a candidate can make init walk when it hands the work
# dir to the grader (16k files ~ 30 ms of lchown/chmod on the development machine).
_TMP_INODES = 16384


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _mount(libc, source, target, fstype, flags, data):
    import ctypes

    src = source.encode() if source else None
    if libc.mount(src, target.encode(), fstype.encode() if fstype else None, flags, data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _mount_tmpfs(libc, target, size_mb, mode="1777", inodes=None):
    if not os.path.isdir(target):
        return
    opts = f"size={int(size_mb)}m,mode={mode}" + (f",nr_inodes={int(inodes)}" if inodes else "")
    # Nothing set-uid or device-like can be planted in scratch space.
    _mount(libc, "tmpfs", target, "tmpfs", _MS_NOSUID | _MS_NODEV, opts.encode())


# Directories init covers with a fresh tmpfs (the host's are hidden from the sandbox).
_COVERED = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")


def _hold(paths):
    """Before any mount: an ``O_PATH`` descriptor on each of ``paths`` (the interpreter's prefix, the
    venv) that must stay reachable, and why it would not be -- a private ancestor (pyenv under
    ``/root``, mode 0700) or a place init covers with tmpfs (a checkout and its venv under ``/tmp``:
    issue 31, finding 1). The descriptors keep the directories reachable once they are hidden."""
    held = []
    for p in paths:
        covered = any(p == c or p.startswith(c + "/") for c in _COVERED)
        private = None
        parts = p.strip("/").split("/")
        for i in range(1, len(parts)):
            anc = "/" + "/".join(parts[:i])
            if not (os.stat(anc).st_mode & 0o001):
                private = anc
                break
        if not covered and private is None:
            continue
        held.append((p, os.open(p, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC), None if covered else private))
    return held


def _expose(libc, held):
    """After the tmpfs mounts: cover each private ancestor with an empty tmpfs (which also hides
    everything else in it) and bind each held path back at its old name, read-only, from its
    descriptor (``/proc/self/fd/N`` reaches the directory even where a mount now hides it)."""
    for anc in sorted({a for _, _, a in held if a is not None}):
        _mount(libc, "tmpfs", anc, "tmpfs", _MS_NOSUID | _MS_NODEV, b"size=1m,mode=0755")
    for p, fd, _ in held:
        os.makedirs(p, exist_ok=True)
        _mount(libc, f"/proc/self/fd/{fd}", p, None, _MS_BIND | _MS_REC, None)
        _mount(libc, None, p, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV, None)



# Syscalls a candidate never needs and that widen what it can reach: tracing and other processes'
# memory, mounts and namespaces, kernel keyrings, BPF, perf, userfaultfd, io_uring (its socket and
# file operations are not seen by seccomp), modules, kexec, raw I/O ports.
_SECCOMP_DENY = (
    "ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root", "chroot",
    "unshare", "setns", "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "kexec_load", "kexec_file_load",
    "init_module", "finit_module", "delete_module", "open_by_handle_at", "name_to_handle_at", "iopl",
    "ioperm", "swapon", "swapoff", "reboot", "acct", "quotactl", "syslog", "fanotify_init", "open_tree",
    "move_mount", "fsopen", "fsmount", "fsconfig", "fspick",
)
# libseccomp's ABI (seccomp.h): SCMP_ACT_ALLOW, SCMP_ACT_ERRNO(EPERM = 1), SCMP_CMP_EQ; AF_UNIX = 1.
_SCMP_ACT_ALLOW, _SCMP_ACT_EPERM, _SCMP_CMP_EQ, _AF_UNIX = 0x7FFF0000, 0x00050000 | 1, 4, 1


def _seccomp_filter():
    """A seccomp filter, built once in init (root) from the system's libseccomp: EPERM for
    ``socket(AF_UNIX, ...)`` -- the network namespace hides every host network, but not the host's
    Unix sockets whose files the sandbox can see (issue 31, finding 13) -- and for
    :data:`_SECCOMP_DENY`. Returns ``(load, None)``, where ``load()`` installs it in the calling
    process (after ``no_new_privs``; inherited by every child and across exec), or ``(None, why)``.
    ``socketpair(AF_UNIX)`` stays allowed (already connected, it reaches nothing outside)."""
    import ctypes

    try:
        lib = ctypes.CDLL("libseccomp.so.2")
    except OSError as e:
        return None, f"libseccomp.so.2 not found ({e})"

    class Cmp(ctypes.Structure):
        _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                    ("datum_b", ctypes.c_uint64)]

    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(Cmp)]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    if not ctx:
        return None, "seccomp_init failed"
    unix = Cmp(0, _SCMP_CMP_EQ, _AF_UNIX, 0)
    rules = [(name, 0, None) for name in _SECCOMP_DENY] + [("socket", 1, ctypes.pointer(unix))]
    for name, n_args, args in rules:
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:  # not a syscall on this architecture
            continue
        rc = lib.seccomp_rule_add_array(ctx, _SCMP_ACT_EPERM, nr, n_args, args)
        if rc < 0:
            return None, f"seccomp rule for {name} refused ({os.strerror(-rc)})"

    def load():
        rc = lib.seccomp_load(ctx)
        if rc < 0:
            raise OSError(-rc, f"seccomp_load: {os.strerror(-rc)}")

    return load, None


def _set_limits(limits):
    import resource

    table = {
        "cpu": resource.RLIMIT_CPU,
        "as": resource.RLIMIT_AS,
        "nproc": resource.RLIMIT_NPROC,
        "fsize": resource.RLIMIT_FSIZE,
        "nofile": resource.RLIMIT_NOFILE,
        "core": resource.RLIMIT_CORE,
    }
    for key, value in limits.items():
        # Soft == hard (an unprivileged process cannot raise either back), except CPU: SIGXCPU at the
        # soft limit names the cause, SIGKILL one second later ends a candidate that ignores it.
        hard = value + 1 if key == "cpu" else value
        resource.setrlimit(table[key], (value, hard))


def _drop_privileges(uid):
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


# Every character str.splitlines() breaks at. A record is one "\n"-terminated line (the supervisor
# splits on "\n" only), and a message never holds any of these raw: escaping all of them keeps an
# honest failure message from looking like a second record to any line reader (issue 31, finding 10).
_LINE_BREAKS = {c: f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"
                for c in (0x0a, 0x0b, 0x0c, 0x0d, 0x1c, 0x1d, 0x1e, 0x85, 0x2028, 0x2029)}
_LINE_BREAKS[0x0a], _LINE_BREAKS[0x0d], _LINE_BREAKS[ord("\\")] = "\\n", "\\r", "\\\\"


def _one_line(text, limit=300):
    return text.translate(_LINE_BREAKS)[:limit]


# ---------------------------------------------------------------------------- io: the call driver


def _encoder(on_other=None):
    """A serialiser of plain data to tagged JSON (see :func:`flywheel.io_grading.decode_value`) that
    needs no ``json`` import (its ``re`` dependency costs ~6 ms per run). ``on_other(v)`` returns the
    text for a value that is not plain data (the proxy path's handles); without it such a value is
    ``Unencodable``."""
    try:
        from _json import encode_basestring_ascii as esc
    except ImportError:  # an interpreter without the C accelerator: the slower pure-Python one
        from json.encoder import py_encode_basestring_ascii as esc

    limit, max_depth = 1 << 20, 64
    t_none, t_bool, t_int, t_float, t_str = type(None), bool, int, float, str
    t_bytes, t_complex, t_list, t_tuple, t_set, t_fs, t_dict = bytes, complex, list, tuple, set, frozenset, dict
    float_repr, int_repr, type_ = float.__repr__, int.__repr__, type

    class Unencodable(Exception):
        pass

    def enc(v, depth, out, size):
        t = type_(v)
        if depth > max_depth:
            raise Unencodable("nested more than 64 levels")
        if t is t_none:
            s = "null"
        elif t is t_bool:
            s = "true" if v else "false"
        elif t is t_int:
            # Decimal conversion of ints over 4300 digits raises (CVE-2020-10735 limit); hex does not.
            s = int_repr(v) if v.bit_length() <= 10000 else '{"x":"' + hex(v) + '"}'
        elif t is t_float:
            s = '{"f":"' + float_repr(v) + '"}'
        elif t is t_str:
            s = esc(v)
        elif t is t_bytes:
            s = '{"b":"' + v.hex() + '"}'
        elif t is t_complex:
            s = '{"c":[{"f":"' + float_repr(v.real) + '"},{"f":"' + float_repr(v.imag) + '"}]}'
        elif t is t_list or t is t_tuple or t is t_set or t is t_fs:
            head = "[" if t is t_list else ('{"t":[' if t is t_tuple else ('{"s":[' if t is t_set else '{"fs":['))
            out.append(head)
            size += len(head)
            first = True
            for x in v:
                if not first:
                    out.append(",")
                first = False
                size = enc(x, depth + 1, out, size + 1)
            out.append("]" if t is t_list else "]}")
            return size + 2
        elif t is t_dict:
            out.append('{"d":[')
            size += 6
            first = True
            for k, x in v.items():
                if not first:
                    out.append(",")
                first = False
                out.append("[")
                size = enc(k, depth + 1, out, size + 2)
                out.append(",")
                size = enc(x, depth + 1, out, size + 1)
                out.append("]")
            out.append("]}")
            return size + 3
        elif on_other is not None:
            s = on_other(v)
        else:
            raise Unencodable(f"a {t.__name__} is not plain data")
        if size + len(s) > limit:
            raise Unencodable("larger than 1 MiB serialised")
        out.append(s)
        return size + len(s)

    def encode(v):
        out = []
        enc(v, 0, out, 0)
        return "".join(out)

    return encode, Unencodable


def _worker_io(setup, result_fd, ready=lambda: None):
    """Import the candidate, make each call once, write each result. Holds nothing that decides a
    verdict: whatever this process writes, the supervisor compares with values it never sent."""
    write = os.write
    exit_ = os._exit
    encode, unencodable = _encoder()
    calls = setup["calls"]

    def emit(line):
        try:
            write(result_fd, (line + "\n").encode("utf-8", "surrogatepass"))
        except BaseException:  # noqa: BLE001 - a closed channel ends the run: missing results fail
            exit_(3)

    def describe(e):
        try:
            mro = [c.__name__ for c in type(e).__mro__ if isinstance(c.__name__, str)][:16]
            msg = str(e)[:1000]
        except BaseException:  # noqa: BLE001 - a hostile exception still counts as raised
            mro, msg = ["BaseException"], "unprintable exception"
        return encode([mro, msg])

    sys.path[:0] = [setup["workdir"]]
    sys.dont_write_bytecode = True
    ready()
    try:
        mod = __import__("solution")
        bound = {}
        for name in setup["imports"]:
            try:
                bound[name] = getattr(mod, name)
            except AttributeError:
                raise ImportError(f"cannot import name {name!r} from 'solution'") from None
    except BaseException as e:  # noqa: BLE001 - SystemExit/KeyboardInterrupt from the candidate included
        emit("L raise " + describe(e))
        exit_(0)
    emit("L ok")
    for i, (func, args, kwargs, is_bound) in enumerate(calls):
        try:
            fn = bound[func] if is_bound else getattr(mod, func)
            value = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001
            emit(f"R {i} raise {describe(e)}")
            continue
        try:
            emit(f"R {i} ok {encode(value)}")
        except unencodable as e:
            emit(f"R {i} bad {encode(str(e))}")
        except BaseException as e:  # noqa: BLE001 - a container whose iteration raises, a RecursionError
            emit(f"R {i} bad {encode(type(e).__name__)}")
    exit_(0)


# ------------------------------------------------- proxy: the tests in one process, the candidate in another


def _send(fd, text):
    data = text.encode("utf-8", "surrogatepass")
    view = memoryview(b"%08x" % len(data) + data)
    while view:
        view = view[os.write(fd, view):]


def _recv(fd, limit):
    """One framed message (``%08x`` length + UTF-8 text), or None at end of file."""
    head = _read_exact(fd, 8)
    if head is None:
        return None
    try:
        n = int(head, 16)
    except ValueError:
        raise ValueError("malformed frame") from None
    if n > limit:
        raise ValueError(f"message larger than {limit} bytes")
    body = _read_exact(fd, n)
    if body is None:
        return None
    return body.decode("utf-8", "surrogatepass")


def _read_exact(fd, n):
    chunks, got = [], 0
    while got < n:
        b = os.read(fd, min(n - got, 1 << 20))
        if not b:
            return None
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def _decoder(handle):
    """The inverse of :func:`_encoder` (tags of :func:`flywheel.io_grading.decode_value`), plus
    ``{"h": n}`` -> ``handle(n)``. Builds exact built-in types only; ValueError on anything else.
    Parses with the C scanner of ``_json`` directly: ``import json`` (its ``re``) cost 25-35 ms per
    process on the development machine, in each of the proxy path's two processes."""

    def no_float(s):
        raise ValueError(f"untagged float {s[:40]!r}")

    try:
        from _json import make_scanner

        class _Ctx:
            strict, object_hook, object_pairs_hook, parse_int = True, None, None, int
            parse_float = parse_constant = staticmethod(no_float)

        scan = make_scanner(_Ctx())

        def loads(text):
            try:
                obj, end = scan(text, 0)
            except StopIteration:
                raise ValueError("not JSON") from None
            if end != len(text):
                raise ValueError("trailing data after the value")
            return obj
    except ImportError:  # an interpreter without the C accelerator
        import json

        def loads(text):
            return json.loads(text, parse_float=no_float, parse_constant=no_float)

    def untag(v, depth):
        if depth > 66:
            raise ValueError("nested too deeply")
        if v is None or type(v) in (bool, int, str):
            return v
        if type(v) is list:
            return [untag(x, depth + 1) for x in v]
        if type(v) is not dict or len(v) != 1:
            raise ValueError("malformed value")
        (tag, body), = v.items()
        if tag == "h" and type(body) is int:
            return handle(body)
        if tag == "f" and type(body) is str:
            return float(body)
        if tag == "x" and type(body) is str:
            return int(body, 16)
        if tag == "b" and type(body) is str:
            return bytes.fromhex(body)
        if tag == "c" and type(body) is list and len(body) == 2:
            a, b = (untag(x, depth + 1) for x in body)
            return complex(a, b)
        if tag in ("t", "s", "fs") and type(body) is list:
            items = [untag(x, depth + 1) for x in body]
            return tuple(items) if tag == "t" else (set(items) if tag == "s" else frozenset(items))
        if tag == "d" and type(body) is list:
            return {untag(k, depth + 1): untag(x, depth + 1) for k, x in body}
        raise ValueError(f"unknown tag {str(tag)[:20]!r}")

    def decode(text):
        try:
            return untag(loads(text), 0)
        except (RecursionError, TypeError, ValueError, OverflowError) as e:
            raise ValueError(f"malformed value ({type(e).__name__})") from None

    return decode


def _worker_server(setup, req_fd, resp_fd, ready=lambda: None):
    """The candidate's process on the proxy path: imports ``solution`` and answers the test runner's
    requests (get an attribute, call, index, length, iterate, repr) on it and on the objects it
    returned, one framed message each. It holds nothing that decides a verdict: no test, expected
    value, token or result channel; what it returns reaches the tests as plain data or as an opaque
    handle whose ``==``, ``hash`` and type are the test process's own."""
    write_exit = os._exit
    table = []
    limit_handles = 100_000

    def register(v):
        if len(table) >= limit_handles:
            raise ValueError("too many live objects")
        table.append(v)
        return '{"h":' + str(len(table) - 1) + "}"

    encode, unencodable = _encoder(register)
    decode = _decoder(lambda n: table[n])

    def describe(e):
        try:
            mro = [c.__name__ for c in type(e).__mro__ if isinstance(c.__name__, str)][:16]
            msg = str(e)[:1000]
        except BaseException:  # noqa: BLE001 - a hostile exception still counts as raised
            mro, msg = ["BaseException"], "unprintable exception"
        return encode([mro, msg])

    def send(text):
        try:
            _send(resp_fd, text)
        except BaseException:  # noqa: BLE001 - the runner is gone: nothing left to answer
            write_exit(0)

    sys.path[:0] = [setup["workdir"]]
    sys.dont_write_bytecode = True
    ready()
    try:
        table.append(__import__("solution"))
    except BaseException as e:  # noqa: BLE001 - SystemExit/KeyboardInterrupt from the candidate included
        send("raise " + describe(e))
        write_exit(0)
    send("ok")
    while True:
        try:
            msg = _recv(req_fd, 1 << 22)
        except BaseException:  # noqa: BLE001
            write_exit(0)
        if msg is None:
            write_exit(0)
        try:
            op, hid, a, b = decode(msg)
            obj = table[hid]
            if op == "get":
                value = getattr(obj, a)
            elif op == "set":
                setattr(obj, a, b)
                value = None
            elif op == "call":
                value = obj(*a, **b)
            elif op == "item":
                value = obj[a]
            elif op == "len":
                value = len(obj)
            elif op == "iter":
                value = []
                for x in obj:
                    value.append(x)
                    if len(value) > 1_000_000:
                        raise ValueError("more than 1,000,000 items")
            elif op == "repr":
                value = str(repr(obj))[:1000]
            else:
                value = None
        except BaseException as e:  # noqa: BLE001
            send("raise " + describe(e))
            continue
        try:
            send("ok " + encode(value))
        except unencodable as e:
            send("bad " + encode(str(e)))
        except BaseException as e:  # noqa: BLE001 - a container whose iteration raises, a RecursionError
            send("bad " + encode(type(e).__name__))


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


# --------------------------------------------------------------------------------------------- init


def main():
    import time

    t_start = time.monotonic_ns()
    # The umask is inherited from the verifier's process; a restrictive one (0o077, set by some
    # libraries) would make the directories _expose creates untraversable for the sandbox uids.
    os.umask(0o022)
    init_fd, result_fd = int(sys.argv[1]), int(sys.argv[2])
    import marshal

    # stdin: a framed public part, then the rest of the stream: the part only the test runner may
    # hold (the proxy path's tests and tokens). Init reads the rest only after it forked the
    # candidate's process, so that process never had the tests in its memory (a frame walk or
    # ctypes read there finds none; issue 31, finding 2).
    head = _read_exact(0, 8)
    setup = marshal.loads(_read_exact(0, int(head, 16)))
    secret_fd = os.dup(0)  # not in any worker's keep list: closed in every fork
    devnull = os.open("/dev/null", os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)

    def read_secret():
        chunks = []
        while True:
            b = os.read(secret_fd, 1 << 16)
            if not b:
                break
            chunks.append(b)
        os.close(secret_fd)
        setup.update(marshal.loads(b"".join(chunks)))

    if setup["mode"] != "proxy":
        read_secret()
    nonce = setup["init_nonce"]

    def init_report(line):
        os.write(init_fd, f"{nonce} {line} {time.monotonic_ns()}\n".encode())

    init_report(f"START {t_start}")
    mode = setup["mode"]
    uid = setup["uid"]
    grader_uid = setup.get("grader_uid")
    strong = setup["strong"]
    libc = None
    try:
        # The cgroup first: everything forked from here on is charged to it and counted by pids.max.
        for procs in setup["cgroup_procs"]:
            with open(procs, "w") as f:
                f.write("0")
        libc = _libc()
        if strong:
            held = _hold(setup["expose"])  # before the mounts below can hide them
            _mount_tmpfs(libc, "/tmp", setup["tmpfs_mb"], inodes=_TMP_INODES)
            for extra in ("/var/tmp", "/dev/shm", "/run/lock"):
                _mount_tmpfs(libc, extra, 1, inodes=256)
            _expose(libc, held)
            setup["held"] = [h for h in held if h[2] is None]  # the grader's fresh /tmp hides these again
            workdir = "/tmp/work"
            # The work dir is a mount point of its own: the candidate cannot rename it away and put a
            # symlink in its place before init hands its files to the grader.
            os.mkdir(workdir, 0o700)
            _mount_tmpfs(libc, workdir, setup["tmpfs_mb"], mode="0700", inodes=_TMP_INODES)
        else:
            workdir = setup["fallback_workdir"]
        os.makedirs(workdir, exist_ok=True)
        fname = "candidate.sh" if mode == "shell" else "solution.py"
        with open(os.path.join(workdir, fname), "w", encoding="utf-8") as f:
            f.write(setup["candidate"])
        if uid is not None:
            os.chown(workdir, uid, uid)
            os.chown(os.path.join(workdir, fname), uid, uid)
        os.chmod(workdir, 0o700)
        setup["workdir"] = workdir
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": workdir,
            "TMPDIR": "/tmp" if strong else workdir,
            "LANG": "C.UTF-8",
            "PYTHONHASHSEED": "0",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        os.environ.clear()
        os.environ.update(env)
        os.chdir(workdir)
        seccomp_load, seccomp_why = _seccomp_filter() if strong else (None, "weak mode")
        import resource  # noqa: F401 - imported while root: the stdlib may sit under a private dir
        import select
    except BaseException as e:  # noqa: BLE001 - any failure before the candidate runs is infrastructure
        init_report("SETUP_ERROR " + _one_line(f"{type(e).__name__}: {e}"))
        os._exit(2)

    def spawn(kind, run_as, argv=None, cwd=None, env=None, fds=(), confine=True):
        """Fork a worker; returns (pid, None) once it is about to run candidate (or grader) code, or
        (pid, why) when it failed before that -- an infrastructure error, not the candidate's."""
        # Close-on-exec: an exec that works closes it silently; python workers close it themselves
        # right before importing the candidate; anything written to it is a setup failure.
        sr, sw = os.pipe2(os.O_CLOEXEC)
        pid = os.fork()
        if pid == 0:
            try:
                os.close(sr)
                os.close(init_fd)
                if run_as is not None:
                    _drop_privileges(run_as)
                if libc is not None:
                    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # set-uid binaries cannot regain root
                    libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)  # /proc/self/{mem,fd,...} become root-only
                _set_limits(setup["limits"])
                if confine and seccomp_load is not None:
                    seccomp_load()  # candidate processes only: the grader and the test runner are trusted
                if cwd is not None:
                    os.chdir(cwd)
                keep = sorted({sw, *fds})
                lo = 3
                for fd in keep:
                    os.closerange(lo, fd)
                    lo = fd + 1
                os.closerange(lo, 1 << 16)

                def ready():
                    os.close(sw)

                if kind == "io":
                    _worker_io(setup, result_fd, ready)
                elif kind == "server":
                    _worker_server(setup, fds[0], fds[1], ready)
                elif kind == "tests":
                    _worker_tests(setup, fds[0], fds[1], fds[2], ready)
                else:
                    os.execve("/bin/bash", ["bash", "--noprofile", "--norc", *argv], env or os.environ)
            except BaseException as e:  # noqa: BLE001
                try:
                    os.write(sw, _one_line(f"{type(e).__name__}: {e}").encode())
                finally:
                    os._exit(4)
            os._exit(5)
        os.close(sw)
        try:
            got, _, _ = select.select([sr], [], [], setup["phase_seconds"])
            why = os.read(sr, 4096).decode(errors="replace") if got else "the worker did not start in time"
        finally:
            os.close(sr)
        return pid, (why or None)

    def wait_with_deadline(pid, seconds):
        # A pidfd turns "wait with a timeout" into one select() call: no polling latency.
        pidfd = os.pidfd_open(pid)
        try:
            ready, _, _ = select.select([pidfd], [], [], seconds)
        finally:
            os.close(pidfd)
        if not ready:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            return None
        return os.waitpid(pid, 0)[1]

    def kill_everyone_else():
        if strong:
            # As pid 1 of the namespace, kill(-1) reaches every other process in it (all of them
            # unprivileged), including ones that called setsid() to leave the process group.
            try:
                os.kill(-1, 9)
            except ProcessLookupError:
                pass
        else:
            me = os.getpid()
            for procs in setup["cgroup_procs"]:  # weak mode: the cgroup still knows every process
                for _ in range(100):
                    with open(procs) as f:
                        pids = [int(x) for x in f.read().split() if int(x) != me]
                    if not pids:
                        break
                    for p in pids:
                        try:
                            os.kill(p, 9)
                        except OSError:
                            pass
        try:
            while True:
                os.waitpid(-1, 0)
        except ChildProcessError:
            pass

    def status_line(tag, status):
        if status is None:
            return f"{tag} TIMEOUT"
        if os.WIFSIGNALED(status):
            return f"{tag} SIGNAL {os.WTERMSIG(status)}"
        return f"{tag} EXIT {os.WEXITSTATUS(status)}"

    def worker_failed(why):
        init_report("WORKER_SETUP_ERROR " + _one_line(why))
        kill_everyone_else()
        os._exit(2)

    init_report("SECCOMP " + ("on" if seccomp_load is not None else "off " + _one_line(seccomp_why).replace(" ", "_")))
    init_report("READY")
    if mode == "io":
        pid, why = spawn(mode, uid, fds=(result_fd,))
        os.close(result_fd)
        if why:
            worker_failed(why)
        status = wait_with_deadline(pid, setup["phase_seconds"])
        init_report(status_line("WORKER", status))
        kill_everyone_else()
    elif mode == "proxy":
        # Two processes, two uids: the candidate answers requests on one pipe pair; the tests run in
        # the other process, which alone holds the result channel (issue 31, finding 2).
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        t_phase = time.monotonic()
        server, why = spawn("server", uid, fds=(req_r, resp_w))
        if why:
            worker_failed(why)
        read_secret()
        pid, why = spawn("tests", setup["runner_uid"], cwd="/", fds=(result_fd, req_w, resp_r), confine=False)
        for fd in (req_r, req_w, resp_r, resp_w, result_fd):
            os.close(fd)
        if why:
            worker_failed(why)
        status = wait_with_deadline(pid, setup["phase_seconds"])
        init_report(status_line("WORKER", status))
        # The candidate's own fate (a CPU limit, a signal) names why its tests failed. It sees end of
        # file once the runner is gone; one that lingers past that is killed without a record (its
        # answers are in already).
        left = max(0.0, min(1.0, setup["phase_seconds"] - (time.monotonic() - t_phase)))
        cstatus = wait_with_deadline(server, left)
        if cstatus is not None:
            init_report(status_line("CANDIDATE", cstatus))
        kill_everyone_else()
    else:
        pid, why = spawn("shell", uid, ["candidate.sh"])
        if why:
            worker_failed(why)
        status = wait_with_deadline(pid, setup["phase_seconds"])
        init_report(status_line("CANDIDATE", status))
        kill_everyone_else()
        try:
            gdir, genv = _grader_environment(libc, setup, workdir, strong, grader_uid)
        except BaseException as e:  # noqa: BLE001 - the grader could not be prepared: not the candidate's fault
            init_report("GRADER_SETUP_ERROR " + _one_line(f"{type(e).__name__}: {e}"))
            os._exit(2)
        init_report("GRADER_READY " + ("nosymfollow" if genv.pop("_NOSYMFOLLOW", "") else "symlinks"))
        # The grader comes from init's memory (it never lived in the writable tree) and runs only
        # after every candidate process is dead, so only the files the candidate left count.
        pid, why = spawn("shell", grader_uid, ["-c", setup["grader"]], cwd=gdir, env=genv, confine=False)
        if why:
            worker_failed("grader: " + why)
        status = wait_with_deadline(pid, setup["phase_seconds"])
        init_report(status_line("GRADER", status))
        kill_everyone_else()
    init_report("END")
    os._exit(0)


def _hand_over(workdir):
    """Make every file the candidate left readable by the grader's uid (the candidate's own modes mean
    nothing now) through the "other" permission bits. The owner stays the candidate's uid: tools that
    refuse files of another user (git's safe.directory check before it runs hooks from .git/config)
    keep refusing them. Symlinks are neither followed nor changed. Iterative (a candidate can nest
    directories ~2000 deep), and every candidate process is dead by now, so nothing can swap an
    entry between the lstat and the chmod."""
    import stat

    stack = [workdir]
    while stack:
        d = stack.pop()
        try:
            entries = list(os.scandir(d))
        except OSError:
            entries = []
        for p in [d, *(e.path for e in entries)]:
            try:
                st = os.lstat(p)
                if stat.S_ISLNK(st.st_mode):
                    continue
                is_dir = stat.S_ISDIR(st.st_mode)
                os.chmod(p, (st.st_mode & 0o777) | (0o555 if is_dir else 0o444))
                if is_dir and p != d:
                    stack.append(p)
            except OSError:
                pass


def _grader_environment(libc, setup, workdir, strong, grader_uid):
    """A clean place for the grader: its own empty cwd, a fresh ``/tmp``, the candidate's work dir
    read-only at the same path (no exec, no set-uid, symlinks not followed), ``python``/``python3``
    that run ``-I``, a fixed PATH. Returns (cwd, env)."""
    import secrets

    py = setup["python"]
    nosymfollow = ""
    if strong:
        _hand_over(workdir)
        # Keep the work dir reachable through /dev/shm while /tmp is replaced underneath it.
        _mount_tmpfs(libc, "/dev/shm", 1, inodes=256)
        os.mkdir("/dev/shm/w", 0o700)
        _mount(libc, workdir, "/dev/shm/w", None, _MS_BIND, None)
        _mount_tmpfs(libc, "/tmp", setup["tmpfs_mb"], inodes=_TMP_INODES)
        os.mkdir(workdir, 0o755)
        _mount(libc, "/dev/shm/w", workdir, None, _MS_BIND, None)
        ro = _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
        try:
            _mount(libc, None, workdir, None, ro | _MS_NOSYMFOLLOW, None)
            nosymfollow = "1"
        except OSError:  # kernels before 5.10: read-only, but symlinks are followed
            _mount(libc, None, workdir, None, ro, None)
        libc.umount2(b"/dev/shm/w", _MNT_DETACH)
        for extra in ("/var/tmp", "/dev/shm", "/run/lock"):
            _mount_tmpfs(libc, extra, 1, inodes=256)
        _expose(libc, setup.get("held", []))
        base = "/tmp"
    else:
        base = setup["fallback_grader_base"]
        os.chmod(base, 0o755)
    gdir = os.path.join(base, "grader-" + secrets.token_hex(8))
    bindir = os.path.join(base, ".bin-" + secrets.token_hex(8))
    os.mkdir(gdir, 0o700)
    os.mkdir(bindir, 0o755)
    for name in ("python", "python3"):
        shim = os.path.join(bindir, name)
        with open(shim, "w") as f:
            f.write(f"#!/bin/sh\nexec '{py}' -I \"$@\"\n")
        os.chmod(shim, 0o755)
    if grader_uid is not None:
        os.chown(gdir, grader_uid, grader_uid)
    env = {
        "PATH": f"{bindir}:/usr/local/bin:/usr/bin:/bin",
        "HOME": gdir,
        "TMPDIR": gdir,
        "WORK": workdir,
        "LANG": "C.UTF-8",
        "PYTHONSAFEPATH": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "GIT_CONFIG_NOSYSTEM": "1",
        "_NOSYMFOLLOW": nosymfollow,
    }
    return gdir, env


if __name__ == "__main__":
    main()
