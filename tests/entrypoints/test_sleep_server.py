"""The server's development endpoints for RL rollout engines (behind ``--enable-debug-endpoints`` or vLLM's
``VLLM_SERVER_DEV_MODE=1``): /sleep, /wake_up, /is_sleeping, /reset_prefix_cache and /collective_rpc against a
live tiny server, with httpx."""

from __future__ import annotations

import multiprocessing
import os

import httpx
import pytest

from tests.entrypoints.server_utils import REPO_ROOT, RemoteServer

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("sleep_server") / "server.log"
    # vLLM's switch for these endpoints; --enable-debug-endpoints is the same (tests/entrypoints/test_soak.py)
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    srv = RemoteServer(tiny_llama, log_path, extra_args=["--enable-sleep-mode"], env=env)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as c:
        yield c


def _model_name(client: httpx.Client) -> str:
    return client.get("/v1/models").json()["data"][0]["id"]


def test_sleep_wake_round_trip(client):
    body = {"model": _model_name(client), "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0}
    before = client.post("/v1/completions", json=body)
    assert before.status_code == 200, before.text
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}

    assert client.post("/sleep", params={"level": 1}).status_code == 200
    assert client.get("/is_sleeping").json() == {"is_sleeping": True}
    refused = client.post("/v1/completions", json=body)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_sleeping"

    assert client.post("/wake_up", params={"tags": "kv_cache"}).status_code == 200
    assert client.get("/is_sleeping").json() == {"is_sleeping": True}  # the weights still sleep
    assert client.post("/wake_up", params={"tags": "weights"}).status_code == 200
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}
    after = client.post("/v1/completions", json=body)
    assert after.status_code == 200
    assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]


def test_refusals(client):
    bad_level = client.post("/sleep", params={"level": 5})
    assert bad_level.status_code == 400 and bad_level.json()["error"]["param"] == "level"
    assert client.post("/sleep", params={"level": "deep"}).status_code == 400
    bad_tags = client.post("/wake_up", params={"tags": "everything"})
    assert bad_tags.status_code == 400 and bad_tags.json()["error"]["param"] == "tags"
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}
    bad_method = client.post("/collective_rpc", json={"method": "no_such_method"})
    assert bad_method.status_code == 400 and bad_method.json()["error"]["param"] == "method"


def test_collective_rpc_and_reset_prefix_cache(client):
    assert client.post("/collective_rpc", json={"method": "sleeping_tags"}).json() == {"results": [[]]}
    assert client.post("/reset_prefix_cache").status_code == 200


def test_weights_broadcast_by_a_trainer_through_collective_rpc(client, tiny_llama, updated_tiny_llama):
    """Server-mode training loops: the trainer process broadcasts, the engine receives through /collective_rpc."""
    from pagedllm import LLM
    from tests.distributed.rl_workers import BAD_TENSOR, checkpoint_tensors, trainer_broadcast
    from tests.entrypoints.server_utils import free_port
    from tests.utils import ROLLOUT_ENGINE, greedy_ids

    body = {
        "model": _model_name(client),
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    with LLM(updated_tiny_llama[0], **ROLLOUT_ENGINE) as fresh:
        expected = fresh.get_tokenizer().decode(greedy_ids(fresh, [PROMPT])[0])
    old_text = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert old_text != expected

    def rpc(method: str, *args) -> httpx.Response:
        return client.post("/collective_rpc", json={"method": method, "args": list(args)})

    port = free_port()
    trainer = multiprocessing.get_context("spawn").Process(
        target=trainer_broadcast, args=(port, 2, updated_tiny_llama[0]), daemon=True
    )
    trainer.start()
    try:
        assert rpc("init_weight_update_group", "127.0.0.1", port, 1, 2).json() == {"results": [None]}
        refused = rpc("update_weight", BAD_TENSOR[0], "float32", list(BAD_TENSOR[1]))
        assert refused.status_code == 400 and BAD_TENSOR[0] in refused.json()["error"]["message"]
        for name, tensor in checkpoint_tensors(updated_tiny_llama[0]):
            assert rpc("update_weight", name, "float32", list(tensor.shape)).status_code == 200
        trainer.join(60)
        assert trainer.exitcode == 0
        assert rpc("destroy_weight_update_group").status_code == 200
    finally:
        if trainer.is_alive():
            trainer.kill()
            trainer.join()
    assert client.post("/reset_prefix_cache").status_code == 200
    assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == expected
    # back to the checkpoint on disk
    assert rpc("reload_weights").json() == {"results": [len(checkpoint_tensors(tiny_llama))]}
    assert client.post("/reset_prefix_cache").status_code == 200
    assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == old_text
