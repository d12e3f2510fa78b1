"""Trusted in-sandbox harness of :mod:`flywheel.sandbox`: init, the sandbox's first process.

Never imported by the library. The supervisor (:mod:`flywheel.sandbox.supervisor`) starts it as
``python -I -S -c <boot> init_fd result_fd``, usually as pid 1 of fresh pid/mount/ipc/network
namespaces (``unshare``); the boot line puts this directory on ``sys.path``, imports this module (from
its cached bytecode) and its siblings :mod:`_harness_codec`, :mod:`_harness_confine` and
:mod:`_harness_runner`, takes the directory off ``sys.path`` again and calls :func:`main`. Every
import happens there, before any mount can hide this directory (a checkout under ``/tmp``). The setup
(``marshal``, plain data) arrives on stdin -- never in a file or on the command line. Roles:

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
    module (:mod:`_harness_runner`), it alone holds the result channel, and a ``PASS`` record carries
    that test's token. No candidate object, builtin or class can enter the tests' interpreter (issue
    31, finding 2).
  - ``shell``: execs bash on the candidate script.

In ``io`` the driver binds what it needs before the candidate's import; a candidate that rebinds
module attributes (``os.write``, the harness's functions) changes only its own answers. Records are
``\\n``-terminated text lines; the proxy's pipe pair carries length-framed messages.

Init's records, ``<nonce> <TAG> ... <monotonic ns>``: ``START``, ``SETUP_ERROR``, ``SECCOMP``,
``READY``, ``WORKER_SETUP_ERROR``, ``WORKER``/``CANDIDATE``/``GRADER`` (``EXIT n``, ``SIGNAL n``,
``TIMEOUT``), ``GRADER_SETUP_ERROR``, ``GRADER_READY``, ``END``.
"""

import marshal
import os
import select
import sys
import time

from _harness_codec import (  # type: ignore[import-not-found]
    _decoder,
    _encoder,
    _one_line,
    _read_exact,
    _recv,
    _send,
)
from _harness_confine import (  # type: ignore[import-not-found]
    _PR_SET_DUMPABLE,
    _PR_SET_NO_NEW_PRIVS,
    _TMP_INODES,
    _drop_privileges,
    _expose,
    _grader_environment,
    _hold,
    _libc,
    _mount_tmpfs,
    _seccomp_filter,
    _set_limits,
)
from _harness_runner import _worker_tests  # type: ignore[import-not-found]


class _Init:
    """Init's state: the setup, its two channels, and what its setup step found (libc, the seccomp
    filter, the work dir)."""

    def __init__(self, init_fd, result_fd):
        self.init_fd, self.result_fd = init_fd, result_fd
        self.setup, self._secret_fd = _read_setup()
        self.nonce = self.setup["init_nonce"]
        self.strong = self.setup["strong"]
        self.libc = None
        self.seccomp_load, self.seccomp_why = None, None
        self.workdir = None

    def read_secret(self):
        """The rest of stdin: the part only the test runner may hold (the proxy path's tests and
        tokens), read only after the candidate's process was forked."""
        chunks = []
        while True:
            b = os.read(self._secret_fd, 1 << 16)
            if not b:
                break
            chunks.append(b)
        os.close(self._secret_fd)
        self.setup.update(marshal.loads(b"".join(chunks)))

    def report(self, line):
        os.write(self.init_fd, f"{self.nonce} {line} {time.monotonic_ns()}\n".encode())


def main():
    t_start = time.monotonic_ns()
    # The umask is inherited from the verifier's process; a restrictive one (0o077, set by some
    # libraries) would make the directories _expose creates untraversable for the sandbox uids.
    os.umask(0o022)
    init = _Init(int(sys.argv[1]), int(sys.argv[2]))
    mode = init.setup["mode"]
    if mode != "proxy":
        init.read_secret()
    init.report(f"START {t_start}")
    _prepare(init)
    init.report("SECCOMP " + ("on" if init.seccomp_load is not None
                              else "off " + _one_line(init.seccomp_why).replace(" ", "_")))
    init.report("READY")
    if mode == "io":
        _run_io(init)
    elif mode == "proxy":
        _run_proxy(init)
    else:
        _run_shell(init)
    init.report("END")
    os._exit(0)


# -------------------------------------------------------------------------- init's steps, in order


