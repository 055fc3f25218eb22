"""`--json` puts JSON alone on stdout: inside `console.json_stdout()` whatever writes to stdout (Python's
print, a raw write to file descriptor 1, a child process such as vLLM's engine core) reaches stderr, and
only what is written to the yielded stream reaches stdout. Checked in a fresh interpreter whose two
streams are pipes, so no vLLM is needed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent("""
    import json, os, subprocess, sys
    from hspec.console import json_stdout

    print("before")
    with json_stdout() as out:
        print("a log line from Python")
        os.write(1, b"a raw write to fd 1\\n")
        subprocess.run([sys.executable, "-c", "print('a child process')"], check=True)
        print(json.dumps({"rows": [1, 2]}), file=out)
    print("after")
""")


def test_json_stdout_sends_every_other_write_to_stderr():
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, check=True)
    lines = done.stdout.splitlines()
    assert lines[0] == "before" and lines[-1] == "after"
    assert json.loads("\n".join(lines[1:-1])) == {"rows": [1, 2]}
    for log in ("a log line from Python", "a raw write to fd 1", "a child process"):
        assert log in done.stderr and log not in done.stdout


def test_json_stdout_restores_stdout_after_an_error():
    program = textwrap.dedent("""
        import os
        from hspec.console import json_stdout

        try:
            with json_stdout():
                os.write(1, b"inside\\n")
                raise KeyError("x")
        except KeyError:
            print("after the error")
    """)
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True)
    assert done.stdout == "after the error\n" and done.stderr == "inside\n"
