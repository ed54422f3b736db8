"""Fixtures for the server tests: one real server for the session (tests that kill or stop a server start
their own)."""

from __future__ import annotations

import pytest

from tests.entrypoints.server_utils import RemoteServer


@pytest.fixture(scope="session")
def server(tiny_llama, tmp_path_factory) -> RemoteServer:
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    srv = RemoteServer(tiny_llama, log_path, extra_args=["--max-request-body-bytes", "65536"])
    yield srv
    code = srv.stop()
    log = srv.log()
    assert code == 0, log
    assert "Traceback" not in log, log


@pytest.fixture(scope="session")
def client(server):
    return server.openai_client()


@pytest.fixture(scope="session")
def model(tiny_llama) -> str:
    """The served model name (the model path, as no --served-model-name is given)."""
    return tiny_llama
