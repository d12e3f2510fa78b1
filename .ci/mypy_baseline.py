#!/usr/bin/env python3
"""The type check of `make lint`: mypy on the package, against a baseline that may only shrink.

    python .ci/mypy_baseline.py            # check (make lint): fail on any error the baseline lacks
    python .ci/mypy_baseline.py --update   # rewrite the baseline (make lint-baseline); refuses to grow
                                           # it unless --allow-grow (ALLOW_GROW=1 in make)

mypy runs on the package in its *installed* layout. pyproject.toml's ``[tool.setuptools] package-dir``
maps flows/, kernels/, schemas/ and warehouse/ to ``flywheel.flows`` ... and the editable install
reaches them through an import hook that mypy does not run, so ``mypy -p flywheel`` from the repository
root would miss them (and every import of them). The script builds a tree of symlinks in that layout
(``.mypy_cache/layout/flywheel/...``, the files themselves stay where they are, so mypy's incremental
cache in .mypy_cache keeps working) and runs ``mypy -p flywheel`` there with the root's mypy.ini.

Errors are counted per (file, error code), not per line, so that editing a file elsewhere does not
churn the baseline; paths are relative to the repository root (``kernels/fused_logprob.py``, not the
staged path). The baseline (.ci/mypy-baseline.txt) holds sorted ``path:code count`` lines. A count above
its baseline, or a key the baseline lacks, fails the check with the list; fewer errors pass with a hint
to run ``make lint-baseline`` so that the baseline follows them down.

The check also prints how many function parameters are annotated ``Any`` in flywheel/ and in each core
package (issue 33 tracks them: under 40 in the core packages is the goal).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / ".ci" / "mypy-baseline.txt"
CONFIG = ROOT / "mypy.ini"
CACHE = ROOT / ".mypy_cache"
LAYOUT = CACHE / "layout"
PACKAGE = "flywheel"
# Strict in mypy.ini; the Any-parameter count is reported for each of them.
CORE = ("flywheel.vocab", "flywheel.config", "flywheel.events", "flywheel.store", "flywheel.stats",
        "flywheel.lineage", "flywheel.versioning")

Key = tuple[str, str]  # (path relative to the repository root, mypy error code)

# path:line[:column]: error: message  [code]   (mypy's default output, with or without columns)
_ERROR = re.compile(r"^(?P<path>[^:\n]+?):(?P<line>\d+)(?::\d+)?(?::\d+:\d+)?: error: (?P<msg>.*?)"
                    r"(?:  \[(?P<code>[a-z0-9-]+)\])?\s*$")
_SUMMARY = re.compile(r"^Found (?P<n>\d+) errors? in \d+ files?")
NO_CODE = "no-code"


# --- parsing and comparing (pure) -----------------------------------------------------------------


def parse_mypy_output(lines: Iterable[str], path_map: Mapping[str, str] | None = None) -> Counter[Key]:
    """Count mypy's ``error:`` lines by (file, error code); notes and the summary are skipped.

    ``path_map`` maps a staged path prefix to the repository's (``"flywheel/kernels/"`` ->
    ``"kernels/"``); the longest matching prefix wins.
    """
    prefixes = sorted((path_map or {}).items(), key=lambda kv: len(kv[0]), reverse=True)
    counts: Counter[Key] = Counter()
    for line in lines:
        m = _ERROR.match(line.rstrip("\n"))
        if not m:
            continue
        path = m["path"].replace("\\", "/")
        for staged, real in prefixes:
            if path.startswith(staged):
                path = real + path[len(staged):]
                break
        counts[(path, m["code"] or NO_CODE)] += 1
    return counts


def summary_count(lines: Iterable[str]) -> int | None:
    """The N of mypy's closing ``Found N errors in M files`` line (None when there is none)."""
    for line in lines:
        m = _SUMMARY.match(line)
        if m:
            return int(m["n"])
    return None


def format_baseline(counts: Mapping[Key, int]) -> str:
    rows = sorted((path, code, n) for (path, code), n in counts.items() if n > 0)
    return "".join(f"{path}:{code} {n}\n" for path, code, n in rows)


def parse_baseline(text: str) -> Counter[Key]:
    counts: Counter[Key] = Counter()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            key, n = line.rsplit(" ", 1)
            path, code = key.rsplit(":", 1)
            counts[(path, code)] += int(n)
        except ValueError:
            raise ValueError(f"baseline line {number} is not 'path:code count': {raw!r}") from None
    return counts


