"""Tiny, randomly initialised real models that tests and benchmarks build offline.

The test suite needs models that mlx-lm loads through its normal path
(``mlx_lm.load(dir)``: config.json + model.safetensors + a Hugging Face
tokenizer) without any network access. We build them from scratch:

* a byte-level BPE tokenizer (2048 tokens) trained on a fixed, sorted list of
  Python's own stdlib sources, with ChatML special tokens and a ChatML chat
  template;
* a config.json for an architecture mlx-lm already knows ("llama": KVCache
  only; "lfm2": ArraysCache conv layers + KVCache attention layers;
  "gemma3": RotatingKVCache sliding-window layers + KVCache global layers;
  "qwen3_moe": a mixture of experts, KVCache only; "mamba": pure SSM,
  ArraysCache only; "ministral3": KVCache only, and one of the models whose
  mlx-lm code splits its layers over ranks (pipeline parallel)),
  with weights drawn under a fixed seed.

The weights are random, so generated text is gibberish, but the shapes,
cache classes and numerics are those of the real architectures. Everything
written is byte-identical across runs on the same Python minor version and
mlx version (the corpus digest is recorded in ``tiny_model.json``).

This module imports mlx only inside the functions that need it, so callers
can run ``prefixd.daemon.models.blas.preload_blas()`` first (float32 is ~50x slower
on the bundled reference BLAS). Note build_tiny_model() reseeds MLX's global
PRNG.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

# Bump when anything below changes what gets written: ensure_tiny_model()
# rebuilds cached copies whose recorded recipe differs.
RECIPE_VERSION = 1

VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"
INFO_FILE = "tiny_model.json"  # written last: its presence marks a complete build

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Stdlib modules that exist as plain files on 3.11-3.13. Fixed and sorted so
# that training sees the same text in the same order everywhere. About 1.8 MB:
# enough for 2048 merges, and training takes well under a second.
CORPUS_FILES = sorted([
    "argparse.py", "ast.py", "base64.py", "calendar.py", "configparser.py",
    "contextlib.py", "copy.py", "csv.py", "dataclasses.py", "datetime.py",
    "difflib.py", "enum.py", "fractions.py", "functools.py", "gettext.py",
    "heapq.py", "inspect.py", "ipaddress.py", "json/__init__.py",
    "json/decoder.py", "json/encoder.py", "logging/__init__.py", "os.py",
    "pprint.py", "random.py", "shlex.py", "shutil.py", "statistics.py",
    "string.py", "subprocess.py", "tarfile.py", "tempfile.py", "textwrap.py",
    "threading.py", "tokenize.py", "traceback.py", "typing.py", "uuid.py",
    "warnings.py",
])

HIDDEN = 256
HEADS = 4
KV_HEADS = 2
MAX_POSITIONS = 8192
TINY_WINDOW = 32  # the tiny gemma3's sliding window, small so that tests go 1.5-3x past it cheaply


def corpus_texts() -> tuple[list[str], str]:
    """The training texts and a sha256 over them (names and contents).

    Files missing from this Python (a future removal) are skipped rather than
    fatal; the digest then differs, which is what records the difference.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts, digest = [], hashlib.sha256()
    for name in CORPUS_FILES:
        path = stdlib / name
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8")
        texts.append(text)
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
    if not texts:
        raise RuntimeError(f"no corpus files found under {stdlib}")
    return texts, digest.hexdigest()


