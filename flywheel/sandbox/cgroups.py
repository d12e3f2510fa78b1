"""Cgroups of sandbox runs: which hierarchy bounds a run as a group on this machine, and one run's cgroup.

``sandbox.cgroup``: the supervisor creates ``flywheel-sbx-*`` under its own cgroup, with cgroup v2
(``memory.max``, ``memory.swap.max = 0``, ``pids.max``) where the unified hierarchy has the memory and
pids controllers, else with the v1 memory and pids hierarchies. ``sandbox.cpus`` caps the CPU bandwidth
of all the run's processes together (v2 ``cpu.max``, else a v1 ``cpu`` hierarchy's
``cpu.cfs_quota_us``). Each kind of support is probed once per process by creating and removing a
test cgroup; :func:`cgroup_support` says what was found, or why nothing was.
"""

from __future__ import annotations

import functools
import os
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path

_CG_PREFIX = "flywheel-sbx-"


def _mounts() -> list[tuple[str, str, str]]:
    """(mount point, fstype, options) of every mount, from /proc/self/mounts (octal escapes undone)."""
    out = []
    try:
        text = Path("/proc/self/mounts").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4:
            point = parts[1].encode().decode("unicode_escape")
            out.append((point, parts[2], parts[3]))
    return out


def _own_cgroups() -> dict[str, str]:
    """Controller (``"0"`` for the unified hierarchy) -> this process's cgroup path."""
    out: dict[str, str] = {}
    try:
        text = Path("/proc/self/cgroup").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and controllers == "":
            out["0"] = path
        for c in controllers.split(","):
            if c:
                out[c] = path
    return out


def _try_child(parent: Path, files: dict[str, str]) -> str | None:
    """Create a child cgroup, write ``files`` in it, remove it. None when that worked, else why not."""
    probe = parent / f"{_CG_PREFIX}probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        probe.mkdir()
    except OSError as e:
        return f"cannot create a cgroup under {parent} ({e.strerror})"
    try:
        for name, value in files.items():
            (probe / name).write_text(value)
    except OSError as e:
        return f"cannot set {name} under {parent} ({e.strerror})"
    finally:
        try:
            probe.rmdir()
        except OSError:
            pass
    return None


