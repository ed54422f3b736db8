"""The ``pagedllm`` command: ``serve | generate | chat | disagg-proxy | bench {serve, throughput, latency}``.

Each subcommand lives in a module exposing ``add_cli_args(parser)`` and ``main(args) -> int``. Only the module
of the subcommand being run is imported, so a broken or missing one only breaks its own subcommand (and
``pagedllm --help`` stays fast).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from typing import Any

# name -> (module, one-line help); the module has add_cli_args(parser) and main(args) -> int.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("pagedllm.entrypoints.openai.serve_cli", "run the OpenAI-compatible HTTP server"),
    "generate": ("pagedllm.entrypoints.generate", "generate text for prompts, offline"),
    "chat": (__name__ + ":chat", "chat with a model in the terminal"),
    "disagg-proxy": (
        "pagedllm.entrypoints.disagg_proxy",
        "one OpenAI endpoint in front of prefill and decode instances (disaggregated prefill/decode)",
    ),
}
BENCH_COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("pagedllm.benchmarks.serve", "load-test a running OpenAI-compatible server"),
    "throughput": ("pagedllm.benchmarks.throughput", "offline throughput"),
    "latency": ("pagedllm.benchmarks.latency", "latency of one batch"),
    "startup": (
        "pagedllm.benchmarks.startup",
        "seconds from `pagedllm serve` to the first completed request",
    ),
}


# The modules `pagedllm serve` needs beyond the engine (import name -> distribution): the HTTP stack and the
# engine core process's transport. Dependencies of pagedllm; checked before anything starts, for a broken install.
SERVE_MODULES: dict[str, str] = {
    "fastapi": "fastapi",
    "uvicorn": "uvicorn",
    "pydantic": "pydantic",
    "zmq": "pyzmq",
    "prometheus_client": "prometheus_client",
}


def missing_serve_modules() -> list[str]:
    """The distributions `pagedllm serve` needs that this Python cannot import (a find_spec each: no imports)."""
    return [dist for name, dist in SERVE_MODULES.items() if importlib.util.find_spec(name) is None]


class _Command:
    """A subcommand's two entry points: add_cli_args(parser) and main(args)."""

    def __init__(self, add_cli_args: Any, main: Any) -> None:
        self.add_cli_args = add_cli_args
        self.main = main


def _load(module_name: str, what: str) -> Any:
    """The module (or, for "module:chat", the chat command defined here) behind a subcommand."""
    if module_name == __name__ + ":chat":
        return _Command(add_chat_args, chat_main)
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        raise SystemExit(f"pagedllm {what}: unavailable ({e})") from e


def _positionals(argv: list[str]) -> list[str]:
    return [a for a in argv if not a.startswith("-")]


def build_parser(
    argv: list[str],
) -> tuple[argparse.ArgumentParser, dict[tuple[str, ...], argparse.ArgumentParser]]:
    """The parser, with full arguments only for the subcommand named in ``argv``."""
    parser = argparse.ArgumentParser(
        prog="pagedllm", description="High-throughput LLM inference and serving."
    )
    from pagedllm import __version__

    parser.add_argument("--version", action="version", version=f"pagedllm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{serve,generate,chat,disagg-proxy,bench}")
    words = _positionals(argv)
    chosen = words[0] if words else None
    leaves: dict[tuple[str, ...], argparse.ArgumentParser] = {}
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        leaves[(name,)] = p
        if name == chosen:
            _load(module_name, name).add_cli_args(p)
    bench = sub.add_parser("bench", help="benchmarks", description="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="{serve,throughput,latency,startup}")
    bench_chosen = words[1] if chosen == "bench" and len(words) > 1 else None
    for name, (module_name, help_text) in BENCH_COMMANDS.items():
        p = bench_sub.add_parser(name, help=help_text, description=help_text)
        leaves[("bench", name)] = p
        if name == bench_chosen:
            _load(module_name, f"bench {name}").add_cli_args(p)
    leaves[("bench",)] = bench
    return parser, leaves


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    words = _positionals(argv)
    if words[:1] == ["serve"] and "-h" not in argv and "--help" not in argv:
        missing = missing_serve_modules()
        if missing:  # one line, before an engine core process is started (it would fail on them with a traceback)
            print(
                f"pagedllm serve: unavailable (missing {', '.join(missing)}; "
                "pip install pagedllm installs them, or run tools/setup.sh)",
                file=sys.stderr,
                flush=True,
            )
            return 1
        from pagedllm.engine import core_launch

        core_launch.prespawn()  # the core imports torch and the engine while we import the server
    parser, leaves = build_parser(argv)
    if words[:1] == ["serve"]:
        from pagedllm.entrypoints.config_file import ConfigFileError, apply_config_file

        try:  # `pagedllm serve --config FILE`: the file's settings become the defaults
            apply_config_file(leaves[("serve",)], argv[argv.index("serve") + 1 :])
        except ConfigFileError as e:
            print(f"pagedllm serve: error: {e}", file=sys.stderr, flush=True)
            return 2
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "bench":
        if args.bench_command is None:
            leaves[("bench",)].print_help()
            return 2
        module_name, _ = BENCH_COMMANDS[args.bench_command]
        command = _load(module_name, f"bench {args.bench_command}").main
    else:
        module_name, _ = COMMANDS[args.command]
        command = _load(module_name, args.command).main
    try:
        return int(command(args) or 0)
    except ValueError as e:  # a bad flag value the engine's config refused: the message names the field
        if os.environ.get("PAGEDLLM_TRACEBACK"):
            raise
        print(f"error: {e} (PAGEDLLM_TRACEBACK=1 shows where)", file=sys.stderr)
        return 2


# ----------------------------------------------------------------------------------- pagedllm chat


def add_chat_args(parser: argparse.ArgumentParser) -> None:
    """``pagedllm chat``: the engine flags plus sampling settings."""
    from pagedllm.engine.arg_utils import add_engine_args

    add_engine_args(parser, model_positional=True)
    parser.add_argument("--system", default=None, help="a system message to start the conversation with")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument(
        "--chat-template", default=None, help="a Jinja chat template: a file path or the template"
    )


def chat_main(args: argparse.Namespace) -> int:
    """A terminal REPL over ``LLM.chat``: one line in, one answer out; an empty line or EOF quits."""
    from pagedllm.engine.arg_utils import engine_kwargs_from_args, resolve_model_arg
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    try:
        kwargs = engine_kwargs_from_args(args)
        kwargs.pop("served_model_name", None)  # a server setting; LLM does not take it
        llm = LLM(model=resolve_model_arg(args), **kwargs)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
    except ValueError as e:
        print(f"pagedllm chat: error: {e}", file=sys.stderr)
        return 2
    conversation: list[dict[str, str]] = []
    if args.system:
        conversation.append({"role": "system", "content": args.system})
    print("Type a message and press Enter; an empty line or Ctrl-D quits.", flush=True)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not line.strip():
            return 0
        conversation.append({"role": "user", "content": line})
        kwargs = {"chat_template": args.chat_template} if args.chat_template else {}
        try:
            out = llm.chat(conversation, params, use_tqdm=False, **kwargs)
        except ValueError as e:
            print(f"error: {e}", flush=True)
            conversation.pop()
            continue
        answer = out[0].outputs[0].text
        print(answer, flush=True)
        conversation.append({"role": "assistant", "content": answer})


if __name__ == "__main__":
    sys.exit(main())
