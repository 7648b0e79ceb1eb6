"""configure_logging("json") turns everything that reaches stderr into JSON lines.

Run in a subprocess, since it installs process-wide hooks (sys.excepthook,
threading.excepthook, sys.unraisablehook, the root logging handler) and the
point is what lands on the real stderr: a library logger with its own stderr
handler, a warning, a dying thread, an exception in ``__del__``, an asyncio
task whose exception nobody retrieved (on uvloop, as the daemon runs), and
finally the main thread dying.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import asyncio, gc, logging, sys, threading, warnings
    import structlog, uvloop

    library = logging.getLogger("chatty_library")  # as transformers sets itself up
    library.addHandler(logging.StreamHandler(sys.stderr))
    library.propagate = False

    from prefixd.daemon.service.logs import configure_logging
    configure_logging("json", "info")

    structlog.get_logger("prefixd.test").info("our_own_line", answer=42)
    library.warning("a library speaks")
    logging.getLogger("aiohttp.server").error("Error handling request", exc_info=ValueError("bad header"))
    warnings.warn("something is deprecated", DeprecationWarning)
    worker = threading.Thread(target=lambda: 1 / 0, name="doomed-worker")
    worker.start()
    worker.join()

    class Finalizer:
        def __del__(self):
            raise RuntimeError("failed in __del__")

    Finalizer()
    gc.collect()

    async def main():
        async def fail():
            raise KeyError("nobody retrieves this")
        task = asyncio.get_running_loop().create_task(fail())
        await asyncio.sleep(0.05)
        del task
        gc.collect()
        await asyncio.sleep(0.05)

    uvloop.run(main())
    raise SystemError("the main thread dies")
''')


def run_script() -> tuple[int, list[dict]]:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    entries = []
    for line in proc.stderr.splitlines():
        try:
            entries.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}\nwhole stderr:\n{proc.stderr}") from None
    return proc.returncode, entries


def test_every_kind_of_stderr_output_becomes_one_json_line():
    returncode, entries = run_script()
    assert returncode == 1  # the uncaught exception still ends the process as it would have
    events = [entry["event"] for entry in entries]
    assert all(isinstance(entry, dict) and "level" in entry and "timestamp" in entry for entry in entries)

    ours = entries[events.index("our_own_line")]
    assert ours["answer"] == 42 and ours["level"] == "info"
    assert entries[events.index("a library speaks")]["logger"] == "chatty_library"
    aiohttp_line = entries[events.index("Error handling request")]
    assert aiohttp_line["logger"] == "aiohttp.server" and "ValueError: bad header" in aiohttp_line["exception"]
    [warning] = [entry for entry in entries if entry.get("logger") == "py.warnings"]
    assert "DeprecationWarning: something is deprecated" in warning["event"]

    unhandled = [entry for entry in entries if entry["event"] == "unhandled_exception"]
    assert [(entry["thread"], entry["exc_type"]) for entry in unhandled] == [
        ("doomed-worker", "ZeroDivisionError"), ("MainThread", "SystemError")]
    assert unhandled[1]["message"] == "the main thread dies" and "Traceback" in unhandled[1]["traceback"]
    [unraisable] = [entry for entry in entries if entry["event"] == "unraisable_exception"]
    assert unraisable["exc_type"] == "RuntimeError" and "__del__" in unraisable["where"]
    [never_retrieved] = [entry for entry in entries if entry["event"].startswith("Task exception was never retrieved")]
    assert never_retrieved["logger"] == "asyncio" and "KeyError" in never_retrieved["exception"]
