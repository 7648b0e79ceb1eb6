"""The offline tiny models: deterministic, loadable, and shaped like the real ones."""

from __future__ import annotations

import hashlib
import json

import pytest

from tests.support.tiny_models import INFO_FILE, build_tiny_model, corpus_texts, ensure_tiny_model

KINDS = ["llama", "lfm2", "gemma3"]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    # The models must never need the hub; make any attempt fail loudly.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(params=KINDS)
def tiny_dir(request, tiny_llama_dir, tiny_lfm2_dir, tiny_gemma3_dir):
    return {"llama": tiny_llama_dir, "lfm2": tiny_lfm2_dir, "gemma3": tiny_gemma3_dir}[request.param]


def _digests(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("kind", KINDS)
def test_builds_are_byte_identical(kind, tmp_path):
    a = _digests(build_tiny_model(kind, tmp_path / "a"))
    b = _digests(build_tiny_model(kind, tmp_path / "b"))
    assert {"config.json", "model.safetensors", "tokenizer.json", INFO_FILE} <= set(a)
    assert a == b


def test_seed_changes_weights_only(tmp_path):
    a = _digests(build_tiny_model("llama", tmp_path / "a", seed=0))
    b = _digests(build_tiny_model("llama", tmp_path / "b", seed=1))
    assert a["model.safetensors"] != b["model.safetensors"]
    assert a["tokenizer.json"] == b["tokenizer.json"]


def test_loads_with_mlx_lm(tiny_dir):
    import mlx.core as mx
    import mlx_lm

    model, tok = mlx_lm.load(str(tiny_dir))
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert tok.eos_token_ids == {tok.convert_tokens_to_ids("<|im_end|>")}
    assert len(tok.vocab) == cfg["vocab_size"] == 2048
    logits = model(mx.array([tok.encode("def f(x):\n    return x")]))
    assert logits.shape[-1] == cfg["vocab_size"]
    assert logits.dtype == mx.float32
    assert bool(mx.isfinite(logits).all())


def test_lfm2_cache_mixes_conv_and_attention(tiny_lfm2_dir):
    import mlx_lm
    from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

    model, _ = mlx_lm.load(str(tiny_lfm2_dir))
    cache = make_prompt_cache(model)
    kinds = {type(c) for c in cache}
    assert kinds == {ArraysCache, KVCache}


def test_llama_cache_is_plain_kv(tiny_llama_dir):
    import mlx_lm
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    model, _ = mlx_lm.load(str(tiny_llama_dir))
    assert {type(c) for c in make_prompt_cache(model)} == {KVCache}


def test_gemma3_cache_slides_on_four_layers_of_six(tiny_gemma3_dir):
    import mlx_lm
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    from prefixd.daemon.kv.layout import make_cache_layout
    from tests.support.tiny_models import TINY_WINDOW

    model, _ = mlx_lm.load(str(tiny_gemma3_dir))
    cache = make_prompt_cache(model)
    assert [type(c) for c in cache] == [RotatingKVCache, RotatingKVCache, KVCache] * 2
    assert {c.max_size for c in cache if isinstance(c, RotatingKVCache)} == {TINY_WINDOW}
    layout = make_cache_layout(model)
    assert layout.attention_layers == (0, 1, 2, 3, 4, 5) and layout.window_layers == (0, 1, 3, 4)
    assert layout.window_size == TINY_WINDOW and layout.is_supported and not layout.is_hybrid
    assert layout.describe() == {"kvcache": 2, "rotating": 4, "arrays": 0, "other": 0}


def test_chat_template_is_chatml(tiny_lfm2_dir):
    import mlx_lm

    _, tok = mlx_lm.load(str(tiny_lfm2_dir))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(messages[:2], add_generation_prompt=False)
    # Special tokens are single ids, never split into bytes.
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 2
    assert ids.count(tok.convert_tokens_to_ids("<|im_end|>")) == 2
    assert tok.decode(ids) == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_greedy_does_not_stop_at_once(tiny_dir):
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step

    model, tok = mlx_lm.load(str(tiny_dir))
    for prompt in ["What is the capital of France?", "def fib(n):", "hello"]:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        steps = generate_step(mx.array(ids), model, max_tokens=16)
        tokens = [int(t) for t, _ in steps]
        assert not set(tokens) & tok.eos_token_ids, (prompt, tokens)


def test_chunked_prefill_matches_one_shot(tiny_dir):
    """What the prefix cache relies on: resuming a cache mid-prompt is exact."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    model, tok = mlx_lm.load(str(tiny_dir))
    ids = tok.encode(corpus_texts()[0][0])[:300]
    assert len(ids) == 300
    whole = model(mx.array([ids]), cache=make_prompt_cache(model))[0, -1]
    cache = make_prompt_cache(model)
    for start, end in [(0, 128), (128, 256), (256, 300)]:
        chunked = model(mx.array([ids[start:end]]), cache=cache)[0, -1]
    rel = float(mx.abs(chunked - whole).max() / mx.abs(whole).max())
    assert rel < 1e-4


def test_ensure_reuses_and_repairs(tmp_path):
    path = ensure_tiny_model("llama", tmp_path)
    assert path == tmp_path / "llama"
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model("llama", tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    # An incomplete directory (no completion marker) is replaced, not trusted.
    (path / INFO_FILE).unlink()
    before = _digests(build_tiny_model("llama", tmp_path / "ref"))
    assert _digests(ensure_tiny_model("llama", tmp_path)) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_the_tools_variant_calls_tools_in_the_hermes_format(tiny_tools_dir, tiny_llama_dir):
    """mlx-lm infers json_tools from its template; a call it renders reads back as that call; the llama is untouched."""
    import mlx_lm

    from prefixd.daemon.models.tool_call_format import tool_call_format

    _, tok = mlx_lm.load(str(tiny_tools_dir))
    fmt = tool_call_format(tok)
    assert (fmt.family, fmt.start, fmt.end) == ("json_tools", "<tool_call>", "</tool_call>")
    ids = tok.encode("<tool_call></tool_call>", add_special_tokens=False)
    assert len(ids) == 2 and ids[0] >= json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    chat = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    text = tok.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=True)
    assert '"name": "get_weather"' in text.split("<tools>")[1] and "<tool_response>\nsunny\n</tool_response>" in text
    answer = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert answer == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert [(c.name, c.arguments) for c in fmt.split(answer)[1]] == [("get_weather", {"city": "Paris"})]
    _, plain = mlx_lm.load(str(tiny_llama_dir))
    assert tool_call_format(plain) is None
