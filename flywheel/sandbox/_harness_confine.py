"""Confinement of the sandbox harness (:mod:`_sandbox_harness`), run by init as root: mounts (tmpfs
over the scratch directories, read-only binds of what must stay reachable), the seccomp filter of
candidate processes, rlimits, the uid drop, and the grader's clean environment (shell mode).

Loaded in the sandbox as a top-level module next to the harness (``python -I -S``: standard library
only).
"""

import os

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

