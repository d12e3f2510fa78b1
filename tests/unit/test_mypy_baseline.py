"""The type check of `make lint` (.ci/mypy_baseline.py): mypy's errors counted by (file, error code)
against .ci/mypy-baseline.txt, which may only shrink.

The comparison is tested on hand-written mypy output; mypy itself runs only in the one `slow` test, on
a tiny package with a planted error.
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("mypy_baseline", ROOT / ".ci" / "mypy_baseline.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up while the class is built
    spec.loader.exec_module(mod)
    return mod


mb = _load()

OUTPUT = """\
flywheel/store.py:751: error: "EventStore" has no attribute "entity_heads"  [attr-defined]
flywheel/store.py:760: error: "EventStore" has no attribute "read"  [attr-defined]
flywheel/store.py:12:5: error: Argument 1 to "f" has incompatible type "int"; expected "str"  [arg-type]
flywheel/store.py:760: note: See https://mypy.rtfd.io/en/stable/_refs.html#code-attr-defined for more info
flywheel/kernels/fused_logprob.py:40: error: Function is missing a type annotation  [no-untyped-def]
flywheel/flows/cycle.py:3: error: Name "x" already defined on line 2  [no-redef]
flywheel/cli/core.py:9: error: An error without a code
Found 6 errors in 4 files (checked 212 source files)
"""
PATH_MAP = {"flywheel/": "flywheel/", "flywheel/kernels/": "kernels/", "flywheel/flows/": "flows/"}


def test_errors_are_counted_by_file_and_code_with_repository_paths():
    counts = mb.parse_mypy_output(OUTPUT.splitlines(), PATH_MAP)
    assert counts == Counter({
        ("flywheel/store.py", "attr-defined"): 2,
        ("flywheel/store.py", "arg-type"): 1,
        ("kernels/fused_logprob.py", "no-untyped-def"): 1,  # mapped back from the installed layout
        ("flows/cycle.py", "no-redef"): 1,
        ("flywheel/cli/core.py", mb.NO_CODE): 1,
    })
    assert mb.summary_count(OUTPUT.splitlines()) == sum(counts.values()) == 6


def test_line_numbers_do_not_make_keys():
    moved = OUTPUT.replace(":751:", ":1751:").replace(":760:", ":9:")
    assert mb.parse_mypy_output(moved.splitlines(), PATH_MAP) == mb.parse_mypy_output(OUTPUT.splitlines(), PATH_MAP)


def test_the_baseline_file_round_trips_sorted():
    counts = mb.parse_mypy_output(OUTPUT.splitlines(), PATH_MAP)
    text = mb.format_baseline(counts)
    lines = text.splitlines()
    assert lines == sorted(lines)
    assert "flywheel/store.py:attr-defined 2" in lines
    assert "kernels/fused_logprob.py:no-untyped-def 1" in lines
    assert mb.parse_baseline(text) == counts
    assert mb.parse_baseline("# a comment\n\n" + text) == counts
    with pytest.raises(ValueError, match="line 1"):
        mb.parse_baseline("flywheel/store.py attr-defined\n")


def test_equal_counts_pass():
    counts = mb.parse_mypy_output(OUTPUT.splitlines(), PATH_MAP)
    cmp = mb.compare(counts, Counter(counts))
    assert cmp.ok and not cmp.new and not cmp.shrunk
    assert "none beyond the baseline" in mb.report(cmp)


def test_a_count_above_the_baseline_fails_with_the_list():
    now = mb.parse_mypy_output(OUTPUT.splitlines(), PATH_MAP)
    baseline = Counter(now)
    baseline[("flywheel/store.py", "attr-defined")] -= 1  # one error more than the baseline allows
    cmp = mb.compare(now, baseline)
    assert not cmp.ok
    assert cmp.new == [(("flywheel/store.py", "attr-defined"), 1, 2)]
    text = mb.report(cmp, OUTPUT.splitlines())
    assert "flywheel/store.py [attr-defined]: 2 error(s), baseline 1" in text
    assert 'has no attribute "entity_heads"' in text  # mypy's own lines for the key


def test_a_key_the_baseline_lacks_fails():
    now = Counter({("flywheel/vocab/ids.py", "type-arg"): 1})
    cmp = mb.compare(now, Counter())
    assert not cmp.ok
    assert cmp.new == [(("flywheel/vocab/ids.py", "type-arg"), 0, 1)]


def test_fewer_errors_pass_with_the_hint_to_lower_the_baseline():
    baseline = Counter({("flywheel/store.py", "attr-defined"): 3, ("flywheel/gone.py", "misc"): 1})
    now = Counter({("flywheel/store.py", "attr-defined"): 2})
    cmp = mb.compare(now, baseline)
    assert cmp.ok
    assert cmp.shrunk == [(("flywheel/gone.py", "misc"), 1, 0), (("flywheel/store.py", "attr-defined"), 3, 2)]
    assert "make lint-baseline" in mb.report(cmp)


def test_fewer_errors_elsewhere_do_not_hide_a_new_one():
    baseline = Counter({("a.py", "misc"): 5, ("b.py", "misc"): 1})
    now = Counter({("a.py", "misc"): 1, ("b.py", "misc"): 2})  # fewer in total, one more in b.py
    cmp = mb.compare(now, baseline)
    assert not cmp.ok and cmp.new == [(("b.py", "misc"), 1, 2)]


# --- the script end to end, with mypy's output canned -------------------------------------------------


@pytest.fixture
def canned(monkeypatch, tmp_path):
    """main() with mypy's run replaced by OUTPUT (staged paths) and no staging of the real tree."""
    monkeypatch.setattr(mb, "stage_layout", lambda mapping: PATH_MAP)
    monkeypatch.setattr(mb, "run_mypy", lambda cwd: (1, OUTPUT.splitlines()))
    monkeypatch.setattr(mb, "module_files", lambda mapping: {})
    monkeypatch.delenv("ALLOW_GROW", raising=False)
    return tmp_path / "mypy-baseline.txt"


