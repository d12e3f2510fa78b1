"""What a finished sandbox run says, read by the supervisor from the records its harness left.

Init's records (``<nonce> <TAG> ... <monotonic ns>`` on the init channel) say whether the sandbox
started, how long each stage took and how each worker ended; the result channel holds what the
candidate's side wrote: the io driver's results (judged here against the plan's checks, values the
sandbox never saw) or the proxy runner's ``PASS``/``FAIL`` records with their tokens. A run passes only
on positive evidence; anything malformed, duplicated or forged on the result channel is tampering and
fails every test (see :mod:`flywheel.sandbox`).
"""

from __future__ import annotations

import hmac
import signal

from flywheel.io_grading import IOPlan, decode_value

_RECORD_LIMIT = 16 * 1024 * 1024  # bytes of result records read back (io results: up to 1 MiB each)


def _start_failure(init_recs: list[list[str]], stderr: str) -> str | None:
    """Why the run is an infrastructure error, or None: init never reached READY (unshare or python
    missing, a mount or the cgroup join refused), or a worker or the grader could not be set up."""
    if not any(r[0] == "READY" for r in init_recs):
        setup_err = next((" ".join(r[1:-1]) for r in init_recs if r[0] == "SETUP_ERROR"), None)
        why = setup_err or (stderr.strip().splitlines() or ["no output"])[-1]
        return f"sandbox did not start: {why}"
    for tag, what in (("WORKER_SETUP_ERROR", "start its worker"), ("GRADER_SETUP_ERROR", "prepare the grader")):
        err = next((" ".join(r[1:-1]) for r in init_recs if r[0] == tag), None)
        if err:
            return f"sandbox could not {what}: {err}"
    return None


def _seccomp_note(init_recs: list[list[str]]) -> str | None:
    """``report["seccomp"]``: what the candidate processes ran under, as init reported it."""
    sc = next((r for r in init_recs if r[0] == "SECCOMP" and len(r) >= 3), None)
    if sc is None:
        return None
    # candidate processes: no socket(AF_UNIX), no ptrace/mount/bpf/io_uring/...
    return ("socket(AF_UNIX) and kernel-surface syscalls denied" if sc[1] == "on"
            else "none: " + " ".join(sc[2:-1]).replace("_", " "))


def _stage_timings(init_recs: list[list[str]], t0: int, t_spawn: int, t_exit: int) -> dict[str, float]:
    """Milliseconds per stage: prepare, interpreter and namespaces, setup in the sandbox, run, teardown
    (those init's time stamps allow)."""
    timings: dict[str, float] = {}
    stamps = {r[0]: int(r[-1]) for r in init_recs if r[-1].isdigit()}
    start = next((int(r[1]) for r in init_recs if r[0] == "START" and r[1].isdigit()), None)
    timings["prepare"] = (t_spawn - t0) / 1e6
    if start is not None:
        timings["interpreter_and_namespaces"] = (start - t_spawn) / 1e6
        if "READY" in stamps:
            timings["setup_in_sandbox"] = (stamps["READY"] - start) / 1e6
    run_end = stamps.get("WORKER") or stamps.get("GRADER")
    if "READY" in stamps and run_end:
        timings["run"] = (run_end - stamps["READY"]) / 1e6
    if "END" in stamps:
        timings["teardown"] = (t_exit - stamps["END"]) / 1e6
    return timings


def _statuses(init_recs: list[list[str]]) -> dict[str, list[str]]:
    """How each of the run's processes ended, as trusted init observed it: ``WORKER``, ``CANDIDATE``,
    ``GRADER`` -> ``["EXIT", n]``, ``["SIGNAL", n]`` or ``["TIMEOUT"]``."""
    return {r[0]: r[1:-1] for r in init_recs if r[0] in ("WORKER", "CANDIDATE", "GRADER")}


def _killed_reason(statuses: dict[str, list[str]], cg_stats: dict, killed: str | None) -> str | None:
    """Why the run was cut short (``killed``: the supervisor's own wall clock), from init's deadline, a
    fatal signal, or the cgroup's OOM kills; None when nothing was."""
    for st in statuses.values():
        if st and st[0] == "TIMEOUT" and killed is None:
            killed = "wall_timeout"
        elif st and st[0] == "SIGNAL" and killed is None:
            sig = int(st[1])
            if sig == signal.SIGKILL and cg_stats.get("oom_kills"):
                killed = "memory_limit (cgroup)"
            else:
                killed = _signal_reason(sig)
    if killed is None and cg_stats.get("oom_kills"):
        killed = "memory_limit (cgroup): a process of the sandbox was killed"
    return killed


def _grade_shell(grader: list[str] | None, per_test: dict[str, str]) -> dict[str, str]:
    """The shell path's single test: the grader's exit status as init saw it (0 passes)."""
    if grader == ["EXIT", "0"]:
        per_test["grader"] = "passed"
    elif grader:
        per_test["grader"] = "failed: grader " + " ".join(grader).lower()
    return per_test


