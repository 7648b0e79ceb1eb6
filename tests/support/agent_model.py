"""Tiny models for coding-agent clients: a long context, and an answer that ends by itself after a few tokens.

Agent clients (Codex, Claude Code, opencode, the Agents SDK) send thousands of
tokens of instructions and tool specifications, and take an answer cut by its
length limit as a failure (Codex: "Incomplete response returned"). A random
model writes until that limit. So the tests need a model whose context holds
the clients' prompts and whose answer ends on its own, quickly, whatever the
prompt.

This one is the tiny llama (tiny_models) cut to one layer, with that layer's
attention and MLP outputs zeroed: each position's logits then depend on its
own token only (a bigram model). The output layer (untied from the embedding)
is set so that any ordinary token is followed by ANSWER's first token, each
of ANSWER's tokens by the next, and the last by ``<|im_end|>``: the answer is
ANSWER, then the end of the turn, greedy or sampled (the margins are wide).
The prompt still runs through the real layer, so keys and values are
computed and cached as in any model: prefill, the prefix cache and its reuse
are real; only the words of the answer are fixed. The chat template is the
tiny llama's plain ChatML (no tools), so tools reach the model through
prefixd's generic tool section, as they do on SmolLM2.

Built from files only (no randomness of its own), so it is deterministic and
offline like the model it starts from.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

ANSWER = "Hello from prefixd."  # seven distinct tokens in the tiny tokenizer, and its canonical tokenization
# The tiny tokenizer (2,048 tokens) spends about twice the tokens of a real model's on English and JSON: Claude
# Code 2.1's first prompt is 32.5k of them, Codex's 15k, opencode's 12k. 64k leaves room for their growth.
LONG_CONTEXT = 65536
SHORT_CONTEXT = 2048  # shorter than any agent client's prompt: the too-long error
INFO_FILE = "agent_model.json"  # written last: marks a complete build
EMBEDDING = "model.embed_tokens.weight"
BIAS_SCALE = 4.0  # an ordinary token's constant feature, in units of the embedding's spread
LOGIT_SCALE = 20.0  # the next token's logit per unit of normalised feature; the margin is at least ~75


def agent_model_name(context: int) -> str:
    return f"agent-{context // 1024}k"


def ensure_agent_model(tiny_llama_dir: Path, root: Path, context: int = LONG_CONTEXT) -> Path:
    """root/agent-<N>k: the answer-and-stop model with a ``context``-token context (built aside, renamed into place)."""
    name = agent_model_name(context)
    target = Path(root) / name
    if (target / INFO_FILE).is_file():
        return target
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        build = tmp / name
        shutil.copytree(tiny_llama_dir, build)
        answer_ids = _make_answer_model(build, context)
        (build / INFO_FILE).write_text(json.dumps({"answer": ANSWER, "answer_ids": answer_ids, "context": context}) + "\n")
        build.chmod(0o755)
        try:
            os.rename(build, target)
        except OSError:
            if not (target / INFO_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _make_answer_model(model_dir: Path, context: int) -> list[int]:
    import mlx.core as mx
    import numpy as np
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    chain = _answer_ids(tokenizer)
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = json.loads((model_dir / "config.json").read_text())
    weights = {name: np.array(value) for name, value in mx.load(str(model_dir / "model.safetensors")).items()}
    weights = {name: value for name, value in weights.items()
               if not name.startswith("model.layers.") or name.startswith("model.layers.0.")}
    weights["model.layers.0.self_attn.o_proj.weight"][:] = 0.0
    weights["model.layers.0.mlp.down_proj.weight"][:] = 0.0

    # Feature 0 is on for every ordinary token; feature i (1..len(chain)) marks the answer's i-th token alone.
    embedding = weights[EMBEDDING]
    spread = float(embedding.std())
    embedding[:, : len(chain) + 1] = 0.0
    embedding[:, 0] = BIAS_SCALE * spread
    embedding[chain, :] = 0.0
    for feature, token in enumerate(chain, start=1):
        embedding[token, feature] = 1.0
    lm_head = np.zeros_like(embedding)
    for feature, follower in enumerate(chain + [end_id]):  # feature 0 (ordinary) -> chain[0], chain[i] -> next
        lm_head[follower, feature] = LOGIT_SCALE
    weights["lm_head.weight"] = lm_head
    _check_followers(weights, chain, end_id, config["rms_norm_eps"])

    mx.save_safetensors(str(model_dir / "model.safetensors"), {k: mx.array(v) for k, v in sorted(weights.items())},
                        metadata={"format": "mlx"})
    config.update(num_hidden_layers=1, tie_word_embeddings=False, max_position_embeddings=context)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return chain


def _answer_ids(tokenizer) -> list[int]:
    """ANSWER's tokens as the tokenizer writes them after the generation prompt, so a sent-back answer re-tokenizes alike."""
    turn = tokenizer.encode("<|im_start|>assistant\n" + ANSWER + "<|im_end|>")
    head = tokenizer.encode("<|im_start|>assistant\n")
    chain = turn[len(head):-1]
    assert turn[: len(head)] == head and tokenizer.decode(chain) == ANSWER, "the answer does not tokenize apart"
    assert len(set(chain)) == len(chain), "a bigram model cannot repeat a token of its answer"
    return chain


def _check_followers(weights: dict, chain: list[int], end_id: int, eps: float) -> None:
    """Every token's greedy follower, computed as the model does (embedding, final norm, output layer)."""
    import numpy as np

    hidden = weights[EMBEDDING]
    normed = hidden / np.sqrt((hidden * hidden).mean(axis=1, keepdims=True) + eps) * weights["model.norm.weight"]
    logits = normed @ weights["lm_head.weight"].T
    top_two = np.sort(logits, axis=1)[:, -2:]
    followers = logits.argmax(axis=1)
    expected = np.full(len(hidden), chain[0])
    expected[chain] = chain[1:] + [end_id]
    assert (followers == expected).all(), "the output layer does not spell the answer"
    assert float((top_two[:, 1] - top_two[:, 0]).min()) > 50.0, "the answer's margin is too thin for sampling"