def _baseline(path: Path, lower: tuple[str, str] | None = None) -> Path:
    counts = mb.parse_mypy_output(OUTPUT.splitlines(), PATH_MAP)
    if lower:
        counts[lower] -= 1
    path.write_text(mb.format_baseline(counts))
    return path


def test_the_script_fails_on_a_planted_new_error(canned, capsys):
    _baseline(canned, lower=("kernels/fused_logprob.py", "no-untyped-def"))  # the planted error: not in it
    assert mb.main(["--baseline", str(canned)]) == 1
    out = capsys.readouterr().out
    assert "kernels/fused_logprob.py [no-untyped-def]: 1 error(s), baseline 0" in out
    assert "kernels/fused_logprob.py:40: error: Function is missing a type annotation" in out


def test_the_script_passes_on_its_own_baseline(canned, capsys):
    _baseline(canned)
    assert mb.main(["--baseline", str(canned)]) == 0
    assert "none beyond the baseline" in capsys.readouterr().out


def test_update_refuses_to_grow_the_baseline_unless_allowed(canned, monkeypatch):
    before = _baseline(canned, lower=("flywheel/store.py", "arg-type")).read_text()
    assert mb.main(["--baseline", str(canned), "--update"]) == 1
    assert canned.read_text() == before
    monkeypatch.setenv("ALLOW_GROW", "1")
    assert mb.main(["--baseline", str(canned), "--update"]) == 0
    assert "flywheel/store.py:arg-type 1" in canned.read_text().splitlines()


def test_update_lowers_the_baseline(canned):
    counts = mb.parse_mypy_output(OUTPUT.splitlines(), PATH_MAP)
    counts[("flywheel/old.py", "misc")] = 4
    canned.write_text(mb.format_baseline(counts))
    assert mb.main(["--baseline", str(canned), "--update"]) == 0
    assert "flywheel/old.py" not in canned.read_text()


def test_a_broken_mypy_run_fails_even_with_no_error_lines(canned, monkeypatch):
    _baseline(canned)
    monkeypatch.setattr(mb, "run_mypy", lambda cwd: (2, ["mypy.ini: error: bad config"]))
    assert mb.main(["--baseline", str(canned)]) == 2
    # a summary that disagrees with the lines parsed (say, mypy changed its format) is broken too
    monkeypatch.setattr(mb, "run_mypy", lambda cwd: (1, ["Found 3 errors in 1 file (checked 2 source files)"]))
    assert mb.main(["--baseline", str(canned)]) == 2


