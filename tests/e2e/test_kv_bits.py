"""``--kv-bits``: the real daemon with quantized KV, per model; what it says, what its shadow check finds, what it keeps on disk."""

from __future__ import annotations

from prefixd.client import Client
from tests.e2e.test_service_disk_cache import PROMPT, wait_for
from tests.e2e.test_shadow_check import _cache_hits, _wait_until_checked
from tests.support.live_daemon import LiveDaemon


def test_each_model_runs_at_its_setting_says_so_and_its_hits_match_uncached_runs(
    start_daemon, tiny_llama_dir, tiny_lfm2_dir
):
    # MLX's own BLAS: with OpenBLAS a pass's float rounding depends on its shape and on the CPU, and a quantized
    # cache can carry a 1e-6 difference on as a whole step (tests/model/test_quantized_kv_exactness.py), which
    # would make "no shadow mismatch" a property of the machine running the test.
    daemon = start_daemon(
        [tiny_llama_dir, tiny_lfm2_dir],
        ["--kv-bits", "8", "--kv-bits", "lfm2=4", "--shadow-rate", "1"],
        env={"PREFIXD_BLAS": "none"},
    )
    with Client(daemon.socket_path, timeout=60) as client:
        reused = {model: _cache_hits(client, model, f"kv bits {model}") for model in ("llama", "lfm2")}
        models = {model["name"]: model for model in client.models()["models"]}  # both loaded now
        repeat = client.generate(prompt=PROMPT, max_tokens=6, model="llama")
        repeat = client.generate(prompt=PROMPT, max_tokens=6, model="llama")
        shadow = _wait_until_checked(client)
        stats = client.stats()
    assert models["llama"]["kv"] == "q8 (group 64)" and models["lfm2"]["kv"] == "q4 (group 64)"
    assert models["llama"]["fingerprint"].endswith("-q8") and models["lfm2"]["fingerprint"].endswith("-q4")
    assert repeat["cache"]["hit"] == "exact" and repeat["cache"]["kv"] == "q8 (group 64)"
    assert {name: m["kv"] for name, m in stats["models"].items()} == {"llama": "q8 (group 64)", "lfm2": "q4 (group 64)"}
    for model in ("llama", "lfm2"):
        counts = shadow["per_model"][model]
        hits = reused[model] + (model == "llama")  # the repeat of PROMPT
        assert reused[model] >= 3 and counts["mismatch"] == 0 and counts["match"] == hits, (model, shadow)
    assert daemon.events("shadow_mismatch") == []
    assert daemon.events("daemon_starting")[0]["blas"] == "bundled"


def test_the_disk_cache_keeps_each_setting_apart(tiny_llama_dir, tmp_path):
    cache_dir = tmp_path / "kv"

    def running(workdir: str, bits: str) -> LiveDaemon:
        args = ["--disk-cache-bytes", "256M", "--cache-dir", str(cache_dir), "--disk-save-interval", "1"]
        return LiveDaemon(tiny_llama_dir, tmp_path / workdir, args + (["--kv-bits", bits] if bits else []),
                          env={"XDG_CONFIG_HOME": str(tmp_path / workdir / "no-config")})

    with running("q8-first", "8") as first:
        wait_for(first, "disk_cache_loaded")
        cold = first.call("generate", {"prompt": PROMPT, "max_tokens": 8})
    assert [folder.name[-3:] for folder in cache_dir.iterdir() if folder.is_dir()] == ["-q8"]

    with running("q8-again", "8") as second:
        assert wait_for(second, "disk_cache_loaded")["imported"] > 0
        warm = second.call("generate", {"prompt": PROMPT, "max_tokens": 8})
    assert warm["cache"]["hit"] == "exact" and warm["cache"]["source"] == "disk" and warm["text"] == cold["text"]

    with running("full", "") as full:
        loaded = wait_for(full, "disk_cache_loaded")
        other = wait_for(full, "disk_cache_other_kv_bits")
        plain = full.call("generate", {"prompt": PROMPT, "max_tokens": 8})
    assert loaded["imported"] == 0 and (other["written_at"], other["this_run"]) == ("q8", "full precision")
    assert plain["cache"]["hit"] == "miss" and plain["cache"]["kv"] == "float32"