@dataclass
class Comparison:
    new: list[tuple[Key, int, int]] = field(default_factory=list)  # (key, baseline, now): now > baseline
    shrunk: list[tuple[Key, int, int]] = field(default_factory=list)  # now < baseline
    total_now: int = 0
    total_baseline: int = 0

    @property
    def ok(self) -> bool:
        return not self.new


def compare(now: Mapping[Key, int], baseline: Mapping[Key, int]) -> Comparison:
    result = Comparison(total_now=sum(now.values()), total_baseline=sum(baseline.values()))
    for key in sorted(set(now) | set(baseline)):
        n, b = now.get(key, 0), baseline.get(key, 0)
        if n > b:
            result.new.append((key, b, n))
        elif n < b:
            result.shrunk.append((key, b, n))
    return result


def report(cmp: Comparison, now_lines: Iterable[str] = ()) -> str:
    """What the check prints: the new errors (with mypy's own lines for their keys), or the hint."""
    out: list[str] = []
    if cmp.new:
        out.append(f"mypy: {len(cmp.new)} (file, code) pair(s) have more errors than .ci/mypy-baseline.txt "
                   f"allows — fix them (the baseline may only shrink):")
        for (path, code), b, n in cmp.new:
            out.append(f"  {path} [{code}]: {n} error(s), baseline {b}")
        keys = {key for key, _, _ in cmp.new}
        shown = [line for line in now_lines if _line_key(line) in keys]
        if shown:
            out.append("mypy's lines for them (the new ones are among these):")
            out.extend(f"  {line.rstrip()}" for line in shown)
    else:
        out.append(f"mypy: {cmp.total_now} error(s), none beyond the baseline ({cmp.total_baseline}).")
    if cmp.shrunk:
        fixed = sum(b - n for _, b, n in cmp.shrunk)
        out.append(f"mypy: {fixed} fewer error(s) than the baseline in {len(cmp.shrunk)} (file, code) "
                   f"pair(s): run `make lint-baseline` to lower it and commit .ci/mypy-baseline.txt.")
    return "\n".join(out)


def _line_key(line: str) -> Key | None:
    m = _ERROR.match(line.rstrip("\n"))
    return (m["path"], m["code"] or NO_CODE) if m else None


def growth(now: Mapping[Key, int], baseline: Mapping[Key, int]) -> list[tuple[Key, int, int]]:
    """Keys whose count `--update` would raise (the baseline may only shrink)."""
    return compare(now, baseline).new


# --- Any in parameters ----------------------------------------------------------------------------


def _is_any(ann: ast.expr | None) -> bool:
    if ann is None:
        return False
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):  # "Any" as a string
        try:
            ann = ast.parse(ann.value, mode="eval").body
        except SyntaxError:
            return False
    return (isinstance(ann, ast.Name) and ann.id == "Any") or (
        isinstance(ann, ast.Attribute) and ann.attr == "Any"
        and isinstance(ann.value, ast.Name) and ann.value.id in {"typing", "t"})


def count_any_params(source: str) -> int:
    """Function parameters (self, *args and **kwargs included) annotated exactly ``Any``."""
    tree = ast.parse(source)
    n = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(p for p in (a.vararg, a.kwarg) if p)]
            n += sum(_is_any(p.annotation) for p in params)
    return n


def module_files(mapping: Mapping[str, str], root: Path = ROOT) -> dict[str, Path]:
    """Module name -> file, for every .py of the package in its installed layout."""
    files: dict[str, Path] = {}
    for package, folder in sorted(mapping.items(), key=lambda kv: kv[0].count(".")):
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join([package, *parts])] = path
    return files


def any_param_counts(files: Mapping[str, Path], core: Iterable[str] = CORE) -> tuple[int, dict[str, int]]:
    per_module = {}
    for name, path in files.items():
        try:
            per_module[name] = count_any_params(path.read_text())
        except (SyntaxError, UnicodeDecodeError):
            per_module[name] = 0
    per_core = {c: sum(n for m, n in per_module.items() if m == c or m.startswith(c + ".")) for c in core}
    return sum(per_module.values()), per_core


# --- running mypy ---------------------------------------------------------------------------------


def package_dirs(root: Path = ROOT) -> dict[str, str]:
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {k: v for k, v in setuptools.get("package-dir", {}).items() if k.split(".")[0] == PACKAGE}


