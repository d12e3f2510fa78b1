"""Trusted in-sandbox harness of :mod:`flywheel.sandbox` (runs as ``python -I -S _sandbox_harness.py``).

Never imported by the library; the supervisor executes this file directly, usually as pid 1 of fresh
pid/mount/network namespaces (``unshare``). Roles:

- **init (this process, root)**: reads the setup from the root-only directory given in argv (nonce,
  tests or grader, candidate), mounts size-limited tmpfs over ``/tmp`` and the other world-writable
  directories, creates the work dir ``/tmp/work`` owned by a throwaway uid, forks the **worker**, waits
  for it and reports the worker's exit status on the *init channel*, a file descriptor the worker closes
  before any candidate code runs. When init exits, the kernel kills every process left in the pid
  namespace (background processes cannot outlive the run).
- **worker (forked, unprivileged)**: drops to the throwaway uid, sets rlimits and ``no_new_privs``,
  installs an audit hook that refuses frame/gc/ctypes/``/proc/*/mem`` introspection, then runs the
  candidate: for ``python`` it imports ``solution`` and runs each test named by the supervisor, writing
  one ``<nonce> PASS|FAIL <index> <detail>`` line per test to the *test channel*; for ``shell`` it execs
  bash on the candidate script.

Everything the harness needs after candidate code starts is captured in local variables first, so a
candidate that monkeypatches modules (``os.write``, ``builtins``, ``json``) does not change what is
reported. The protocol is line-based text so no library code is on the reporting path.
"""

import os
import sys


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _mount_tmpfs(libc, target, size_mb, mode="1777"):
    import ctypes

    if not os.path.isdir(target):
        return
    opts = f"size={int(size_mb)}m,mode={mode}".encode()
    # MS_NOSUID | MS_NODEV (2 | 4): nothing set-uid or device-like can be planted in scratch space.
    if libc.mount(b"tmpfs", target.encode(), b"tmpfs", 2 | 4, opts) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount tmpfs on {target}: {os.strerror(err)}")


def _mount(libc, source, target, fstype, flags, data):
    import ctypes

    if libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags, data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _expose(libc, paths, staging):
    """Make ``paths`` (the interpreter's prefix) reachable by the sandbox uid even when an ancestor is
    private (pyenv under ``/root``, mode 0700): bind each path aside, cover the private ancestor with an
    empty tmpfs (which also hides everything else in it), and bind the paths back at their old names."""
    ms_bind, ms_rec = 4096, 16384
    covers = {}
    for p in paths:
        parts = p.strip("/").split("/")
        for i in range(1, len(parts)):
            anc = "/" + "/".join(parts[:i])
            if not (os.stat(anc).st_mode & 0o001):
                covers.setdefault(anc, []).append(p)
                break
    staged = []
    for anc, inner in covers.items():
        for p in inner:
            spot = os.path.join(staging, f"s{len(staged)}")
            os.mkdir(spot)
            _mount(libc, p, spot, None, ms_bind | ms_rec, None)
            staged.append((spot, p))
        _mount(libc, "tmpfs", anc, "tmpfs", 2 | 4, b"size=1m,mode=0755")
    for spot, p in staged:
        os.makedirs(p, exist_ok=True)
        _mount(libc, spot, p, None, ms_bind | ms_rec, None)


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


def _no_new_privs(libc):
    # PR_SET_NO_NEW_PRIVS = 38: set-uid binaries (su, mount, ...) cannot regain root after exec.
    libc.prctl(38, 1, 0, 0, 0)


def _install_audit_hook(fd_allow):
    """Refuse the introspection paths that would let candidate code read the nonce or rewrite the
    harness's frames. ValueError is the exception stdlib callers of ``sys._getframe`` (typing,
    collections.namedtuple, enum) already catch, so ordinary code keeps working."""
    blocked_get = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back"})
    blocked_set = frozenset({"__code__", "__globals__", "__class__"})
    blocked_events = frozenset(
        {
            "sys._getframe",
            "sys._current_frames",
            "sys.settrace",
            "sys.setprofile",
            "gc.get_objects",
            "gc.get_referrers",
            "gc.get_referents",
            "sys.addaudithook",
            "code.__new__",
            "function.__new__",
        }
    )
    realpath = os.path.realpath
    startswith = str.startswith
    endswith = str.endswith

    def hook(event, args, _fd=fd_allow):
        if event in blocked_events:
            raise ValueError(f"sandbox: {event} is not allowed")
        if startswith(event, "ctypes."):
            raise ValueError(f"sandbox: {event} is not allowed")
        if event == "object.__getattr__":
            if len(args) > 1 and args[1] in blocked_get:
                raise ValueError(f"sandbox: access to .{args[1]} is not allowed")
        elif event == "object.__setattr__":
            if len(args) > 1 and args[1] in blocked_set:
                raise ValueError(f"sandbox: setting .{args[1]} is not allowed")
        elif event == "open" and args and isinstance(args[0], str):
            p = realpath(args[0])
            if startswith(p, "/proc/") and (endswith(p, "/mem") or endswith(p, "/pagemap") or endswith(p, "/environ")):
                raise PermissionError(f"sandbox: opening {p} is not allowed")

    sys.addaudithook(hook)


def _one_line(text, limit=300):
    text = text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
    return text[:limit]


def _worker_python(setup, test_fd):
    """Runs in the forked worker, after privileges are dropped. Never returns."""
    write = os.write
    exit_ = os._exit
    getpid = os.getpid
    nonce = setup["nonce"]
    names = list(setup["tests"])
    test_source = setup["test_source"]
    my_pid = getpid()
    isinstance_ = isinstance
    type_ = type
    str_ = str
    repr_ = repr
    base_exc = BaseException
    one_line = _one_line

    def report(status, index, detail):
        # A forked copy of this process (candidate called os.fork) must not report: the supervisor
        # would otherwise see several records per test and brute-force guesses across forks.
        if getpid() != my_pid:
            exit_(0)
        try:
            write(test_fd, f"{nonce} {status} {index} {one_line(detail)}\n".encode("utf-8", "replace"))
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

    code = compile(test_source, "<tests>", "exec")
    sys.path[:0] = [setup["workdir"]]
    sys.dont_write_bytecode = True
    import importlib

    import_module = importlib.import_module
    testcase = None
    if any("." in n for n in names):
        import unittest

        testcase = unittest.TestCase
    callable_ = callable
    getattr_ = getattr
    issubclass_ = issubclass
    try:
        import_module("solution")
    except base_exc as e:  # noqa: BLE001 - SystemExit/KeyboardInterrupt from the candidate included
        for i in range(len(names)):
            report("FAIL", i, "importing solution failed: " + describe(e))
        report("DONE", -1, "")
        exit_(0)
    namespace = {"__name__": "tests"}
    try:
        exec(code, namespace)
    except base_exc as e:  # noqa: BLE001
        for i in range(len(names)):
            report("FAIL", i, "loading tests failed: " + describe(e))
        report("DONE", -1, "")
        exit_(0)
    for i, name in enumerate(names):
        try:
            if "." in name:
                cls_name, meth = name.split(".", 1)
                cls = namespace[cls_name]
                if testcase is not None and isinstance_(cls, type_) and issubclass_(cls, testcase):
                    obj = cls(meth)
                else:
                    obj = cls()
                setup_fn = getattr_(obj, "setUp", None)
                if callable_(setup_fn):
                    setup_fn()
                try:
                    getattr_(obj, meth)()
                finally:
                    teardown = getattr_(obj, "tearDown", None)
                    if callable_(teardown):
                        teardown()
            else:
                namespace[name]()
        except base_exc as e:  # noqa: BLE001
            report("FAIL", i, describe(e))
            continue
        report("PASS", i, "")
    report("DONE", -1, "")
    exit_(0)


