"""The Neovim plugin (contrib/nvim) in a real headless Neovim against a real daemon.

Needs ``nvim`` (Debian's ``neovim`` package: 0.7.2; ``./run`` installs it when root).
Each test runs a Lua driver with ``nvim --headless -u NONE``, the plugin on the
runtimepath, and reads back what the driver recorded as JSON.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.live_daemon import LiveDaemon

NVIM = shutil.which("nvim")
pytestmark = pytest.mark.skipif(NVIM is None, reason="nvim is not installed (apt-get install neovim; ./run does it as root)")
PLUGIN_DIR = Path(__file__).resolve().parents[2] / "contrib" / "nvim"

PRELUDE = r"""
local out = { notes = {}, errors = {} }
vim.notify = function(msg, level)
  table.insert(level == vim.log.levels.ERROR and out.errors or out.notes, msg)
end
local p = require('prefixd')
p.setup({ socket = vim.env.PFX_SOCK, max_tokens = 12 })
local done, failure = false, nil
local function on_done(err) failure = err; done = true end
local function wait(what)
  if not vim.wait(60000, function() return done end, 10) then error('timed out: ' .. what) end
  done = false
  if failure then out[what .. '_error'] = failure end
end
local function lines() return vim.api.nvim_buf_get_lines(0, 0, -1, false) end
local function finish()
  local f = io.open(vim.env.PFX_OUT, 'w'); f:write(vim.fn.json_encode(out)); f:close()
end
vim.api.nvim_buf_set_lines(0, 0, -1, false, { 'def add(a, b):', '    return a + b', '', 'def mul(a, b):' })
"""


def run_nvim(driver: str, socket: Path, tmp_path: Path) -> dict:
    script = tmp_path / "driver.lua"
    out = tmp_path / "out.json"
    script.write_text(PRELUDE + "local ok, err = pcall(function()\n" + driver
                      + "\nend)\nout.driver_error = not ok and tostring(err) or nil\nfinish()\n")
    proc = subprocess.run(
        [NVIM, "--headless", "-u", "NONE", "-i", "NONE", "--cmd", f"set rtp^={PLUGIN_DIR}",
         "-c", "runtime plugin/prefixd.lua", "-c", f"luafile {script}", "-c", "qa!"],
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PFX_SOCK": str(socket), "PFX_OUT": str(out)},
        capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL,
    )
    assert out.exists(), f"nvim wrote nothing (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    result = json.loads(out.read_text())
    assert result.get("driver_error") is None, result
    return result


@pytest.fixture(scope="module")
def daemon(tiny_llama_dir, tmp_path_factory):
    with LiveDaemon(tiny_llama_dir, tmp_path_factory.mktemp("nvim")) as live:
        yield live


def test_complete_rewrite_and_warm_in_neovim(daemon, tmp_path):
    result = run_nvim(r"""
vim.api.nvim_win_set_cursor(0, { 4, 13 })            -- on the ':' of 'def mul(a, b):'
vim.cmd('PrefixdComplete')                           -- streams over a vim.loop pipe
vim.wait(60000, function() return p.last ~= nil end, 10)
out.after_complete = lines()
out.complete_cache = p.last.cache
out.complete_text = p.last.text

p.last = nil
vim.cmd("1,2PrefixdComplete make it shorter")        -- rewrite lines 1-2 (the visual-range form)
vim.wait(60000, function() return p.last ~= nil end, 10)
out.after_rewrite = lines()
out.rewrite_text = p.last.text
out.rewrite_cache = p.last.cache