def build_tokenizer(out_dir: Path) -> dict:
    """Train the BPE, save it as a Hugging Face fast tokenizer in out_dir.

    Returns a small info dict (vocab size, special ids, corpus digest).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    texts, corpus_sha = corpus_texts()
    tok = Tokenizer(models.BPE())
    # GPT-2 style byte-level pipeline: every byte is in the alphabet, so any
    # string round-trips, and mlx-lm picks its BPE streaming detokenizer.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,  # ids 0, 1, 2, and never split
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHATML_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out_dir))
    return {
        "vocab_size": tok.get_vocab_size(),
        "special_ids": {t: tok.token_to_id(t) for t in SPECIAL_TOKENS},
        "corpus_sha256": corpus_sha,
    }


def model_config(kind: str, vocab_size: int, eos_id: int) -> dict:
    """config.json contents for one of the tiny architectures."""
    common = {
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,  # GQA, as in the real models
        "max_position_embeddings": MAX_POSITIONS,
        "eos_token_id": eos_id,  # mlx-lm reads its stop ids from here
        "torch_dtype": "float32",
    }
    if kind == "llama":
        return {
            **common,
            "model_type": "llama",
            "num_hidden_layers": 4,
            "intermediate_size": 512,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
        }
    if kind == "lfm2":
        # Conv layers first, like LFM2 itself: exercises both mlx-lm's
        # conv_idx/fa_idx bookkeeping and the ArraysCache + KVCache mix.
        layer_types = ["conv", "conv", "full_attention", "conv", "full_attention", "conv"]
        return {
            **common,
            "model_type": "lfm2",
            "num_hidden_layers": len(layer_types),
            "layer_types": layer_types,
            "norm_eps": 1e-5,
            "conv_bias": False,
            "conv_L_cache": 3,
            "block_dim": HIDDEN,
            "block_ff_dim": 768,  # auto-adjusted to 512 as in LFM2's recipe
            "block_multiple_of": 256,
            "block_ffn_dim_multiplier": 1.0,
            "block_auto_adjust_ff_dim": True,
            "rope_theta": 1000000.0,
            "tie_embedding": True,
        }
    if kind == "gemma3":
        # Gemma 3's shape with a small window: layers 0, 1, 3, 4 slide over the
        # last TINY_WINDOW positions (RotatingKVCache), layers 2 and 5 attend
        # globally (KVCache). Layer 0 slides, as in Gemma 3: mlx-lm builds the
        # sliding mask from cache[0] and the global one from cache[pattern - 1].
        return {
            **common,
            "model_type": "gemma3_text",
            "num_hidden_layers": 6,
            "sliding_window_pattern": 3,
            "sliding_window": TINY_WINDOW,
            "head_dim": HIDDEN // HEADS,
            "query_pre_attn_scalar": HIDDEN // HEADS,
            "intermediate_size": 512,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
        }
    if kind == "qwen3_moe":
        # A mixture of experts: 8 experts, 2 routed per token, on every layer (decoder_sparse_step 1).
        return {
            **common,
            "model_type": "qwen3_moe",
            "num_hidden_layers": 3,
            "intermediate_size": 512,
            "moe_intermediate_size": 128,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "head_dim": HIDDEN // HEADS,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": True,
        }
    if kind == "ministral3":
        # Ministral 3's text model: llama-like, with mlx-lm's pipeline() (layers split over ranks) as well as
        # shard(). 4 layers split evenly over 2 ranks; Llama 4 attention scaling as in the real config.
        return {
            **common,
            "model_type": "ministral3",
            "num_hidden_layers": 4,
            "intermediate_size": 512,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.1,
                                "original_max_position_embeddings": MAX_POSITIONS},
            "tie_word_embeddings": True,
        }
    if kind == "mamba":
        # Pure SSM: every layer a Mamba block (conv + selective scan state, ArraysCache), no attention at all.
        common = {key: value for key, value in common.items() if key not in ("num_attention_heads", "num_key_value_heads")}
        return {
            **common,
            "model_type": "mamba",
            "num_hidden_layers": 4,
            "intermediate_size": 2 * HIDDEN,
            "state_size": 16,
            "conv_kernel": 4,
            "use_bias": False,
            "use_conv_bias": True,
            "time_step_rank": HIDDEN // 16,
            "tie_word_embeddings": True,
        }
    raise ValueError(f"unknown tiny model kind {kind!r}; expected 'llama', 'lfm2', 'gemma3', 'qwen3_moe', "
                     "'ministral3' or 'mamba'")


def build_tiny_model(kind: str, out_dir: Path, seed: int = 0) -> Path:
    """Write a loadable tiny model of the given kind into out_dir; return it.

    out_dir may exist; files are overwritten. Prefer ensure_tiny_model(),
    which caches and is safe against interrupted or concurrent builds.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    out_dir = Path(out_dir)
    tok_info = build_tokenizer(out_dir)
    cfg = model_config(kind, tok_info["vocab_size"], tok_info["special_ids"][EOS_TOKEN])
    # The same module mlx_lm.load() will pick for this model_type.
    arch = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")

    # Parameter initialisers draw from MLX's global PRNG in construction
    # order, so a fixed seed gives the same weights on every run.
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(cfg))
    model.set_dtype(mx.float32)  # fp32 + OpenBLAS is the fast CPU path
    weights = dict(sorted(tree_flatten(model.parameters())))
    mx.eval(weights)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    if hasattr(getattr(model, "model", None), "pipeline"):  # mamba has no .model
        # mlx-lm's pipeline loading reads the index to pick each rank's weight files (utils.sharded_load).
        _write_json(out_dir / "model.safetensors.index.json",
                    {"metadata": {}, "weight_map": {name: "model.safetensors" for name in weights}})
    _write_json(out_dir / "config.json", cfg)

    info = {
        "kind": kind,
        "seed": seed,
        "recipe_version": RECIPE_VERSION,
        "python": "%d.%d" % sys.version_info[:2],
        "parameters": sum(v.size for v in weights.values()),
        **tok_info,
    }
    _write_json(out_dir / INFO_FILE, info)  # last: marks the build complete
    return out_dir


