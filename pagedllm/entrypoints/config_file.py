"""``--config FILE``: a command's flags from a YAML file, as vLLM's ``vllm serve --config``.

The file is one mapping whose keys are the command's long flag names, with dashes or underscores and without the
leading ``--`` (``max-num-seqs: 64``, ``enable_prefix_caching: false``, ``model: /models/llama``). Each value is
typed and checked by the flag itself, exactly as if it had been written on the command line:

- a switch (``--enforce-eager``) takes ``true`` / ``false``; a ``--x / --no-x`` pair takes either spelling;
- a flag taking several values (``--served-model-name``) takes a list or one value;
- a flag taking JSON (``--speculative-config``) takes a mapping;
- ``null`` leaves the flag at its default.

The values become the parser's defaults, so anything given on the command line wins over the file. An unknown
key, or a value the flag refuses, is a ``ConfigFileError`` naming the file and the key.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from typing import Any

CONFIG_FLAG = "--config"


class ConfigFileError(ValueError):
    """A config file that cannot be read, or a key or value in it that the command refuses."""


class _RaisingParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that raises instead of printing usage and exiting."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise ConfigFileError(message)


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    """Add ``--config FILE`` to ``parser`` (read by :func:`apply_config_file` before the real parse)."""
    parser.add_argument(
        CONFIG_FLAG,
        default=None,
        metavar="FILE",
        help="a YAML file of flags (keys are flag names: max-num-seqs: 64); flags on the command line win",
    )


def find_config_path(argv: list[str]) -> str | None:
    """The value of ``--config`` in ``argv`` (``--config F`` or ``--config=F``), or None."""
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == CONFIG_FLAG:
            if i + 1 >= len(argv):
                raise ConfigFileError(f"{CONFIG_FLAG} needs a file name")
            return argv[i + 1]
        if arg.startswith(CONFIG_FLAG + "="):
            return arg[len(CONFIG_FLAG) + 1 :]
    return None


def load_config_file(path: str) -> dict[str, Any]:
    """The mapping in the YAML file at ``path`` (an empty file is an empty mapping)."""
    import yaml

    if not os.path.isfile(path):
        raise ConfigFileError(f"{CONFIG_FLAG} {path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise ConfigFileError(f"{CONFIG_FLAG} {path}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(
            f"{CONFIG_FLAG} {path}: the file must hold a mapping of flag names to values, "
            f"got {type(data).__name__}"
        )
    return data


def config_to_defaults(parser: argparse.ArgumentParser, config: Mapping[str, Any]) -> dict[str, Any]:
    """``{dest: value}`` for each key of ``config``, typed and checked by the flag of the same name in ``parser``.

    Raises ``ConfigFileError`` naming the key when there is no such flag or the flag refuses the value.
    """
    # A private copy that raises: the same flags, so the same types, choices and JSON parsing.
    checker = _RaisingParser(add_help=False, allow_abbrev=False)
    for action in parser._actions:
        checker._add_action(action)
    options = checker._option_string_actions
    out: dict[str, Any] = {}
    for key, value in config.items():
        if not isinstance(key, str) or not key.strip("-"):
            raise ConfigFileError(f"key {key!r} is not a flag name")
        name = key.lstrip("-").replace("_", "-")
        flag = "--" + name
        action = options.get(flag)
        if action is None or name in ("config", "help", "version") or action.dest == argparse.SUPPRESS:
            raise ConfigFileError(f"unknown key {key!r}: no such flag {flag}")
        if value is None:
            continue
        try:
            out[action.dest] = _typed_value(checker, action, flag, value)
        except ConfigFileError as e:
            raise ConfigFileError(f"key {key!r}: {e}") from None
    return out


def _typed_value(parser: _RaisingParser, action: argparse.Action, flag: str, value: Any) -> Any:
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise ConfigFileError(f"{flag} takes true or false, got {value!r}")
        return (not value) if flag.startswith("--no-") else value
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise ConfigFileError(f"{flag} takes true or false, got {value!r}")
        return action.const if value else action.default
    if action.nargs == 0:
        raise ConfigFileError(f"{flag} is not a setting")
    takes_many = action.nargs in ("+", "*") or isinstance(action.nargs, int)
    if isinstance(value, (list, tuple)):
        if not takes_many:
            raise ConfigFileError(f"{flag} takes one value, got a list")
        items = list(value)
    else:
        items = [value]
    tokens = [_token(item, flag) for item in items]
    ns = parser.parse_args([f"{flag}={tokens[0]}"] if len(tokens) == 1 else [flag, *tokens])
    return getattr(ns, action.dest)


def _token(item: Any, flag: str) -> str:
    """One command-line word for a YAML value: mappings as JSON (for JSON flags), booleans as the words."""
    if isinstance(item, (dict, list)):
        return json.dumps(item)
    if isinstance(item, bool):
        return "true" if item else "false"
    if isinstance(item, (str, int, float)):
        return str(item)
    raise ConfigFileError(f"{flag}: a value of type {type(item).__name__} cannot be a flag value")


def apply_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """If ``argv`` names a ``--config`` file, make its settings ``parser``'s defaults (the command line still wins)
    and return the path; else None. Raises ``ConfigFileError`` for a bad file, key or value."""
    path = find_config_path(argv)
    if path is None:
        return None
    config = load_config_file(path)
    try:
        defaults = config_to_defaults(parser, config)
    except ConfigFileError as e:
        raise ConfigFileError(f"{CONFIG_FLAG} {path}: {e}") from None
    parser.set_defaults(**defaults)
    return path