def _sweep(parent: Path) -> None:
    """Remove empty sandbox cgroups whose supervisor died (a crash between create and remove)."""
    try:
        entries = list(parent.iterdir())
    except OSError:
        return
    for d in entries:
        if not d.name.startswith(_CG_PREFIX):
            continue
        pid = d.name[len(_CG_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            try:
                d.rmdir()
            except OSError:
                pass


@dataclass(frozen=True)
class _CgroupSupport:
    version: int  # 2, 1 or 0 (none)
    parents: dict[str, Path]  # v2: {"unified": dir}; v1: {"memory": dir, "pids": dir}
    describe: str


@functools.lru_cache(maxsize=1)
def _cgroup_support() -> _CgroupSupport:
    if os.name != "posix":
        return _CgroupSupport(0, {}, "none: not a POSIX system")
    mounts = _mounts()
    own = _own_cgroups()
    why: list[str] = []
    v2 = next((Path(p) for p, fs, _ in mounts if fs == "cgroup2"), None)
    if v2 is not None and "0" in own:
        parent = v2 / own["0"].lstrip("/")
        try:
            controllers = (parent / "cgroup.controllers").read_text().split()
        except OSError as e:
            controllers = []
            why.append(f"cgroup2 at {v2}: {e.strerror}")
        missing = [c for c in ("memory", "pids") if c not in controllers]
        if missing:
            if controllers or not why:
                why.append(f"cgroup2 at {v2} has no {'/'.join(missing)} controller in {parent} "
                           "(bound to cgroup v1, or not delegated)")
        else:
            sub = (parent / "cgroup.subtree_control").read_text().split()
            if not {"memory", "pids"} <= set(sub):
                try:
                    (parent / "cgroup.subtree_control").write_text("+memory +pids")
                except OSError as e:
                    why.append(f"cgroup2 at {v2}: cannot enable memory/pids for children of {parent} "
                               f"({e.strerror}; a cgroup that holds processes cannot delegate them)")
            if not why:
                err = _try_child(parent, {"memory.max": str(64 << 20), "pids.max": "64"})
                if err is None:
                    _sweep(parent)
                    return _CgroupSupport(2, {"unified": parent}, f"v2: memory.max + pids.max under {parent}")
                why.append(f"cgroup2: {err}")
    elif v2 is None:
        why.append("no cgroup2 mount")
    v1: dict[str, Path] = {}
    for ctl, limit_file in (("memory", "memory.limit_in_bytes"), ("pids", "pids.max")):
        point = next((Path(p) for p, fs, opts in mounts if fs == "cgroup" and ctl in opts.split(",")), None)
        if point is None or ctl not in own:
            why.append(f"no cgroup v1 {ctl} hierarchy")
            continue
        parent = point / own[ctl].lstrip("/")
        err = _try_child(parent, {limit_file: str(64 << 20) if ctl == "memory" else "64"})
        if err is None:
            v1[ctl] = parent
            _sweep(parent)
        else:
            why.append(f"cgroup v1 {ctl}: {err}")
    if "memory" in v1:
        names = " + ".join(["memory.limit_in_bytes"] + (["pids.max"] if "pids" in v1 else []))
        return _CgroupSupport(1, v1, f"v1: {names} under {', '.join(str(p) for p in v1.values())}")
    return _CgroupSupport(0, {}, "none: " + "; ".join(why))


# CPU bandwidth period (microseconds): the kernel's default; quota = sandbox.cpus x this.
_CPU_PERIOD_US = 100_000


@functools.lru_cache(maxsize=1)
def _cpu_support() -> _CgroupSupport:
    """Where a run's CPU bandwidth can be capped: v2 ``cpu.max`` in the unified parent used for
    memory/pids, else a v1 ``cpu`` hierarchy (``cpu.cfs_quota_us``), else none (and why). Probed once
    by creating and removing a test cgroup."""
    mem = _cgroup_support()
    if mem.version == 2:
        parent = mem.parents["unified"]
        try:
            if "cpu" not in (parent / "cgroup.subtree_control").read_text().split():
                (parent / "cgroup.subtree_control").write_text("+cpu")
        except OSError as e:
            return _CgroupSupport(0, {}, f"none: cannot enable cpu for children of {parent} ({e.strerror})")
        return _CgroupSupport(2, {"unified": parent}, "cpu.max")
    own = _own_cgroups()
    point = next((Path(p) for p, fs, opts in _mounts() if fs == "cgroup" and "cpu" in opts.split(",")), None)
    if point is None or "cpu" not in own:
        return _CgroupSupport(0, {}, "none: no cgroup v1 cpu hierarchy and no cgroup v2 with memory/pids")
    parent = point / own["cpu"].lstrip("/")
    err = _try_child(parent, {"cpu.cfs_period_us": str(_CPU_PERIOD_US), "cpu.cfs_quota_us": str(_CPU_PERIOD_US)})
    if err is not None:
        return _CgroupSupport(0, {}, f"none: cgroup v1 cpu: {err}")
    _sweep(parent)
    return _CgroupSupport(1, {"cpu": parent}, "cpu.cfs_quota_us")


def cgroup_support() -> str:
    """How sandbox runs are bounded as a group on this machine: ``"v2: ..."``, ``"v1: ..."`` or
    ``"none: <why>"`` (probed once per process by creating and removing a test cgroup)."""
    return _cgroup_support().describe


class _Cgroup:
    """One run's cgroup (a directory per hierarchy)."""

    def __init__(self, support: _CgroupSupport, memory_bytes: int, pids: int,
                 cpu: _CgroupSupport | None = None, cpus: float = 0.0):
        self.version = support.version
        name = f"{_CG_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        self.dirs: list[Path] = []
        try:
            # CPU bandwidth of the whole run (issue 31, finding 13): without it RLIMIT_CPU bounds each
            # process only, and max_processes of them share no budget.
            quota = f"{max(1000, int(cpus * _CPU_PERIOD_US))}"
            if cpu is not None and cpu.version == 1 and cpus > 0:
                d = cpu.parents["cpu"] / name
                d.mkdir()
                self.dirs.append(d)
                (d / "cpu.cfs_period_us").write_text(str(_CPU_PERIOD_US))
                (d / "cpu.cfs_quota_us").write_text(quota)
            for parent in support.parents.values():
                d = parent / name
                d.mkdir()
                self.dirs.append(d)
            if self.version == 2:
                d = self.dirs[-1]
                if cpu is not None and cpu.version == 2 and cpus > 0:
                    (d / "cpu.max").write_text(f"{quota} {_CPU_PERIOD_US}")
                (d / "memory.max").write_text(str(memory_bytes))
                if (d / "memory.swap.max").exists():
                    (d / "memory.swap.max").write_text("0")
                (d / "pids.max").write_text(str(pids))
            else:
                for d in self.dirs:
                    if (d / "memory.limit_in_bytes").exists():
                        (d / "memory.limit_in_bytes").write_text(str(memory_bytes))
                        if (d / "memory.memsw.limit_in_bytes").exists():
                            (d / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
                    if (d / "pids.max").exists():
                        (d / "pids.max").write_text(str(pids))
        except OSError:
            self.remove()
            raise

    @property
    def procs(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def stats(self) -> dict[str, int]:
        out = {"oom_kills": 0, "pids_max_hits": 0, "memory_peak_bytes": 0}
        for d in self.dirs:
            for fname, key, out_key in (
                ("memory.events", "oom_kill", "oom_kills"),
                ("memory.oom_control", "oom_kill", "oom_kills"),
                ("pids.events", "max", "pids_max_hits"),
            ):
                try:
                    for line in (d / fname).read_text().splitlines():
                        k, _, v = line.partition(" ")
                        if k == key and v.strip().isdigit():
                            out[out_key] += int(v)
                except OSError:
                    pass
            for fname in ("memory.peak", "memory.max_usage_in_bytes"):
                try:
                    out["memory_peak_bytes"] = max(out["memory_peak_bytes"], int((d / fname).read_text()))
                except (OSError, ValueError):
                    pass
        return out

    def remove(self) -> str | None:
        """Kill whatever is left and remove the directories; a note when one could not be removed."""
        deadline = time.monotonic() + 2.0
        left = []
        for d in self.dirs:
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        left.append(str(d))
                        break
                    self._kill(d)
                    time.sleep(0.001)
        return f"cgroup not removed: {', '.join(left)}" if left else None

    @staticmethod
    def _kill(d: Path) -> None:
        try:
            (d / "cgroup.kill").write_text("1")
            return
        except OSError:
            pass
        try:
            pids = (d / "cgroup.procs").read_text().split()
        except OSError:
            return
        for p in pids:
            try:
                os.kill(int(p), signal.SIGKILL)
            except (OSError, ValueError):
                pass

