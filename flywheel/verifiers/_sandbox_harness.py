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
  - ``inproc``: the free-form tests run beside the candidate. Before the candidate is imported the
    worker snapshots ``builtins``, imports the modules the tests import and snapshots them (module
    dicts, and the dicts of classes defined in them) into private copies the tests import, removes
    ``signal``/``_signal``/``faulthandler``/``ctypes`` from ``sys.modules`` and installs an audit hook
    that refuses their import and every frame/introspection path it can see. Tests run against the
    snapshots, restored before each test; a test fails while a thread of the candidate is running.
    A ``PASS`` record carries that test's own random token, so a record the candidate reads back (or
    intercepts) reveals nothing about the tests it failed.
  - ``shell``: execs bash on the candidate script.

Everything the harness needs after candidate code starts is bound to local names first, so a
candidate that rebinds module attributes (``os.write``, ``builtins.exec``, this module's functions)
does not change what is reported. The protocol is line-based text.
"""

import os
import sys

# Modules whose objects hand out frames (signal handlers receive one), dump stacks, or poke memory.
_BLOCKED_MODULES = frozenset({
    "signal", "_signal", "faulthandler", "ctypes", "_ctypes", "_testcapi", "_testinternalcapi",
    "_testbuffer", "_testmultiphase", "_testsinglephase", "_testimportmultiple", "_xxsubinterpreters",
    "_xxinterpchannels", "_xxtestfuzz",
})
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


def _encoder():
    """A serialiser of plain data to tagged JSON (see :func:`flywheel.io_tests.decode_value`) that
    needs no ``json`` import (its ``re`` dependency costs ~6 ms per run)."""
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


# ----------------------------------------------------------------- inproc: tests beside the candidate


def _purge_blocked_modules():
    """Remove frame-handing modules from ``sys.modules`` and from every loaded module's namespace, so
    the candidate can neither import them (the audit hook refuses the import event) nor reach them
    through another module (``unittest.signals.signal``)."""
    blocked = _BLOCKED_MODULES
    mods = sys.modules
    gone = [m for name, m in list(mods.items()) if name in blocked or name.partition(".")[0] in blocked]
    for name in [n for n in list(mods) if n in blocked or n.partition(".")[0] in blocked]:
        del mods[name]
    gone_ids = {id(m) for m in gone}
    for m in list(mods.values()):
        d = getattr(m, "__dict__", None)
        if not isinstance(d, dict):
            continue
        for k, v in list(d.items()):
            owner = getattr(v, "__module__", None) if callable(v) else None
            if id(v) in gone_ids or (isinstance(owner, str) and owner.partition(".")[0] in blocked):
                del d[k]


def _install_audit_hook():
    """Refuse the introspection paths that would let candidate code read the harness's secrets or
    rewrite its frames. ValueError is what stdlib callers of ``sys._getframe`` (typing, enum,
    collections.namedtuple) already catch, so ordinary code keeps working."""
    blocked_get = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back"})
    blocked_set = frozenset({"__code__", "__class__"})
    blocked_events = frozenset({
        "sys._getframe", "sys._current_frames", "sys._current_exceptions", "sys.settrace",
        "sys.setprofile", "gc.get_objects", "gc.get_referrers", "gc.get_referents", "code.__new__",
        "function.__new__",
    })
    blocked_modules = _BLOCKED_MODULES
    startswith, partition, realpath = str.startswith, str.partition, os.path.realpath

    def hook(event, args):
        if event in blocked_events:
            raise ValueError(f"sandbox: {event} is not allowed")
        if event == "import":
            if args and isinstance(args[0], str) and partition(args[0], ".")[0] in blocked_modules:
                raise ImportError(f"sandbox: importing {args[0]} is not allowed")
        elif event == "sys.addaudithook":
            raise RuntimeError("sandbox: audit hooks are not allowed")  # RuntimeError: silently not added
        elif startswith(event, "ctypes."):
            raise ValueError(f"sandbox: {event} is not allowed")
        elif event == "object.__getattr__":
            if len(args) > 1 and args[1] in blocked_get:
                raise ValueError(f"sandbox: access to .{args[1]} is not allowed")
        elif event == "object.__setattr__":
            if len(args) > 1 and args[1] in blocked_set:
                raise ValueError(f"sandbox: setting .{args[1]} is not allowed")
        elif event == "open" and args and isinstance(args[0], str) and startswith(args[0], "/proc"):
            # Non-dumpable already makes these root-only; this names the refusal.
            p = realpath(args[0])
            if p.endswith(("/mem", "/pagemap", "/environ")):
                raise PermissionError(f"sandbox: opening {p} is not allowed")

    sys.addaudithook(hook)


def _worker_inproc(setup, result_fd, test_imports, ready=lambda: None):
    """Runs in the forked worker, after privileges are dropped. Never returns."""
    import builtins

    # --- everything used after the candidate's import is bound here, before it exists
    write, exit_, getpid = os.write, os._exit, os.getpid
    exec_, compile_, range_, len_ = exec, compile, range, len
    isinstance_, issubclass_, getattr_, setattr_, delattr_ = isinstance, issubclass, getattr, setattr, delattr
    callable_, type_, str_, repr_, list_, dict_ = callable, type, str, repr, list, dict
    base_exc = BaseException
    dict_clear, dict_update, dict_items = dict.clear, dict.update, dict.items
    str_partition = str.partition
    one_line = _one_line
    tokens = list_(setup["tokens"])
    done_token = setup["done_token"]
    names = list_(setup["tests"])
    n_tests = len_(names)
    my_pid = getpid()

    def report(line):
        # A forked copy (the candidate called os.fork) must not report: it would be a second guess.
        if getpid() != my_pid:
            exit_(0)
        try:
            write(result_fd, (line + "\n").encode("utf-8", "replace"))
        except base_exc:
            exit_(3)

    def describe(exc):
        try:
            return f"{type_(exc).__name__}: {str_(exc)}"
        except base_exc:
            try:
                return repr_(type_(exc))
            except base_exc:
                return "unprintable exception"

    code = compile_(setup["test_source"], "<tests>", "exec")
    sys.path[:0] = [setup["workdir"]]
    sys.dont_write_bytecode = True
    # The tests' own imports, made now: the candidate must not be able to substitute them.
    for modname in test_imports:
        try:
            __import__(modname)
        except BaseException:  # noqa: BLE001 - a test importing a missing module fails when it loads
            pass
    if "traceback" in sys.modules:
        # unittest's assertRaises clears frames through tb_frame, which the audit hook refuses.
        sys.modules["traceback"].clear_frames = lambda tb: None
    prefixes = tuple(test_imports)
    saved = {n: m for n, m in list(sys.modules.items())
             if m is not None and n != "solution" and (n in prefixes or n.startswith(tuple(p + "." for p in prefixes)))}
    module_state = []
    class_state = []
    for m in saved.values():
        d = getattr_(m, "__dict__", None)
        if isinstance_(d, dict_):
            module_state.append((d, dict_(d)))
            for v in list_(d.values()):
                if isinstance_(v, type_) and getattr_(v, "__module__", None) in saved:
                    try:
                        class_state.append((v, dict_(v.__dict__)))
                    except base_exc:
                        pass
    # The tests see private copies of those modules: a candidate that rebinds math.isclose while a
    # test runs (inside the function under test) changes the real module only.
    module_type = type_(sys)
    copies = {n: module_type(n) for n in saved}
    copy_state = []
    for n, m in saved.items():
        d = dict_(getattr_(m, "__dict__", None) or {})
        for k, v in list_(d.items()):
            if isinstance_(v, module_type) and getattr_(v, "__name__", None) in copies:
                d[k] = copies[v.__name__]
        dict_update(copies[n].__dict__, d)
        copy_state.append((copies[n].__dict__, d))
    real_import = builtins.__import__
    copies_get = copies.get

    def tests_import(name, globals=None, locals=None, fromlist=(), level=0):
        # The tests get the modules imported before the candidate existed, whatever the candidate
        # put in sys.modules or sys.meta_path since.
        if level == 0:
            mod = copies_get(name)
            top = copies_get(str_partition(name, ".")[0])
            if mod is not None and top is not None:
                if not fromlist:
                    return top
                if all(isinstance_(x, str_) and (copies_get(name + "." + x) is not None or x in mod.__dict__)
                       for x in fromlist):
                    return mod
        return real_import(name, globals, locals, fromlist, level)

    pristine = dict_(builtins.__dict__)
    pristine["__import__"] = tests_import
    test_builtins = dict_(pristine)

    def restore():
        dict_clear(test_builtins)
        dict_update(test_builtins, pristine)
        for d, snap in copy_state:
            dict_clear(d)
            dict_update(d, snap)
        for d, snap in module_state:
            dict_clear(d)
            dict_update(d, snap)
        for cls, snap in class_state:
            try:
                current = cls.__dict__
                for k in [k for k in current if k not in snap]:
                    delattr_(cls, k)
                for k, v in dict_items(snap):
                    if current.get(k) is not v:  # a mappingproxy: a built-in type, not patchable
                        setattr_(cls, k, v)
            except base_exc:  # noqa: BLE001 - an immutable attribute: nothing was changed there
                pass

    testcase = None
    if "unittest" in saved:
        testcase = saved["unittest"].TestCase
    # SIGINT's default Python handler raises KeyboardInterrupt wherever the harness happens to be.
    _signal = sys.modules.get("_signal")
    if _signal is not None:
        _signal.signal(2, 0)  # SIGINT -> SIG_DFL: the worker just dies, which fails the run
    _signal = None
    _purge_blocked_modules()
    _install_audit_hook()
    import _thread

    threads = _thread._count  # Python threads other than this one
    baseline_threads = threads()
    lingering = "failed: RuntimeError: a thread the candidate started is still running (it could change what the tests see)"

    ready()
    try:
        real_import("solution")
    except base_exc as e:  # noqa: BLE001 - SystemExit/KeyboardInterrupt from the candidate included
        for i in range_(n_tests):
            report(f"FAIL {i} " + one_line("importing solution failed: " + describe(e)))
        report("DONE " + done_token)
        exit_(0)
    restore()
    namespace = {"__name__": "tests", "__builtins__": test_builtins}
    try:
        exec_(code, namespace)
        targets = []
        for name in names:
            cls_name, _, meth = str_partition(name, ".")
            targets.append((namespace[cls_name], meth))
    except base_exc as e:  # noqa: BLE001
        for i in range_(n_tests):
            report(f"FAIL {i} " + one_line("loading tests failed: " + describe(e)))
        report("DONE " + done_token)
        exit_(0)
    namespace_snapshot = dict_(namespace)
    for i in range_(n_tests):
        obj, meth = targets[i]
        if threads() > baseline_threads:
            report(f"FAIL {i} {lingering}")
            continue
        restore()
        dict_clear(namespace)
        dict_update(namespace, namespace_snapshot)
        try:
            if meth:
                cls = obj
                if testcase is not None and isinstance_(cls, type_) and issubclass_(cls, testcase):
                    inst = cls(meth)
                else:
                    inst = cls()
                setup_fn = getattr_(inst, "setUp", None)
                if callable_(setup_fn):
                    setup_fn()
                try:
                    getattr_(inst, meth)()
                finally:
                    teardown = getattr_(inst, "tearDown", None)
                    if callable_(teardown):
                        teardown()
            else:
                obj()
        except base_exc as e:  # noqa: BLE001
            report(f"FAIL {i} " + one_line(describe(e)))
            continue
        if threads() > baseline_threads:
            report(f"FAIL {i} {lingering}")
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

    chunks = []
    while True:
        b = os.read(0, 1 << 16)
        if not b:
            break
        chunks.append(b)
    setup = marshal.loads(b"".join(chunks))
    chunks = None
    devnull = os.open("/dev/null", os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    nonce = setup["init_nonce"]

    def init_report(line):
        os.write(init_fd, f"{nonce} {line} {time.monotonic_ns()}\n".encode())

    init_report(f"START {t_start}")
    mode = setup["mode"]
    uid = setup["uid"]
    grader_uid = setup.get("grader_uid")
    strong = setup["strong"]
    libc = None
    test_imports = []
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
        if mode == "inproc":
            test_imports = setup["test_imports"]
        import resource  # noqa: F401 - imported while root: the stdlib may sit under a private dir
        import select
    except BaseException as e:  # noqa: BLE001 - any failure before the candidate runs is infrastructure
        init_report("SETUP_ERROR " + _one_line(f"{type(e).__name__}: {e}"))
        os._exit(2)

    def spawn(kind, run_as, argv=None, cwd=None, env=None):
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
                if cwd is not None:
                    os.chdir(cwd)
                keep = sorted({sw, result_fd} if kind in ("io", "inproc") else {sw})
                lo = 3
                for fd in keep:
                    os.closerange(lo, fd)
                    lo = fd + 1
                os.closerange(lo, 1 << 16)

                def ready():
                    os.close(sw)

                if kind == "io":
                    _worker_io(setup, result_fd, ready)
                elif kind == "inproc":
                    _worker_inproc(setup, result_fd, test_imports, ready)
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

    init_report("READY")
    if mode in ("io", "inproc"):
        pid, why = spawn(mode, uid)
        os.close(result_fd)
        if why:
            worker_failed(why)
        status = wait_with_deadline(pid, setup["phase_seconds"])
        init_report(status_line("WORKER", status))
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
        pid, why = spawn("shell", grader_uid, ["-c", setup["grader"]], cwd=gdir, env=genv)
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
