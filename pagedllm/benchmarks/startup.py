"""`pagedllm bench startup`: seconds from launching `pagedllm serve MODEL` to the first completed request.

The server is started as a child process (its own flags go in ``--serve-args``); the clock starts just before the
launch and stops when a one-token completion returns 200. Until the server listens, the probe waits on the child
(so a server that dies is reported at once) in short slices. The engine's own phase times (model load, memory
profile, KV cache allocation, CUDA graph capture), which it logs at start-up, are read back from its log.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

PHASE_RE = re.compile(r"start-up phases: (.*)$", re.MULTILINE)
STAMP_RE = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model to serve (default: the bundled demo model)")
    parser.add_argument(
        "--serve-args", default="", help='flags for `pagedllm serve`, e.g. "--load-format dummy"'
    )
    parser.add_argument("--port", type=int, default=None, help="default: a free port")
    parser.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds")
    parser.add_argument("--num-runs", type=int, default=1, help="launch this many times, one after the other")
    parser.add_argument("--output-json", default=None)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _probe(url: str, model: str | None) -> bool:
    """One completion of one token; True once the server answered it with 200."""
    body = {"prompt": "hello", "max_tokens": 1, "temperature": 0}
    if model:
        body["model"] = model
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def parse_phases(log: str) -> dict[str, float]:
    """``{"load": 1.2, ...}`` from the engine's "start-up phases: load 1.20 s, ..." line."""
    m = PHASE_RE.search(log)
    if not m:
        return {}
    return {name: float(value) for name, value in re.findall(r"([a-z][a-z ]*?) ([0-9.]+) s", m.group(1))}


def timeline(log: str, launch_wall: float) -> list[tuple[float, str]]:
    """(seconds after launch, line) for each time-stamped log line (logging's asctime, local time)."""
    out = []
    for line in log.splitlines():
        m = STAMP_RE.search(line)
        if m:
            stamp = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1e3
            out.append((round(stamp - launch_wall, 3), line.strip()[:160]))
    return out


def measure(model: str | None, serve_args: list[str], port: int, timeout: float, log_path: str) -> dict:
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *([model] if model else []), "--port",
           str(port), "--disable-log-requests", *serve_args]  # fmt: skip
    env = dict(os.environ)
    env.pop("PAGEDLLM_API_KEY", None)
    url = f"http://127.0.0.1:{port}/v1/completions"
    with open(log_path, "w") as log:
        start = time.monotonic()
        launch_wall = time.time()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while True:
                if _probe(url, model):
                    elapsed = time.monotonic() - start
                    break
                if time.monotonic() - start > timeout:
                    raise RuntimeError(f"no completed request within {timeout} s")
                try:
                    code = proc.wait(timeout=0.1)  # returns at once if the server died
                    raise RuntimeError(f"the server exited with {code} before answering")
                except subprocess.TimeoutExpired:
                    pass
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    with open(log_path, errors="replace") as f:
        text = f.read()
    return {
        "startup_s": elapsed,
        "phases": parse_phases(text),
        "timeline": timeline(text, launch_wall),
        "command": shlex.join(cmd),
    }


def main(args: argparse.Namespace) -> int:
    results = []
    for _ in range(max(1, args.num_runs)):
        port = args.port or _free_port()
        with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as f:
            log_path = f.name
        try:
            result = measure(args.model, shlex.split(args.serve_args), port, args.timeout, log_path)
        except RuntimeError as e:
            with open(log_path, errors="replace") as f:
                tail = f.read()[-4000:]
            print(f"pagedllm bench startup: {e}\n--- server log (tail) ---\n{tail}", file=sys.stderr)
            return 1
        os.unlink(log_path)
        results.append(result)
        phases = ", ".join(f"{k} {v:.2f} s" for k, v in result["phases"].items()) or "not logged"
        print(f"Start-up: {result['startup_s']:.2f} s from launch to the first completed request")
        print(f"Engine phases: {phases}")
        for t, line in result["timeline"]:
            print(f"  {t:7.2f} s  {line}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results[0] if len(results) == 1 else results, f, indent=2)
    return 0