def _write_json(path: Path, obj: dict) -> None:
    # sort_keys + fixed separators: byte-identical files across runs.
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _is_complete(path: Path, kind: str, seed: int) -> bool:
    """True if path holds a finished build of this kind, seed and recipe."""
    try:
        info = json.loads((path / INFO_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        info.get("kind") == kind
        and info.get("seed") == seed
        and info.get("recipe_version") == RECIPE_VERSION
        and (path / "model.safetensors").is_file()
        and (path / "tokenizer.json").is_file()
    )


def ensure_tiny_model(kind: str, root: Path, seed: int = 0) -> Path:
    """Return root/kind, building it first unless a complete build is there.

    The build happens in a temporary sibling directory that is renamed into
    place, so an interrupted build never leaves a half-written model behind and
    concurrent builders (pytest-xdist workers, benchmarks) do not clash: the
    first rename wins and the others use its result.
    """
    root = Path(root)
    target = root / kind
    if _is_complete(target, kind, seed):
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{kind}-build-", dir=root))
    try:
        build_tiny_model(kind, tmp, seed=seed)
        tmp.chmod(0o755)  # mkdtemp makes it 0700; a shared cache dir needs readable models
        if target.exists() and not _is_complete(target, kind, seed):
            # A stale recipe or foreign leftovers: move it aside first, since
            # rename() cannot replace a non-empty directory.
            stale = Path(tempfile.mkdtemp(prefix=f".{kind}-stale-", dir=root))
            try:
                os.replace(target, stale / kind)
            except FileNotFoundError:
                pass  # someone else moved it already
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target, kind, seed):
                raise
            # Another process finished first; its build is identical to ours.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# -- a variant that calls tools ---------------------------------------------------------------

TOOL_CALL_TOKENS = ["<tool_call>", "</tool_call>"]
TOOLS_INFO_FILE = "tools.json"  # written last: marks a complete llama-tools build

# Qwen2.5's Hermes-style template, cut down: tools in the system turn, an assistant turn's calls as
# <tool_call>{"name": ..., "arguments": ...}</tool_call>, tool results as user turns. mlx-lm infers the
# json_tools parser from "<tool_call>" and "tool_call.name" in it.
HERMES_TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{ '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>' }}"
    "{%- for tool in tools %}{{ '\n' }}{{ tool | tojson }}{%- endfor %}"
    "{{ '\n</tools>\n\nFor each function call, return a json object with function name and arguments within '"
    " + '<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": '"
    " + '<args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{ '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' + (message['content'] or '') }}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if message['content'] or not loop.first %}{{ '\n' }}{%- endif %}"
    "{{ '<tool_call>\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{{ tool_call.arguments | tojson }}{{ '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{%- else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)


def ensure_tools_model(tiny_llama_dir: Path, root: Path) -> Path:
    """root/llama-tools: the tiny llama with <tool_call>/</tool_call> special tokens and a Hermes tools template.

    The other tiny models stay as they are (their suites do not shift). Built
    aside, then renamed into place, like ensure_tiny_model.
    """
    target = Path(root) / "llama-tools"
    if (target / TOOLS_INFO_FILE).is_file():
        return target
    tmp = Path(tempfile.mkdtemp(prefix=".llama-tools-", dir=root))
    try:
        build = tmp / "llama-tools"
        shutil.copytree(tiny_llama_dir, build)
        add_special_tokens(build, TOOL_CALL_TOKENS, seed=2, chat_template=HERMES_TOOLS_TEMPLATE)
        _write_json(build / TOOLS_INFO_FILE, {"tokens": TOOL_CALL_TOKENS, "parser": "json_tools"})
        try:
            os.rename(build, target)
        except OSError:
            if not (target / TOOLS_INFO_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def add_special_tokens(model_dir: Path, tokens: list[str], seed: int, chat_template: str | None = None) -> None:
    """Add ``tokens`` as special tokens (ids after the vocabulary), growing the tied embedding under ``seed``."""
    import mlx.core as mx
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.add_tokens([AddedToken(token, special=True, normalized=False) for token in tokens], special_tokens=True)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(model_dir))
    config = json.loads((model_dir / "config.json").read_text())
    weights = mx.load(str(model_dir / "model.safetensors"))
    embedding = weights["model.embed_tokens.weight"]
    grown = len(tokenizer) - embedding.shape[0]
    mx.random.seed(seed)
    extra = 0.02 * mx.random.normal((grown, embedding.shape[1]), dtype=embedding.dtype)
    weights["model.embed_tokens.weight"] = mx.concatenate([embedding, extra])
    mx.save_safetensors(str(model_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    config["vocab_size"] = len(tokenizer)
    _write_json(model_dir / "config.json", config)