def _judge_io(plan: IOPlan, raw: str, worker: list[str] | None) -> tuple[dict[str, str], list[str]]:
    """Decode the driver's lines and apply the plan's checks. The lines were written by the
    candidate's process: anything malformed, duplicated or out of range is tampering."""
    integrity: list[str] = []
    load_error: str | None = None
    loaded = False
    results: dict[int, tuple[str, object]] = {}
    n = len(plan.calls)
    # Records are "\n"-terminated; splitlines() would also break at \x0c, \u2028, ... inside a record
    # (issue 31, finding 10). The harness escapes all of those in what it writes.
    for line in raw.split("\n"):
        if not line:
            continue
        head, _, rest = line.partition(" ")
        try:
            if head == "L" and not loaded and not results:
                loaded = True
                status, _, payload = rest.partition(" ")
                if status == "raise":
                    mro, msg = _decode_raise(payload)
                    load_error = f"{mro[0] if mro else 'exception'}: {msg}"
                elif status != "ok" or payload:
                    raise ValueError("malformed load record")
            elif head == "R" and loaded and load_error is None:
                idx_s, _, rest2 = rest.partition(" ")
                status, _, payload = rest2.partition(" ")
                if not idx_s.isdigit() or int(idx_s) >= n:
                    raise ValueError(f"result for unknown call {idx_s[:20]!r}")
                idx = int(idx_s)
                if idx in results:
                    raise ValueError(f"second result for call {idx}")
                if status == "ok":
                    results[idx] = ("ok", decode_value(payload))
                elif status == "raise":
                    results[idx] = ("raise", _decode_raise(payload))
                elif status == "bad":
                    why = decode_value(payload)
                    if not isinstance(why, str):
                        raise ValueError("malformed bad record")
                    results[idx] = ("bad", why[:200])
                else:
                    raise ValueError(f"unknown result status {status[:20]!r}")
            else:
                raise ValueError(f"unexpected record {line[:40]!r}")
        except ValueError as e:
            integrity.append(str(e))
    if not loaded and not integrity:
        load_error = "the candidate's process ended before importing solution" + (
            f" (worker {' '.join(worker).lower()})" if worker else "")
    return plan.judge(load_error, results), integrity


def _decode_raise(payload: str) -> tuple[list[str], str]:
    v = decode_value(payload)
    if not (isinstance(v, list) and len(v) == 2 and isinstance(v[0], list) and isinstance(v[1], str)
            and all(isinstance(x, str) for x in v[0])):
        raise ValueError("malformed raise record")
    return [x[:100] for x in v[0][:16]], v[1][:1000]


def _judge_inproc(names: list[str], tokens: list[str], done_token: str, raw: str,
                  per_test: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    integrity: list[str] = []
    seen: set[int] = set()
    done = False
    for line in raw.split("\n"):  # one record per "\n" only, as in _judge_io
        if not line:
            continue
        parts = line.split(" ", 2)
        kind = parts[0]
        if kind == "DONE" and len(parts) == 2 and not done and hmac.compare_digest(parts[1], done_token):
            done = True
            continue
        if kind in ("PASS", "FAIL") and len(parts) >= 2 and parts[1].isdigit() and int(parts[1]) < len(names) and not done:
            idx = int(parts[1])
            if idx in seen:
                integrity.append(f"second record for {names[idx]}")
                continue
            seen.add(idx)
            if kind == "PASS":
                if len(parts) == 3 and hmac.compare_digest(parts[2], tokens[idx]):
                    per_test[names[idx]] = "passed"
                else:
                    integrity.append(f"PASS record for {names[idx]} without its token")
            else:
                per_test[names[idx]] = "failed: " + (parts[2] if len(parts) > 2 else "")
            continue
        integrity.append(f"unexpected record {line[:40]!r}")
    if not done and not integrity:
        for n in names:
            if per_test[n] == "passed":
                per_test[n] = "failed: the harness did not finish (no DONE record)"
    return per_test, integrity


def _records(f, nonce: str) -> list[list[str]]:
    f.seek(0)
    out = []
    for line in f.read(_RECORD_LIMIT).decode("utf-8", errors="replace").split("\n"):
        parts = line.split(" ")
        if len(parts) >= 3 and parts[0] == nonce:
            out.append(parts[1:])
    return out


def _signal_reason(sig: int) -> str:
    names = {
        int(signal.SIGXCPU): "cpu_time_limit",
        int(signal.SIGXFSZ): "file_size_limit",
        int(signal.SIGKILL): "killed (cpu hard limit, memory, or timeout)",
        int(signal.SIGSEGV): "segfault (often the address-space limit)",
    }
    try:
        default = f"signal {signal.Signals(sig).name}"
    except ValueError:
        default = f"signal {sig}"
    return names.get(sig, default)