vim.api.nvim_buf_set_lines(0, -1, -1, false, { 'def sub(a, b):', '    # Subtract b from a, then explain the result at length.' })
vim.api.nvim_win_set_cursor(0, { #lines(), 0 })
vim.cmd('normal! $')
out.warm = p.warm()                                  -- cache.warm through rpcrequest
p.complete({ on_done = on_done }); wait('warm_complete')
out.warm_complete_cache = p.last.cache
""", daemon.socket_path, tmp_path)

    assert result["after_complete"][:3] == ["def add(a, b):", "    return a + b", ""]
    assert result["after_complete"][3] == "def mul(a, b):" + result["complete_text"].split("\n")[0]
    assert result["complete_text"]  # the buffer got text
    assert result["complete_cache"]["prompt_tokens"] > 0

    assert result["rewrite_text"]
    assert result["after_rewrite"][:-2] == result["rewrite_text"].split("\n")  # lines 1-2 replaced by the answer
    assert result["after_rewrite"][-2] == ""
    assert result["rewrite_cache"]["hit"] in ("miss", "partial")  # a new system message (the file) and question

    # A warm, then the completion it prepared: an exact hit, with the prefill time it saved.
    assert result["warm"]["cache"]["prefilled_tokens"] > 0
    cache = result["warm_complete_cache"]
    assert cache["hit"] == "exact" and cache["reused_tokens"] == cache["prompt_tokens"]  # and the warm's logits

    notes = result["notes"]  # the cache line after every answer
    assert len(notes) == 3 and all(note.startswith("prefixd: cache ") for note in notes), notes
    assert f"reused {cache['reused_tokens']}/{cache['prompt_tokens']} tokens" in notes[-1]
    assert "cache exact hit" in notes[-1] and "ttft" in notes[-1]
    assert not result["errors"]
    connected = {e["pid"] for e in daemon.log_events("client_connected")}
    assert len(connected) >= 1 and all(pid for pid in connected)  # the daemon saw who nvim is


def test_repeat_is_a_cache_hit_without_streaming(daemon, tmp_path):
    result = run_nvim(r"""
p.setup({ stream = false })                           -- generate through vim.rpcrequest
vim.api.nvim_win_set_cursor(0, { 2, 15 })
for i = 1, 2 do
  vim.api.nvim_buf_set_lines(0, 0, -1, false, { 'def add(a, b):', '    return a + b' })
  vim.api.nvim_win_set_cursor(0, { 2, 15 })
  p.complete({ on_done = on_done }); wait('run' .. i)
  out['cache' .. i] = p.last.cache
  out['lines' .. i] = lines()
end
""", daemon.socket_path, tmp_path)
    assert result["lines1"] == result["lines2"] and len(result["lines1"][1]) > len("    return a + b")
    assert result["cache2"]["hit"] == "exact" and result["cache2"]["reused_tokens"] > 0
    assert "cache exact hit" in result["notes"][1]


def test_warm_on_idle_makes_the_next_completion_an_exact_hit(daemon, tmp_path):
    result = run_nvim(r"""
p.setup({ warm_on_idle = true })
vim.api.nvim_buf_set_lines(0, -1, -1, false, { 'class Stack:', '    def push(self, item):' })
vim.api.nvim_win_set_cursor(0, { #lines(), 0 })
vim.cmd('normal! $')
vim.cmd('doautocmd CursorHold')                       -- what Neovim fires when typing pauses
out.started = p.warm_in_flight()
vim.wait(60000, function() return not p.warm_in_flight() end, 10)
p.complete({ on_done = on_done }); wait('complete')
out.cache = p.last.cache
""", daemon.socket_path, tmp_path)
    assert result["started"] is True
    assert result["cache"]["hit"] == "exact" and result["cache"]["saved_ms_est"] > 0
    warms = daemon.log_events("cache_warm")
    assert warms and warms[-1]["prompt_tokens"] == result["cache"]["prompt_tokens"]


def test_cancel_stops_the_answer(daemon, tmp_path):
    result = run_nvim(r"""
p.setup({ max_tokens = 4000 })
vim.api.nvim_win_set_cursor(0, { 4, 13 })
p.complete({ on_done = on_done })
vim.wait(60000, function() return #lines()[4] > #'def mul(a, b):' end, 5)  -- the first piece arrived
vim.cmd('PrefixdCancel')
wait('cancelled')
out.length = #table.concat(lines(), '\n')
""", daemon.socket_path, tmp_path)
    assert result["cancelled_error"] == "cancelled" and not result["errors"]
    for _ in range(100):
        ends = [e for e in daemon.log_events("generate") if e["finish_reason"] == "cancelled"]
        if ends:
            break
        time.sleep(0.1)
    assert ends and ends[-1]["completion_tokens"] < 4000


def test_no_daemon_is_a_clear_error(tmp_path):
    result = run_nvim(r"""
p.complete({ on_done = on_done }); wait('stream')
local ok, err = pcall(p.warm)
out.warm_error = tostring(err)
out.after = lines()
""", tmp_path / "nobody-here.sock", tmp_path)
    assert "cannot connect" in result["stream_error"] and "nobody-here.sock" in result["stream_error"]
    assert "cannot connect" in result["warm_error"] and "prefixd serve" in result["warm_error"]
    assert result["after"][3] == "def mul(a, b):"  # the buffer is untouched
    assert result["errors"] and "cannot connect" in result["errors"][0]
