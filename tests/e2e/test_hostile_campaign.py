"""The short form of bench/hostile.py in CI: hostile inputs and injected faults, a bystander watching.

The full form (every fault plan, bigger floods, SmolLM2) is ``.venv/bin/python bench/hostile.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_quick_campaign_meets_its_targets(tiny_llama_dir, tmp_path):
    out = tmp_path / "hostile.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "hostile.py"), "--quick", "--model", str(tiny_llama_dir),
                           "--json", str(out)], capture_output=True, text=True, timeout=1200, stdin=subprocess.DEVNULL)
    print(proc.stdout[-4000:])
    assert out.exists(), proc.stderr[-4000:]
    totals = json.loads(out.read_text())["totals"]
    assert totals["inputs_tried"] >= 30
    assert totals["daemon_crashes"] == 0
    assert totals["closed_without_reply"] == 0 and totals["no_reply_in_time"] == 0
    assert totals["bystander_wrong"] == 0 and totals["bystander_failed"] == 0
    assert proc.returncode == 0, proc.stdout[-4000:]
