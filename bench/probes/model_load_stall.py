#!/usr/bin/env python
"""How long a running request stalls while the daemon loads another model on demand.

    .venv/bin/python bench/probes/model_load_stall.py RUNNING_MODEL_DIR LOADING_MODEL_DIR

One daemon serving both models (the first loads at start). A streamed request
on the first one (up to 4,000 tokens) runs for 2 s, then a request for the
second one makes the daemon load it; the figure is the longest gap between
two chunks of the running stream (what the load cost it), beside the median
gap and how long the second request took (load + its answer). Nothing fails
on a number: it is printed.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.e2e.daemon_process import DaemonProcess, RawConnection  # noqa: E402

RESPONSE = 1


def main(running: Path, loading: Path) -> None:
    with tempfile.TemporaryDirectory() as workdir, DaemonProcess([running, loading], Path(workdir)) as daemon:
        with RawConnection(daemon.socket_path, timeout=300) as stream, RawConnection(daemon.socket_path, timeout=300) as other:
            msgid = stream.request("generate", {"prompt": "count: one two three", "max_tokens": 4000, "stream": True})
            stamps: list[float] = []

            def read_stream() -> None:
                while True:
                    message = stream.read(timeout=300)
                    stamps.append(time.monotonic())
                    if message[0] == RESPONSE:
                        return

            reader = threading.Thread(target=read_stream)
            reader.start()
            time.sleep(2.0)
            started = time.monotonic()
            other.result("generate", {"model": loading.name, "prompt": "The capital of France is", "max_tokens": 4})
            answered = time.monotonic() - started
            stream.request("cancel", {"id": msgid})
            reader.join(60)
        gaps = [later - earlier for earlier, later in zip(stamps, stamps[1:])]
        (resident,) = daemon.events("model_resident", model=loading.name)
    print(f"{loading.name}: load + answer {answered:.2f} s (load {resident['load_s']:.2f} s); while it loaded, "
          f"the stream on {running.name}: longest gap {max(gaps):.2f} s, median gap {statistics.median(gaps) * 1000:.1f} ms")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(Path(sys.argv[1]), Path(sys.argv[2]))
