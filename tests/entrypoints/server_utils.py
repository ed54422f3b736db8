"""A real `pagedllm serve` subprocess on 127.0.0.1 (a free port), for the server tests."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
API_KEY = "sk-pagedllm-test"
# /metrics histograms of a request's phases (each observed once per finished request)
PHASE_HISTOGRAMS = [
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_inference_time_seconds",
    "request_tokenize_time_seconds",
    "request_frontend_to_core_seconds",
]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """`python -m pagedllm.entrypoints.cli serve MODEL ...` with its output in ``log_path``.

    ``command`` replaces ``python -m pagedllm.entrypoints.cli`` (e.g. another environment's ``pagedllm``) and
    ``env`` this process's environment; this checkout is put on PYTHONPATH only with neither given."""

    def __init__(
        self,
        model: str | None,
        log_path: Path,
        extra_args: list[str] = (),
        api_key: str | None = API_KEY,
        command: list[str] | None = None,
        env: dict[str, str] | None = None,
        port: int | None = None,
    ) -> None:
        self.port = port or free_port()  # a given port: a restart where the last one was
        self.api_key = api_key
        self.log_path = log_path
        cmd = [
            *(command or [sys.executable, "-m", "pagedllm.entrypoints.cli"]), "serve", *([model] if model else []),
            "--device", "cpu", "--dtype", "float32", "--block-size", "16",
            "--kv-cache-memory-bytes", str(8 << 20), "--port", str(self.port),
            "--uvicorn-log-level", "warning", "--disable-log-requests",
            *extra_args,
        ]  # fmt: skip
        if api_key is not None:
            cmd += ["--api-key", api_key]
        if env is None:
            env = dict(os.environ)
            if command is None:
                env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
        env = {k: v for k, v in env.items() if k != "PAGEDLLM_API_KEY"}
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
        self._wait_healthy(timeout_s=180.0)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server was not healthy within {timeout_s} s:\n{self.log()}")

    def engine_pid(self) -> int:
        m = re.search(r"engine core pid (\d+)", self.log())
        assert m, self.log()
        return int(m.group(1))

    def openai_client(self, **kwargs):
        import openai

        return openai.OpenAI(
            base_url=self.base_url + "/v1", api_key=self.api_key or "none", max_retries=0, **kwargs
        )

    def async_openai_client(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(
            base_url=self.base_url + "/v1", api_key=self.api_key or "none", max_retries=0, **kwargs
        )

    def metrics(self) -> dict[str, float]:
        """/metrics as {series (name plus labels): value}."""
        text = httpx.get(self.base_url + "/metrics", timeout=10.0).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def wait_idle(self, timeout_s: float = 30.0) -> dict[str, float]:
        """/metrics once no request is running or waiting (AssertionError after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            if metric(m, "num_requests_running") == 0 and metric(m, "num_requests_waiting") == 0:
                return m
            assert time.monotonic() < deadline, f"not idle after {timeout_s} s: {m}"
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def metric(metrics: dict[str, float], name: str, **labels: str) -> float:
    """The value of ``pagedllm:<name>`` whose labels include ``labels`` (0 when absent)."""
    for series, value in metrics.items():
        base, _, rest = series.partition("{")
        if base == f"pagedllm:{name}" and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            return value
    return 0.0