def stage_layout(mapping: Mapping[str, str], dest: Path = LAYOUT, root: Path = ROOT) -> dict[str, str]:
    """Rebuild ``dest`` as symlinks in the installed layout; return staged path prefix -> repo prefix."""
    if dest.exists():
        shutil.rmtree(dest)  # symlinks are removed, never followed
    dest.mkdir(parents=True)
    path_map: dict[str, str] = {}
    for package, folder in sorted(mapping.items(), key=lambda kv: kv[0].count(".")):
        target = dest.joinpath(*package.split("."))
        _unfold(target.parent, dest)
        if target.is_symlink():
            target.unlink()
        if package == PACKAGE or target.parent == dest:
            target.mkdir(exist_ok=True)
            for entry in sorted((root / folder).iterdir()):
                if entry.name != "__pycache__" and not (target / entry.name).exists():
                    (target / entry.name).symlink_to(entry)
        else:
            target.symlink_to(root / folder, target_is_directory=True)
        staged = "/".join(package.split(".")) + "/"
        path_map[staged] = "" if folder in ("", ".") else folder.rstrip("/") + "/"
    return path_map


def _unfold(directory: Path, stop: Path) -> None:
    """Make ``directory`` (under ``stop``) a real directory whose entries link to the symlink's."""
    if directory == stop or not directory.is_relative_to(stop):
        return
    _unfold(directory.parent, stop)
    if directory.is_symlink():
        real = directory.resolve()
        directory.unlink()
        directory.mkdir()
        for entry in sorted(real.iterdir()):
            if entry.name != "__pycache__":
                (directory / entry.name).symlink_to(entry)
    else:
        directory.mkdir(exist_ok=True)


def run_mypy(cwd: Path, package: str = PACKAGE, config: Path = CONFIG,
             cache: Path = CACHE) -> tuple[int, list[str]]:
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(config), "--cache-dir", str(cache),
           "--show-error-codes", "--no-color-output", "--no-pretty", "-p", package]
    env = {**os.environ, "MYPY_FORCE_COLOR": "0"}
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    return res.returncode, (res.stdout + res.stderr).splitlines()


# --- main -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--update", action="store_true", help="rewrite the baseline (make lint-baseline)")
    ap.add_argument("--allow-grow", action="store_true", default=os.environ.get("ALLOW_GROW") == "1",
                    help="let --update raise counts or add keys (default: ALLOW_GROW=1 in the environment)")
    ap.add_argument("--baseline", type=Path, default=BASELINE)
    args = ap.parse_args(argv)

    mapping = package_dirs()
    path_map = stage_layout(mapping)
    start = time.monotonic()
    rc, lines = run_mypy(LAYOUT)
    elapsed = time.monotonic() - start
    now = parse_mypy_output(lines, path_map)
    total, per_core = any_param_counts(module_files(mapping))
    print(f"mypy: checked {PACKAGE} (installed layout) in {elapsed:.0f}s")
    print(f"Any-annotated parameters: {total} in {PACKAGE}/ overall, {sum(per_core.values())} in the core "
          f"packages (goal: under 40): " + ", ".join(f"{c} {n}" for c, n in per_core.items()))

    # mypy exits 1 for type errors; anything else (2: a crash, bad config, a blocking syntax error) or an
    # error count that our parser did not see is a broken check, never a pass.
    summary = summary_count(lines)
    if rc not in (0, 1) or (rc == 1 and not now) or (summary is not None and summary != sum(now.values())):
        print("\n".join(lines[-40:]))
        print(f"mypy: the type check itself failed (exit {rc}, {sum(now.values())} error lines parsed, "
              f"summary says {summary})", file=sys.stderr)
        return 2

    baseline = parse_baseline(args.baseline.read_text()) if args.baseline.exists() else Counter()
    if args.update:
        grown = growth(now, baseline)
        if grown and not args.allow_grow and args.baseline.exists():
            print(report(Comparison(new=grown), lines))
            print("mypy: refusing to grow the baseline; fix these or rerun with ALLOW_GROW=1 "
                  "(make lint-baseline ALLOW_GROW=1)", file=sys.stderr)
            return 1
        args.baseline.write_text(format_baseline(now))
        shown = args.baseline.relative_to(ROOT) if args.baseline.is_relative_to(ROOT) else args.baseline
        print(f"mypy: wrote {shown} ({sum(now.values())} errors in {len(now)} (file, code) pairs; "
              f"was {sum(baseline.values())})")
        return 0

    cmp = compare(now, baseline)
    print(report(cmp, _repo_paths(lines, path_map)))
    return 0 if cmp.ok else 1


def _repo_paths(lines: list[str], path_map: Mapping[str, str]) -> list[str]:
    prefixes = sorted(path_map.items(), key=lambda kv: len(kv[0]), reverse=True)
    out = []
    for line in lines:
        for staged, real in prefixes:
            if line.startswith(staged):
                line = real + line[len(staged):]
                break
        out.append(line)
    return out


if __name__ == "__main__":
    sys.exit(main())