# --- Any in parameters, the installed layout ----------------------------------------------------------


def test_any_parameters_are_counted():
    src = textwrap.dedent('''
        import typing
        from typing import Any

        def f(a: Any, b: int, *args: Any, c: "Any" = 1, **kw: Any) -> Any: ...
        def g(x: typing.Any, y: list[Any], z: Any | None) -> None: ...
        class C:
            async def m(self, v: Any) -> None:
                def inner(w: Any): ...
    ''')
    # f: a, *args, c, **kw; g: x (list[Any] and Any | None are not Any); m: v; inner: w
    assert mb.count_any_params(src) == 7


def test_any_counts_per_core_package(tmp_path):
    (tmp_path / "flywheel" / "store").mkdir(parents=True)
    (tmp_path / "flywheel" / "__init__.py").write_text("")
    (tmp_path / "flywheel" / "store" / "__init__.py").write_text("from typing import Any\ndef f(x: Any): ...\n")
    (tmp_path / "flywheel" / "store" / "share.py").write_text("from typing import Any\ndef f(x: Any, y: Any): ...\n")
    (tmp_path / "flywheel" / "store_index.py").write_text("from typing import Any\ndef f(x: Any): ...\n")
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "k.py").write_text("from typing import Any\ndef f(x: Any): ...\n")
    files = mb.module_files({"flywheel": "flywheel", "flywheel.kernels": "kernels"}, root=tmp_path)
    assert set(files) == {"flywheel", "flywheel.store", "flywheel.store.share", "flywheel.store_index",
                          "flywheel.kernels.k"}
    total, per_core = mb.any_param_counts(files, core=("flywheel.store", "flywheel.vocab"))
    assert total == 5
    assert per_core == {"flywheel.store": 3, "flywheel.vocab": 0}  # store_index is not flywheel.store


def test_the_layout_links_mapped_folders_into_the_package(tmp_path):
    root = tmp_path / "repo"
    (root / "flywheel").mkdir(parents=True)
    (root / "flywheel" / "__init__.py").write_text("")
    (root / "flywheel" / "__pycache__").mkdir()
    (root / "kernels").mkdir()
    (root / "kernels" / "__init__.py").write_text("")
    dest = tmp_path / "layout"
    path_map = mb.stage_layout({"flywheel": "flywheel", "flywheel.kernels": "kernels"}, dest=dest, root=root)
    assert path_map == {"flywheel/": "flywheel/", "flywheel/kernels/": "kernels/"}
    assert (dest / "flywheel" / "__init__.py").resolve() == (root / "flywheel" / "__init__.py").resolve()
    assert (dest / "flywheel" / "kernels" / "__init__.py").is_file()
    assert not (dest / "flywheel" / "__pycache__").exists()
    (root / "flywheel" / "new.py").write_text("")  # a file added since: the next run links it too
    mb.stage_layout({"flywheel": "flywheel", "flywheel.kernels": "kernels"}, dest=dest, root=root)
    assert (dest / "flywheel" / "new.py").is_file()
    assert (root / "kernels" / "__init__.py").is_file()  # rebuilding never touches the real files


def test_the_package_dirs_come_from_pyproject():
    mapping = mb.package_dirs()
    assert mapping["flywheel"] == "flywheel"
    assert mapping["flywheel.kernels"] == "kernels" and mapping["flywheel.flows"] == "flows"


# --- mypy itself, once -----------------------------------------------------------------------------


@pytest.mark.slow
def test_mypy_reports_a_planted_error_in_a_tiny_package(tmp_path):
    pkg = tmp_path / "src" / "tinypkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "ok.py").write_text("def f(x: int) -> int:\n    return x\n")
    (pkg / "bad.py").write_text("from tinypkg.ok import f\n\nf('not an int')\n")
    ini = tmp_path / "mypy.ini"
    ini.write_text("[mypy]\n")
    rc, lines = mb.run_mypy(tmp_path / "src", package="tinypkg", config=ini, cache=tmp_path / "cache")
    assert rc == 1, lines
    assert mb.parse_mypy_output(lines) == Counter({("tinypkg/bad.py", "arg-type"): 1})
    assert mb.summary_count(lines) == 1