def _read_setup():
    """stdin: a framed public part, then the rest of the stream: the part only the test runner may
    hold (the proxy path's tests and tokens). Init reads the rest only after it forked the candidate's
    process, so that process never had the tests in its memory (a frame walk or ctypes read there
    finds none; issue 31, finding 2). Returns (setup, the descriptor the rest is read from)."""
    head = _read_exact(0, 8)
    setup = marshal.loads(_read_exact(0, int(head, 16)))
    secret_fd = os.dup(0)  # not in any worker's keep list: closed in every fork
    devnull = os.open("/dev/null", os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return setup, secret_fd


def _prepare(init):
    """Everything before a worker starts: the cgroup, the mounts, the candidate's files, a scrubbed
    environment, the seccomp filter. Any failure here is infrastructure (``SETUP_ERROR``)."""
    setup = init.setup
    try:
        _join_cgroup(setup)
        init.libc = _libc()
        init.workdir = _cover_scratch(init) if init.strong else setup["fallback_workdir"]
        _write_candidate(setup, init.workdir)
        _scrub_environment(init.workdir, init.strong)
        init.seccomp_load, init.seccomp_why = _seccomp_filter() if init.strong else (None, "weak mode")
        import resource  # noqa: F401 - imported while root: the stdlib may sit under a private dir
    except BaseException as e:  # noqa: BLE001 - any failure before the candidate runs is infrastructure
        init.report("SETUP_ERROR " + _one_line(f"{type(e).__name__}: {e}"))
        os._exit(2)


def _join_cgroup(setup):
    # The cgroup first: everything forked from here on is charged to it and counted by pids.max.
    for procs in setup["cgroup_procs"]:
        with open(procs, "w") as f:
            f.write("0")


def _cover_scratch(init):
    """Fresh tmpfs over ``/tmp`` and the other scratch dirs, the interpreter's dirs kept reachable,
    and the work dir ``/tmp/work``: a mount point of its own. Returns the work dir."""
    libc, setup = init.libc, init.setup
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
    return workdir


def _write_candidate(setup, workdir):
    """The candidate's file in the work dir, both owned by the candidate's uid, mode 0700."""
    os.makedirs(workdir, exist_ok=True)
    fname = "candidate.sh" if setup["mode"] == "shell" else "solution.py"
    with open(os.path.join(workdir, fname), "w", encoding="utf-8") as f:
        f.write(setup["candidate"])
    uid = setup["uid"]
    if uid is not None:
        os.chown(workdir, uid, uid)
        os.chown(os.path.join(workdir, fname), uid, uid)
    os.chmod(workdir, 0o700)
    setup["workdir"] = workdir


def _scrub_environment(workdir, strong):
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


# ------------------------------------------------------------------------------------ the phases


def _run_io(init):
    pid, why = _spawn(init, "io", init.setup["uid"], fds=(init.result_fd,))
    os.close(init.result_fd)
    if why:
        _worker_failed(init, why)
    status = _wait_with_deadline(pid, init.setup["phase_seconds"])
    init.report(_status_line("WORKER", status))
    _kill_everyone_else(init)


def _run_proxy(init):
    """Two processes, two uids: the candidate answers requests on one pipe pair; the tests run in the
    other process, which alone holds the result channel (issue 31, finding 2)."""
    setup = init.setup
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    t_phase = time.monotonic()
    server, why = _spawn(init, "server", setup["uid"], fds=(req_r, resp_w))
    if why:
        _worker_failed(init, why)
    init.read_secret()
    pid, why = _spawn(init, "tests", setup["runner_uid"], cwd="/", fds=(init.result_fd, req_w, resp_r),
                      confine=False)
    for fd in (req_r, req_w, resp_r, resp_w, init.result_fd):
        os.close(fd)
    if why:
        _worker_failed(init, why)
    status = _wait_with_deadline(pid, setup["phase_seconds"])
    init.report(_status_line("WORKER", status))
    # The candidate's own fate (a CPU limit, a signal) names why its tests failed. It sees end of
    # file once the runner is gone; one that lingers past that is killed without a record (its
    # answers are in already).
    left = max(0.0, min(1.0, setup["phase_seconds"] - (time.monotonic() - t_phase)))
    cstatus = _wait_with_deadline(server, left)
    if cstatus is not None:
        init.report(_status_line("CANDIDATE", cstatus))
    _kill_everyone_else(init)


def _run_shell(init):
    """The candidate's script, then -- once every candidate process is dead -- the grader."""
    pid, why = _spawn(init, "shell", init.setup["uid"], ["candidate.sh"])
    if why:
        _worker_failed(init, why)
    status = _wait_with_deadline(pid, init.setup["phase_seconds"])
    init.report(_status_line("CANDIDATE", status))
    _kill_everyone_else(init)
    _run_grader(init)


def _run_grader(init):
    setup = init.setup
    grader_uid = setup.get("grader_uid")
    try:
        gdir, genv = _grader_environment(init.libc, setup, init.workdir, init.strong, grader_uid)
    except BaseException as e:  # noqa: BLE001 - the grader could not be prepared: not the candidate's fault
        init.report("GRADER_SETUP_ERROR " + _one_line(f"{type(e).__name__}: {e}"))
        os._exit(2)
    init.report("GRADER_READY " + ("nosymfollow" if genv.pop("_NOSYMFOLLOW", "") else "symlinks"))
    # The grader comes from init's memory (it never lived in the writable tree) and runs only
    # after every candidate process is dead, so only the files the candidate left count.
    pid, why = _spawn(init, "shell", grader_uid, ["-c", setup["grader"]], cwd=gdir, env=genv, confine=False)
    if why:
        _worker_failed(init, "grader: " + why)
    status = _wait_with_deadline(pid, setup["phase_seconds"])
    init.report(_status_line("GRADER", status))
    _kill_everyone_else(init)


# ------------------------------------------------------------------- the candidate's processes
# The io driver and the proxy path's server run candidate code in a copy of this module: whatever the
# candidate rebinds here (os.write, these functions, sys.modules["_sandbox_harness"]) changes only its
# own answers.


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


# ------------------------------------------------------------------- starting and ending workers


def _spawn(init, kind, run_as, argv=None, cwd=None, env=None, fds=(), confine=True):
    """Fork a worker; returns (pid, None) once it is about to run candidate (or grader) code, or
    (pid, why) when it failed before that -- an infrastructure error, not the candidate's."""
    # Close-on-exec: an exec that works closes it silently; python workers close it themselves
    # right before importing the candidate; anything written to it is a setup failure.
    sr, sw = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        _worker_main(init, kind, run_as, argv, cwd, env, fds, confine, sr, sw)
    os.close(sw)
    try:
        got, _, _ = select.select([sr], [], [], init.setup["phase_seconds"])
        why = os.read(sr, 4096).decode(errors="replace") if got else "the worker did not start in time"
    finally:
        os.close(sr)
    return pid, (why or None)


def _worker_main(init, kind, run_as, argv, cwd, env, fds, confine, sr, sw):
    """The forked worker: confine itself, keep only its descriptors, run ``kind``. A failure before
    the candidate's (or grader's) code runs goes to ``sw`` for init to report. Never returns."""
    try:
        os.close(sr)
        os.close(init.init_fd)
        _confine(init, run_as, cwd, confine)
        keep = sorted({sw, *fds})
        lo = 3
        for fd in keep:
            os.closerange(lo, fd)
            lo = fd + 1
        os.closerange(lo, 1 << 16)

        def ready():
            os.close(sw)

        if kind == "io":
            _worker_io(init.setup, init.result_fd, ready)
        elif kind == "server":
            _worker_server(init.setup, fds[0], fds[1], ready)
        elif kind == "tests":
            _worker_tests(init.setup, fds[0], fds[1], fds[2], ready)
        else:
            os.execve("/bin/bash", ["bash", "--noprofile", "--norc", *argv], env or os.environ)
    except BaseException as e:  # noqa: BLE001
        try:
            os.write(sw, _one_line(f"{type(e).__name__}: {e}").encode())
        finally:
            os._exit(4)
    os._exit(5)


def _confine(init, run_as, cwd, confine):
    """The uid drop, ``no_new_privs``, non-dumpable, rlimits, and (candidate processes only: the
    grader and the test runner are trusted) the seccomp filter."""
    if run_as is not None:
        _drop_privileges(run_as)
    if init.libc is not None:
        init.libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # set-uid binaries cannot regain root
        init.libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)  # /proc/self/{mem,fd,...} become root-only
    _set_limits(init.setup["limits"])
    if confine and init.seccomp_load is not None:
        init.seccomp_load()
    if cwd is not None:
        os.chdir(cwd)


def _wait_with_deadline(pid, seconds):
    """The worker's wait status, or None when it ran past ``seconds`` (then it is killed)."""
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


def _kill_everyone_else(init):
    if init.strong:
        # As pid 1 of the namespace, kill(-1) reaches every other process in it (all of them
        # unprivileged), including ones that called setsid() to leave the process group.
        try:
            os.kill(-1, 9)
        except ProcessLookupError:
            pass
    else:
        me = os.getpid()
        for procs in init.setup["cgroup_procs"]:  # weak mode: the cgroup still knows every process
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


def _status_line(tag, status):
    if status is None:
        return f"{tag} TIMEOUT"
    if os.WIFSIGNALED(status):
        return f"{tag} SIGNAL {os.WTERMSIG(status)}"
    return f"{tag} EXIT {os.WEXITSTATUS(status)}"


def _worker_failed(init, why):
    init.report("WORKER_SETUP_ERROR " + _one_line(why))
    _kill_everyone_else(init)
    os._exit(2)


if __name__ == "__main__":
    main()