def main():
    setup_dir, init_fd_s, test_fd_s = sys.argv[1], sys.argv[2], sys.argv[3]
    init_fd, test_fd = int(init_fd_s), int(test_fd_s)
    import json

    with open(os.path.join(setup_dir, "setup.json"), encoding="utf-8") as f:
        setup = json.load(f)
    nonce = setup["nonce"]

    def init_report(line):
        os.write(init_fd, f"{nonce} {line}\n".encode())

    try:
        with open(os.path.join(setup_dir, "candidate"), encoding="utf-8") as f:
            candidate = f.read()
        if setup["mode"] == "python":
            with open(os.path.join(setup_dir, "tests"), encoding="utf-8") as f:
                setup["test_source"] = f.read()
        else:
            with open(os.path.join(setup_dir, "grader"), encoding="utf-8") as f:
                grader = f.read()
        libc = _libc() if (setup["mount_tmpfs"] or setup["drop_to_uid"] is not None) else None
        uid = setup["drop_to_uid"]
        if setup["mount_tmpfs"]:
            _expose(libc, setup["expose"], setup_dir)
            # Hides the root-only setup dir (it lives under the host /tmp) and bounds what the candidate
            # can write in total, not only per file (RLIMIT_FSIZE).
            _mount_tmpfs(libc, "/tmp", setup["tmpfs_mb"])
            for extra in ("/var/tmp", "/dev/shm", "/run/lock"):
                _mount_tmpfs(libc, extra, 1)
            workdir = "/tmp/work"
        else:
            workdir = setup["fallback_workdir"]
        os.makedirs(workdir, exist_ok=True)
        name = "solution.py" if setup["mode"] == "python" else "candidate.sh"
        with open(os.path.join(workdir, name), "w", encoding="utf-8") as f:
            f.write(candidate)
        if uid is not None:
            os.chown(workdir, uid, uid)
            os.chown(os.path.join(workdir, name), uid, uid)
        os.chmod(workdir, 0o700)
        setup["workdir"] = workdir
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": workdir,
            "TMPDIR": "/tmp" if setup["mount_tmpfs"] else workdir,
            "LANG": "C.UTF-8",
            "PYTHONHASHSEED": "0",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        os.environ.clear()
        os.environ.update(env)
        os.chdir(workdir)
    except BaseException as e:  # noqa: BLE001 - any failure before the candidate runs is infrastructure
        init_report("SETUP_ERROR " + _one_line(f"{type(e).__name__}: {e}"))
        os._exit(2)

    def spawn(target_kind, payload):
        pid = os.fork()
        if pid == 0:
            try:
                os.close(init_fd)
                if uid is not None:
                    _drop_privileges(uid)
                if libc is not None:
                    _no_new_privs(libc)
                _set_limits(setup["limits"])
                if target_kind == "python":
                    os.closerange(3, test_fd)
                    os.closerange(test_fd + 1, 1 << 16)
                    _install_audit_hook(test_fd)
                    _worker_python(setup, test_fd)
                else:
                    os.closerange(3, 1 << 16)
                    os.execve("/bin/bash", ["bash", "--noprofile", "--norc", *payload], os.environ)
            except BaseException as e:  # noqa: BLE001
                try:
                    os.write(2, f"sandbox worker failed: {type(e).__name__}: {e}\n".encode())
                finally:
                    os._exit(4)
            os._exit(5)
        return pid

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
        # As pid 1 of the namespace, kill(-1) reaches every other process in it (all of them
        # unprivileged), including ones that called setsid() to leave the process group.
        if setup["pid_namespace"]:
            try:
                os.kill(-1, 9)
            except ProcessLookupError:
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

    import importlib  # noqa: F401
    import resource  # noqa: F401 - imported while root: the stdlib may sit under a private dir
    import select  # noqa: F401

    init_report("READY")
    if setup["mode"] == "python":
        pid = spawn("python", None)
        os.close(test_fd)
        status = wait_with_deadline(pid, setup["phase_seconds"])
        init_report(status_line("WORKER", status))
        kill_everyone_else()
    else:
        pid = spawn("shell", ["candidate.sh"])
        status = wait_with_deadline(pid, setup["phase_seconds"])
        init_report(status_line("CANDIDATE", status))
        kill_everyone_else()
        # The grader is restored from init's memory (it never lived in the writable tree) and runs
        # only after every candidate process is dead, so only the files the candidate left count.
        pid = spawn("shell", ["-c", grader])
        status = wait_with_deadline(pid, setup["phase_seconds"])
        init_report(status_line("GRADER", status))
        kill_everyone_else()
    init_report("END")
    os._exit(0)


if __name__ == "__main__":
    main()
