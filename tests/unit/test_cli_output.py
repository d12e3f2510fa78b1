"""Clean terminal output: library chatter goes to the log file under the home, flywheel's own output
stays on the terminal (flywheel.cli.common.third_party_output_to)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_library_output_goes_to_the_log_and_flywheel_output_to_the_terminal(tmp_path):
    log = tmp_path / "home" / "logs" / "demo.log"
    script = textwrap.dedent(f"""
        import logging, os, subprocess, sys, warnings
        from flywheel.cli.common import console, emit_json, out, reserve_stdout_for_json, third_party_output_to
        json_mode = sys.argv[1] == "json"
        if json_mode:
            reserve_stdout_for_json()
        with third_party_output_to({str(log)!r}):
            console.print("the story line")
            out.print("a table row")
            print("a library print")
            sys.stderr.write("a library message\\n")
            logging.basicConfig(level=logging.INFO)
            logging.getLogger("great_expectations").info("an INFO log line")
            warnings.warn("a FutureWarning", FutureWarning)
            os.write(2, b"a C extension write\\n")
            subprocess.run([sys.executable, "-c", "import sys; sys.stderr.write('a child process\\\\n')"], check=True)
            if json_mode:
                emit_json({{"ok": True}})
        console.print("after the block")
    """)
    for mode in ("human", "json"):
        proc = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        terminal = proc.stdout + proc.stderr
        assert "the story line" in proc.stderr and "after the block" in proc.stderr
        if mode == "human":
            assert "a table row" in proc.stdout
        else:
            assert proc.stdout.strip() == '{\n  "ok": true\n}'  # exactly one JSON document on stdout
        logged = log.read_text()
        for noise in ("a library print", "a library message", "an INFO log line", "a FutureWarning",
                      "a C extension write", "a child process"):
            assert noise in logged and noise not in terminal, noise
        assert oct(log.stat().st_mode & 0o777) == "0o600"
        log.unlink()
