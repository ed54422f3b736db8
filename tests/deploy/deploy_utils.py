"""Readers for the files under deploy/: Dockerfile instructions, `pagedllm serve` arguments checked by pagedllm's
own parser (a ``--config`` file applied as the command does), PromQL metric names, the metric names pagedllm
exports."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from tests.entrypoints.server_utils import REPO_ROOT

DEPLOY = REPO_ROOT / "deploy"

DOCKERFILE_INSTRUCTIONS = {
    "FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER", "WORKDIR",
    "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL",
}  # fmt: skip


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` in order: comments dropped, ``\\``-continued lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, f"{path}: the last instruction ends with a continuation"
    return out


def exec_form(arguments: str) -> list[str]:
    """An ENTRYPOINT / CMD in exec form (a JSON list of strings)."""
    words = json.loads(arguments)
    assert isinstance(words, list) and all(isinstance(w, str) for w in words), arguments
    return words


class _Refused(Exception):
    pass


class _StrictParser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # type: ignore[override]
        raise _Refused(message)


def parse_serve_args(words: list[str], files: dict[str, Path] | None = None) -> argparse.Namespace:
    """``pagedllm serve`` ``words`` (what follows ``serve``) parsed by pagedllm's own parser; an unknown flag or a
    refused value fails the test. ``files`` maps in-container paths to files here, for ``--config``."""
    from pagedllm.entrypoints.config_file import apply_config_file, find_config_path
    from pagedllm.entrypoints.openai.serve_cli import add_cli_args

    parser = _StrictParser(prog="pagedllm serve", add_help=False, allow_abbrev=False)
    add_cli_args(parser)
    config = find_config_path(words)
    if config is not None:
        assert config in (files or {}), f"--config {config}: no file is mounted there"
        host_path = str(files[config])
        words = [host_path if w == config else w.replace(config, host_path) for w in words]
        apply_config_file(parser, words)
    try:
        return parser.parse_args(words)
    except _Refused as e:
        raise AssertionError(f"pagedllm serve refuses {words}: {e}") from None


_PROMQL_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset",
    "inf", "nan",
}  # fmt: skip


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (also from Grafana's ``label_values(metric, label)``)."""
    m = re.fullmatch(r"\s*label_values\(\s*([A-Za-z_:][\w:]*)\s*,\s*\w+\s*\)\s*", expr)
    if m:
        return {m.group(1)}
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range selectors
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)  # label lists
    names = set()
    for m in re.finditer(r"(?<![\w:$.])([A-Za-z_:][\w:]*)(\s*\()?", text):
        name, call = m.group(1), m.group(2)
        if call or name.lower() in _PROMQL_KEYWORDS:
            continue
        names.add(name)
    return names


def promql_matcher_labels(expr: str) -> dict[str, set[str]]:
    """metric name -> the label names its ``{...}`` matchers use."""
    out: dict[str, set[str]] = {}
    for m in re.finditer(r"([A-Za-z_:][\w:]*)\{([^}]*)\}", expr):
        labels = {lm.group(1) for lm in re.finditer(r"(\w+)\s*(?:=~|!~|!=|=)", m.group(2))}
        out.setdefault(m.group(1), set()).update(labels)
    return out


def exposition_series(text: str) -> dict[str, set[str]]:
    """Prometheus text exposition -> {sample name: label names seen on it} (``_bucket``, ``_total``... included)."""
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([A-Za-z_:][\w:]*)(\{([^}]*)\})?\s", line)
        assert m, line
        labels = set(re.findall(r'(\w+)="', m.group(3) or ""))
        out.setdefault(m.group(1), set()).update(labels)
    return out


def dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL query of a Grafana dashboard: panel targets (nested rows too) and query variables."""
    exprs: list[str] = []

    def panels(items: list[dict[str, Any]]) -> None:
        for panel in items:
            for target in panel.get("targets", []):
                exprs.append(target["expr"])
            panels(panel.get("panels", []))

    panels(dashboard.get("panels", []))
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var["query"]
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs
