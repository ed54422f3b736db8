"""Disaggregated prefill/decode: a prefill instance (kv_producer) sends a prompt's KV to a decode instance
(kv_consumer), which loads it instead of recomputing it. Registered as "P2pConnector" and "P2pNcclConnector".

The request flow is vLLM's (a proxy in front, ``pagedllm disagg-proxy``)::

    proxy -> producer:  the request with max_tokens=1, kv_transfer_params {"do_remote_decode": true}
    producer:           prefills, samples one token, finishes; request_finished keeps the request's blocks
                        (delay-free) and returns the handle as the output's kv_transfer_params:
                        {"do_remote_prefill": true, "remote_host", "remote_port", "remote_request_id",
                         "remote_num_tokens", "remote_block_size", "remote_tokens_digest", ...}
    proxy -> consumer:  the same request, with that handle as its kv_transfer_params
    consumer:           get_num_new_matched_tokens offers the handle's tokens (after its own device prefix hit);
                        the worker pulls them from the producer; the request then computes the rest of its
                        prompt (at least its last token: the first output token's logits are the consumer's own)
    producer:           frees the blocks once they are sent, or when the consumer tells it it will not pull, or
                        after send_timeout_s

What is sent: the prompt's full blocks but the one holding its last token ((num_prompt_tokens - 1) // block_size
blocks), so the consumer always computes between 1 and block_size prompt tokens itself. The consumer checks the
handle against its own prompt (block size, a digest of the token ids) and loads nothing when they differ.

Transport, per producer/consumer pair: a ZMQ REQ/ROUTER control channel to the producer's ``kv_ip:kv_port``
(handshake, "pull request R's blocks i..j", "release R"), and a two-rank torch.distributed process group (gloo for
a CPU KV cache, NCCL for a CUDA one) over a TCPStore the producer serves on ``kv_store_port`` (kv_port + 1 by
default), for the block data: one buffer holding every layer's blocks of the pull (where all layers' caches have
one shape), gathered, sent and received on the transfer threads' own CUDA streams, never queued behind the
engine's steps. Both ends run the transfers on a background thread of the worker, one at a time
(so sends and receives pair up in order); the consumer writes received blocks into its KV cache on the engine
thread, at the end of a step, skipping requests that finished meanwhile (their blocks may be someone else's now).

Failures never hang and never give wrong tokens: a pull that gets no answer, an unknown or expired request, a
layout mismatch or a broken transfer fails the load within ``pull_timeout_s`` + ``transfer_timeout_s``; the
scheduler then recomputes the request's prompt (``get_block_ids_with_load_errors``).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import queue
import socket
import threading
import time
import uuid
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.distributed.parallel_state import shutdown_backend
from pagedllm.kv_transfer.base import KVConnectorBase, KVConnectorMetadata, KVConnectorRole

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig, KVTransferConfig
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from pagedllm.core.request import Request
    from pagedllm.core.sched_output import SchedulerOutput

logger = logging.getLogger(__name__)

_PREFIX = "kv_transfer_config.kv_connector_extra_config"
# extra config key -> (type, default)
_KEYS: dict[str, tuple[type, Any]] = {
    "kv_ip": (str, "127.0.0.1"),  # where a producer listens (and what its handle advertises)
    "kv_port": (int, None),  # a producer's control port (required for kv_producer / kv_both)
    "kv_store_port": (int, None),  # a producer's TCPStore port for the process groups (default kv_port + 1)
    "remote_host": (str, None),  # a consumer's default producer, when a handle names none (checked at start-up)
    "remote_port": (int, None),
    "send_timeout_s": (float, 120.0),  # a producer frees blocks nobody pulled after this long
    "pull_timeout_s": (float, 30.0),  # a consumer gives up a pull the producer does not serve within this long
    "transfer_timeout_s": (float, 60.0),  # the process groups' timeout (handshake, one transfer)
    "connect_timeout_s": (float, 10.0),  # a consumer's start-up check of remote_host:remote_port
}


def _settings(transfer: KVTransferConfig) -> dict[str, Any]:
    """The extra config with defaults filled in; ``ValueError`` naming the key for a wrong type or value."""
    extra = dict(transfer.kv_connector_extra_config)
    unknown = sorted(set(extra) - set(_KEYS))
    if unknown:
        raise ValueError(f"{_PREFIX}: P2pConnector does not know {unknown} (it takes {sorted(_KEYS)})")
    out: dict[str, Any] = {}
    for key, (kind, default) in _KEYS.items():
        value = extra.get(key, default)
        if key == "kv_ip" and "kv_ip" not in extra and transfer.kv_ip is not None:
            value = transfer.kv_ip
        if key == "kv_port" and "kv_port" not in extra and transfer.kv_port is not None:
            value = transfer.kv_port
        if value is not None:
            try:
                value = kind(value)  # vLLM's examples give ports as strings
            except (TypeError, ValueError):
                raise ValueError(f"{_PREFIX}.{key} must be a {kind.__name__}, got {extra[key]!r}") from None
            if kind is float and value <= 0:
                raise ValueError(f"{_PREFIX}.{key} must be positive, got {value!r}")
            if key.endswith("port") and not 0 < value < 65536:
                raise ValueError(f"{_PREFIX}.{key} must be a port number, got {value!r}")
        out[key] = value
    if transfer.kv_role in ("kv_producer", "kv_both") and out["kv_port"] is None:
        raise ValueError(
            f"{_PREFIX}.kv_port: a {transfer.kv_role} needs a port to serve its KV on (or kv_transfer_config.kv_port)"
        )
    if out["kv_port"] is not None and out["kv_store_port"] is None:
        if out["kv_port"] + 1 >= 65536:
            raise ValueError(f"{_PREFIX}.kv_store_port: kv_port + 1 is no port; give kv_store_port")
        out["kv_store_port"] = out["kv_port"] + 1
    if (out["remote_host"] is None) != (out["remote_port"] is None):
        raise ValueError(f"{_PREFIX}: give remote_host and remote_port together")
    return out


def tokens_digest(token_ids: list[int]) -> str:
    """What the consumer compares with its own prompt before loading (sha256 of the token ids, as int64)."""
    return hashlib.sha256(array("q", token_ids).tobytes()).hexdigest()[:32]


@dataclass
class _Load:
    """One request's pull: the producer's blocks ``start_block ..`` into the local ``block_ids``."""

    req_id: str
    host: str
    port: int
    remote_request_id: str
    start_block: int
    block_ids: list[int]


@dataclass
class P2pMetadata(KVConnectorMetadata):
    loads: list[_Load] = field(default_factory=list)  # consumer: pulls to start
    releases: list[tuple[str, int, str]] = field(default_factory=list)  # consumer: (host, port, remote id) not pulled
    sends: dict[str, list[int]] = field(default_factory=dict)  # producer: req_id -> device blocks kept for a pull


class _PullError(Exception):
    pass


def _make_group(store: Any, rank: int, device: torch.device, timeout_s: float) -> Any:
    """A two-rank process group outside the default one (gloo on CPU, NCCL on CUDA)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        opts = torch.distributed.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return torch.distributed.ProcessGroupNCCL(store, rank, 2, opts)
    return torch.distributed.ProcessGroupGloo(store, rank, 2, timeout)


def _advertised_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"
    return host


def _uniform(caches: list[torch.Tensor]) -> bool:
    """Whether every cache tensor has one shape and dtype: then a transfer moves all layers as one buffer."""
    return all(c.shape == caches[0].shape and c.dtype == caches[0].dtype for c in caches)


def _transfer_buffer(caches: list[torch.Tensor], block_dim: int, num_blocks: int) -> torch.Tensor:
    """``[num_caches, *cache shape with num_blocks at block_dim]``: every layer's blocks of one transfer."""
    shape = list(caches[0].shape)
    shape[block_dim] = num_blocks
    return torch.empty([len(caches), *shape], dtype=caches[0].dtype, device=caches[0].device)


def _side_stream(device: torch.device) -> Any:
    """A stream of its own for a transfer thread's device work (None on CPU): on the default stream a transfer would
    wait behind every step the engine has launched, and the steps behind it."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def _on(stream: Any) -> Any:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


class _Producer:
    """The producer's server thread: answers handshakes and pulls on its ROUTER socket, sends blocks. It gathers and
    sends on a stream of its own, after the event recorded when the request's blocks were handed over (the steps
    that wrote them come before it), and frees the blocks only once the gather has run."""

    def __init__(self, caches: list[torch.Tensor], block_dim: int, cfg: dict[str, Any], layout: list) -> None:
        import zmq

        self.caches, self.block_dim, self.cfg, self.layout = caches, block_dim, cfg, layout
        self.device = caches[0].device
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        host = cfg["kv_ip"]
        try:
            self.sock.bind(f"tcp://{host}:{cfg['kv_port']}")
        except zmq.ZMQError as e:
            self.ctx.destroy(0)
            raise ValueError(f"{_PREFIX}.kv_port: cannot listen on {host}:{cfg['kv_port']}: {e}") from None
        try:
            self.store = torch.distributed.TCPStore(
                host, cfg["kv_store_port"], None, True,
                timeout=datetime.timedelta(seconds=cfg["transfer_timeout_s"]), wait_for_workers=False,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - RuntimeError / DistNetworkError: the port is taken
            self.ctx.destroy(0)
            raise ValueError(f"{_PREFIX}.kv_store_port: cannot listen on {host}:{cfg['kv_store_port']}: {e}") from None
        self.lock = threading.Lock()
        self.pending: dict[str, tuple[list[int], float, Any]] = {}  # req_id -> (device blocks, deadline, event)
        self.stream = _side_stream(self.device)
        self.busy: set[str] = set()  # being sent now (not expired under the sender's feet)
        self.done: set[str] = set()  # sent, released or failed: blocks to free (get_finished)
        self.gone: OrderedDict[str, None] = OrderedDict()  # recently done ids: a pull for them fails at once
        self.groups: dict[str, Any] = {}  # consumer id -> process group
        self.num_groups = 0
        self.num_sent_blocks = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="p2p-kv-producer", daemon=True)
        self.thread.start()

    def add(self, sends: dict[str, list[int]]) -> None:
        """Keep ``sends``' blocks for a pull (engine thread: the steps that wrote them are launched already)."""
        deadline = time.monotonic() + self.cfg["send_timeout_s"]
        written = None
        if sends and self.device.type == "cuda":
            written = torch.cuda.Event()
            written.record(torch.cuda.current_stream(self.device))
        with self.lock:
            for req_id, block_ids in sends.items():
                self.pending[req_id] = (block_ids, deadline, written)

    def take_done(self) -> set[str]:
        now = time.monotonic()
        with self.lock:
            expired = [r for r, (_, deadline, _) in self.pending.items() if deadline < now and r not in self.busy]
            for req_id in expired:
                logger.warning("request %s: no consumer pulled its KV within send_timeout_s; freeing it", req_id)
                self._finish(req_id)
            done, self.done = self.done, set()
        return done

    def _finish(self, req_id: str) -> None:  # under self.lock
        self.pending.pop(req_id, None)
        self.done.add(req_id)
        self.gone[req_id] = None
        while len(self.gone) > 4096:
            self.gone.popitem(last=False)

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)
        self.ctx.destroy(0)
        for group in self.groups.values():
            shutdown_backend(group, "KV transfer group")
        self.groups.clear()

    def _loop(self) -> None:
        import zmq

        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(100):
                    continue
                ident, empty, raw = self.sock.recv_multipart()
            except zmq.ZMQError:
                return  # closed
            try:
                msg = json.loads(raw)
                op = msg.get("op")
                if op == "ping":
                    self._reply(ident, {"ok": True, "role": "kv_producer"})
                elif op == "hello":
                    self._hello(ident, msg)
                elif op == "pull":
                    self._pull(ident, msg)
                elif op == "release":
                    with self.lock:
                        if msg.get("req_id") in self.pending and msg.get("req_id") not in self.busy:
                            self._finish(msg["req_id"])
                    self._reply(ident, {"ok": True})
                else:
                    self._reply(ident, {"ok": False, "error": f"unknown op {op!r}"})
            except Exception:  # noqa: BLE001 - one bad message must not stop the server
                logger.exception("P2P KV producer: handling a message failed")

    def _reply(self, ident: bytes, msg: dict) -> None:
        self.sock.send_multipart([ident, b"", json.dumps(msg).encode()])

    def _hello(self, ident: bytes, msg: dict) -> None:
        if msg.get("layout") != self.layout:
            self._reply(ident, {"ok": False, "error": f"KV cache layouts differ: producer {self.layout}, consumer "
                                                       f"{msg.get('layout')}"})  # fmt: skip
            return
        self.num_groups += 1
        prefix = f"{msg['consumer_id']}/{self.num_groups}"
        self._reply(ident, {"ok": True, "store_port": self.cfg["kv_store_port"], "prefix": prefix})
        cid = msg["consumer_id"]
        self.groups.pop(cid, None)
        try:  # blocks until the consumer builds its end (or the timeout)
            store = torch.distributed.PrefixStore(prefix, self.store)
            self.groups[cid] = _make_group(store, 0, self.device, self.cfg["transfer_timeout_s"])
        except Exception as e:  # noqa: BLE001
            logger.warning("P2P KV producer: the process group with consumer %s failed: %s", cid, e)

    def _pull(self, ident: bytes, msg: dict) -> None:
        cid, req_id = msg["consumer_id"], msg["req_id"]
        group = self.groups.get(cid)
        if group is None:
            self._reply(ident, {"ok": False, "reconnect": True, "error": "no process group with this consumer"})
            return
        with self.lock:
            entry = self.pending.get(req_id)
            if entry is None:
                retry = req_id not in self.gone  # not registered yet (the engine thread adds it next step)
                self._reply(ident, {"ok": False, "retry": retry, "error": f"request {req_id!r}: no KV kept for it"})
                return
            block_ids, _, written = entry
            start, num = int(msg["start_block"]), int(msg["num_blocks"])
            if start < 0 or num < 1 or start + num > len(block_ids):
                self._finish(req_id)
                self._reply(ident, {"ok": False, "error": f"blocks {start}..{start + num} of {len(block_ids)}"})
                return
            self.busy.add(req_id)
        self._reply(ident, {"ok": True})
        try:
            with _on(self.stream):
                if written is not None:
                    self.stream.wait_event(written)
                idx = torch.tensor(block_ids[start : start + num], dtype=torch.long, device=self.device)
                if _uniform(self.caches):  # one gather per layer into one buffer, one send
                    buf = _transfer_buffer(self.caches, self.block_dim, num)
                    for i, cache in enumerate(self.caches):
                        torch.index_select(cache, self.block_dim, idx, out=buf[i])
                    group.send([buf], 1, 0).wait()
                else:
                    for cache in self.caches:
                        group.send([cache.index_select(self.block_dim, idx).contiguous()], 1, 0).wait()
                if self.stream is not None:
                    self.stream.synchronize()  # gathered and sent: the blocks may be freed, the buffer reused
            self.num_sent_blocks += num
        except Exception as e:  # noqa: BLE001 - the consumer sees its receive fail and recomputes
            logger.warning("P2P KV producer: sending request %s to consumer %s failed: %s", req_id, cid, e)
            self.groups.pop(cid, None)
        finally:
            with self.lock:
                self.busy.discard(req_id)
                self._finish(req_id)


@dataclass
class _Peer:
    sock: Any
    group: Any = None


class _Consumer:
    """The consumer's puller thread: one pull at a time, results handed to the engine thread."""

    def __init__(self, caches: list[torch.Tensor], block_dim: int, cfg: dict[str, Any], layout: list) -> None:
        import zmq

        self.caches, self.block_dim, self.cfg, self.layout = caches, block_dim, cfg, layout
        self.device = caches[0].device
        self.ctx = zmq.Context()
        self.consumer_id = uuid.uuid4().hex
        self.peers: dict[tuple[str, int], _Peer] = {}
        self.jobs: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.results: dict[str, Any] = {}  # req_id -> list of received tensors, or the exception
        self.stream = _side_stream(self.device)
        self.thread = threading.Thread(target=self._loop, name="p2p-kv-consumer", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=5)
        self.ctx.destroy(0)
        for peer in self.peers.values():
            if peer.group is not None:
                shutdown_backend(peer.group, "KV transfer group")
        self.peers.clear()

    def ping(self, host: str, port: int, timeout_s: float) -> dict:
        """One request/reply on a fresh socket (the start-up check); raises TimeoutError."""
        import zmq

        sock = self.ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"tcp://{host}:{port}")
            sock.send(json.dumps({"op": "ping"}).encode())
            if not sock.poll(int(timeout_s * 1000)):
                raise TimeoutError(f"no answer from {host}:{port} within {timeout_s} s")
            return json.loads(sock.recv())
        finally:
            sock.close(0)

    def _loop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if isinstance(job, tuple):  # a release
                host, port, remote_id = job
                try:
                    self._request(host, port, {"op": "release", "req_id": remote_id}, time.monotonic() + 2.0)
                except Exception as e:  # noqa: BLE001 - the producer frees it after send_timeout_s anyway
                    logger.debug("releasing %s at %s:%d failed: %s", remote_id, host, port, e)
                continue
            try:
                result: Any = self._pull(job)
            except Exception as e:  # noqa: BLE001 - reported as a failed load: the engine recomputes
                result = e if isinstance(e, _PullError) else _PullError(f"{type(e).__name__}: {e}")
            with self.lock:
                self.results[job.req_id] = result

    def _drop(self, key: tuple[str, int]) -> None:
        peer = self.peers.pop(key, None)
        if peer is not None:
            peer.sock.close(0)

    def _request(self, host: str, port: int, msg: dict, deadline: float) -> dict:
        """Send ``msg`` to the producer and wait for its reply until ``deadline`` (a dropped peer on timeout)."""
        import zmq

        key = (host, port)
        peer = self.peers.get(key)
        if peer is None:
            sock = self.ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{host}:{port}")
            peer = self.peers[key] = _Peer(sock)
        peer.sock.send(json.dumps(msg).encode())
        if not peer.sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            self._drop(key)  # a REQ socket without its reply cannot send again
            raise _PullError(f"the KV producer at {host}:{port} did not answer")
        return json.loads(peer.sock.recv())

    def _group(self, host: str, port: int, deadline: float) -> Any:
        peer = self.peers.get((host, port))
        if peer is not None and peer.group is not None:
            return peer.group
        reply = self._request(
            host, port, {"op": "hello", "consumer_id": self.consumer_id, "layout": self.layout}, deadline
        )
        if not reply.get("ok"):
            raise _PullError(f"the KV producer at {host}:{port} refused the handshake: {reply.get('error')}")
        timeout = datetime.timedelta(seconds=self.cfg["transfer_timeout_s"])
        store = torch.distributed.TCPStore(host, reply["store_port"], None, False, timeout=timeout)
        group = _make_group(
            torch.distributed.PrefixStore(reply["prefix"], store), 1, self.device, self.cfg["transfer_timeout_s"]
        )
        self.peers[(host, port)].group = group
        return group

    def _pull(self, load: _Load) -> list[torch.Tensor]:
        key = (load.host, load.port)
        deadline = time.monotonic() + self.cfg["pull_timeout_s"]
        msg = {
            "op": "pull",
            "consumer_id": self.consumer_id,
            "req_id": load.remote_request_id,
            "start_block": load.start_block,
            "num_blocks": len(load.block_ids),
        }
        while True:
            group = self._group(load.host, load.port, deadline)
            reply = self._request(load.host, load.port, msg, deadline)
            if reply.get("ok"):
                break
            if reply.get("reconnect") and time.monotonic() < deadline:
                self._drop(key)
                continue
            if reply.get("retry") and time.monotonic() < deadline:
                time.sleep(0.02)
                continue
            raise _PullError(f"the KV producer at {load.host}:{load.port}: {reply.get('error')}")
        bufs = []
        try:
            with _on(self.stream):
                if _uniform(self.caches):
                    buf = _transfer_buffer(self.caches, self.block_dim, len(load.block_ids))
                    group.recv([buf], 0, 0).wait()
                    bufs = list(buf.unbind(0))
                else:
                    for cache in self.caches:
                        shape = list(cache.shape)
                        shape[self.block_dim] = len(load.block_ids)
                        buf = torch.empty(shape, dtype=cache.dtype, device=cache.device)
                        group.recv([buf], 0, 0).wait()
                        bufs.append(buf)
                if self.stream is not None:
                    self.stream.synchronize()  # received: the engine thread copies them on its own stream
        except Exception:
            self._drop(key)  # its process group is broken: the next pull shakes hands again
            raise
        return bufs

    def take_results(self) -> dict[str, Any]:
        with self.lock:
            results, self.results = self.results, {}
        return results


class P2pConnector(KVConnectorBase):
    """See the module docstring. ``kv_role``: kv_producer (prefill), kv_consumer (decode) or kv_both."""

    @classmethod
    def check_config(cls, transfer: KVTransferConfig) -> None:
        _settings(transfer)

    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_block_bytes: int) -> None:
        super().__init__(config, role, kv_block_bytes)
        self.cfg = _settings(self.transfer_config)
        self.host = _advertised_host(self.cfg["kv_ip"])
        # Scheduler side.
        self._requests: dict[str, Request] = {}
        self._tried: set[str] = set()  # consumer: requests whose handle was used or refused (loaded at most once)
        self._loads: list[_Load] = []
        self._releases: list[tuple[str, int, str]] = []
        self._sends: dict[str, list[int]] = {}
        self.num_offered_blocks = 0  # producer: blocks kept for a consumer
        self.num_pulled_requests = 0  # consumer: loads started
        self.num_refused_handles = 0  # consumer: handles that did not match the request
        self._role_warned: set[str] = set()
        # Worker side.
        self._producer: _Producer | None = None
        self._consumer: _Consumer | None = None
        self._caches: list[torch.Tensor] = []
        self._block_dim = 1
        self._inflight: dict[str, _Load] = {}
        self._cancelled: set[str] = set()
        self._load_errors: set[int] = set()

    # ------------------------------------------------------------------ scheduler side

    def bind_scheduler(self, kv_cache_manager: KVCacheManager, requests: dict[str, Request]) -> None:
        self._requests = requests

    def _handle(self, request: Request) -> dict[str, Any] | None:
        params = request.sampling_params.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return None
        if not self.is_consumer:
            self._warn_role("do_remote_prefill", "kv_consumer")
            return None
        return params

    def _warn_role(self, what: str, role: str) -> None:
        if what not in self._role_warned:
            self._role_warned.add(what)
            logger.warning(
                "requests with kv_transfer_params.%s need kv_role %s or kv_both; this instance is %s: ignored "
                "(the prompt is computed here)", what, role, self.transfer_config.kv_role,
            )  # fmt: skip

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = self._handle(request)
        if params is None or request.request_id in self._tried:
            return 0, False
        host, port = self._address(params)
        remote_id = params.get("remote_request_id")
        num_remote = params.get("remote_num_tokens", 0)
        bs = self.block_size
        why = None
        if not host or not port or not isinstance(remote_id, str) or type(num_remote) is not int:
            why = "it names no producer (remote_host, remote_port, remote_request_id, remote_num_tokens)"
        elif num_remote == 0:
            return 0, False  # a prompt shorter than a block: nothing was kept
        elif params.get("remote_block_size") != bs or num_remote % bs:
            why = f"block sizes differ (producer {params.get('remote_block_size')}, here {bs})"
        elif not 0 < num_remote < request.num_prompt_tokens:
            why = f"it holds {num_remote} tokens of a {request.num_prompt_tokens}-token prompt"
        elif params.get("remote_tokens_digest") != tokens_digest(request.prompt_token_ids[:num_remote]):
            why = "its prompt differs from this request's"
        elif request.sampling_params.prompt_logprobs is not None:
            why = "prompt_logprobs needs every prompt position computed here"
        if why is not None:
            logger.warning("request %s: not loading its KV from the producer: %s", request.request_id, why)
            self.num_refused_handles += 1
        if why is not None or num_remote <= num_computed_tokens:
            self._tried.add(request.request_id)  # decided: never loads (its device prefix hit covers it, or refused)
            if host and port and isinstance(remote_id, str):
                self._releases.append((host, port, remote_id))
            return 0, False
        return num_remote - num_computed_tokens, True

    def _address(self, params: dict[str, Any]) -> tuple[str | None, int | None]:
        """The producer a handle names (else the configured default); (None, None) for a malformed one (the
        handle comes from the request: it must not take the engine down)."""
        host = params.get("remote_host") or self.cfg["remote_host"]
        port = params.get("remote_port") or self.cfg["remote_port"]
        try:
            port = int(port)
        except (TypeError, ValueError):
            return None, None
        if not isinstance(host, str) or not 0 < port < 65536:
            return None, None
        return host, port

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            return
        params = self._handle(request)
        assert params is not None
        self._tried.add(request.request_id)  # loaded once: after a failure or a preemption it recomputes
        bs = self.block_size
        start = request.num_computed_tokens // bs
        host, port = self._address(params)
        self._loads.append(
            _Load(
                request.request_id,
                host,
                port,
                params["remote_request_id"],
                start,
                list(block_ids[start : start + num_external_tokens // bs]),
            )
        )
        self.num_pulled_requests += 1

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> P2pMetadata:
        meta = P2pMetadata(self._loads, self._releases, self._sends)
        self._loads, self._releases, self._sends = [], [], {}
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from pagedllm.core.request import RequestStatus

        self._tried.discard(request.request_id)
        params = request.sampling_params.kv_transfer_params
        if not params or not params.get("do_remote_decode"):
            return False, None
        if not self.is_producer:
            self._warn_role("do_remote_decode", "kv_producer")
            return False, None
        if request.status == RequestStatus.FINISHED_ABORTED or request.num_output_tokens == 0:
            return False, None  # its prompt may not be computed; the decode instance computes it all
        bs = self.block_size
        num_blocks = min(len(block_ids), (request.num_prompt_tokens - 1) // bs)
        num_tokens = num_blocks * bs
        handle = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": f"{self.host}:{self.cfg['kv_port']}",
            "remote_host": self.host,
            "remote_port": self.cfg["kv_port"],
            "remote_request_id": request.request_id,
            "remote_block_ids": list(block_ids[:num_blocks]),
            "remote_num_tokens": num_tokens,
            "remote_block_size": bs,
            "remote_tokens_digest": tokens_digest(request.prompt_token_ids[:num_tokens]),
        }
        if num_blocks == 0:
            return False, handle
        self._sends[request.request_id] = list(block_ids[:num_blocks])
        self.num_offered_blocks += num_blocks
        return True, handle

    def get_stats(self) -> dict[str, int]:
        return {
            "p2p_offered_blocks": self.num_offered_blocks,
            "p2p_pulled_requests": self.num_pulled_requests,
            "p2p_refused_handles": self.num_refused_handles,
        }

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: list[torch.Tensor], block_dim: int) -> None:
        super().register_kv_caches(kv_caches, block_dim)
        seen: set[int] = set()
        for cache in kv_caches:
            if cache.data_ptr() not in seen:
                seen.add(cache.data_ptr())
                self._caches.append(cache)
        self._block_dim = block_dim
        # What both ends must agree on: each distinct cache tensor's shape without the block dimension, and dtype.
        layout = [
            [[s for d, s in enumerate(c.shape) if d != block_dim], str(c.dtype), block_dim] for c in self._caches
        ]
        if self.is_producer:
            self._producer = _Producer(self._caches, block_dim, self.cfg, layout)
            logger.info("P2P KV producer listening on %s:%d", self.cfg["kv_ip"], self.cfg["kv_port"])
        if self.is_consumer:
            self._consumer = _Consumer(self._caches, block_dim, self.cfg, layout)
            host, port = self.cfg["remote_host"], self.cfg["remote_port"]
            if host is not None:
                try:
                    reply = self._consumer.ping(host, port, self.cfg["connect_timeout_s"])
                except Exception as e:  # noqa: BLE001
                    self.shutdown()
                    raise ValueError(
                        f"{_PREFIX}.remote_port: no KV producer answers at {host}:{port} ({e})"
                    ) from None
                if reply.get("role") != "kv_producer":
                    self.shutdown()
                    raise ValueError(f"{_PREFIX}.remote_port: {host}:{port} is not a KV producer ({reply})")

    def start_load_kv(self) -> None:
        meta = self._metadata
        if not isinstance(meta, P2pMetadata):
            return
        if meta.sends and self._producer is not None:
            self._producer.add(meta.sends)
        if self._consumer is not None:
            for release in meta.releases:
                self._consumer.jobs.put(release)
            for load in meta.loads:
                self._inflight[load.req_id] = load
                self._consumer.jobs.put(load)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        sending = self._producer.take_done() if self._producer is not None else set()
        recving: set[str] = set()
        if self._consumer is None:
            return sending, recving
        # Requests that finished (aborted) while loading: their blocks may be another request's by now.
        self._cancelled.update(r for r in finished_req_ids if r in self._inflight)
        for req_id, result in self._consumer.take_results().items():
            load = self._inflight.pop(req_id, None)
            if load is None:
                continue
            if req_id in self._cancelled:
                self._cancelled.discard(req_id)
                continue
            recving.add(req_id)
            if isinstance(result, Exception):
                logger.warning("request %s: pulling its KV failed (%s); recomputing its prompt", req_id, result)
                self._load_errors.update(load.block_ids)
                continue
            idx = torch.tensor(load.block_ids, dtype=torch.long, device=self._caches[0].device)
            for cache, buf in zip(self._caches, result):
                cache.index_copy_(self._block_dim, idx, buf)
                if buf.is_cuda:  # allocated on the puller thread's stream, read on this one: not reused before
                    buf.record_stream(torch.cuda.current_stream(buf.device))
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._producer is not None:
            self._producer.close()
            self._producer = None
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None


P2pNcclConnector = P2pConnector  # vLLM's name
