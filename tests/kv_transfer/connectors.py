"""Connectors that live outside the package (found through ``kv_connector_module_path``)."""

from __future__ import annotations

from pagedllm.kv_transfer.base import KVConnectorBase
from pagedllm.kv_transfer.cpu_offloading import OffloadingConnector


class FailingLoadConnector(OffloadingConnector):
    """CPU offloading whose every load fails: it writes garbage into the device blocks it should fill and reports
    them all as failed, so the engine must recompute them."""

    def load_blocks(self, loads: list[tuple[int, int]]) -> set[int]:
        d = self._block_dim
        for dev in self._dev_caches:
            for _, block_id in loads:
                dev.narrow(d, block_id, 1).fill_(1e4)
        return {block_id for _, block_id in loads}


class DelayedFreeConnector(KVConnectorBase):
    """Keeps a finished request's blocks until the worker side has seen it finish (as a connector that sends KV
    to another engine would, until the send is done)."""

    def request_finished(self, request, block_ids):
        return True, None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        return set(finished_req_ids), set()


class RecordingConnector(KVConnectorBase):
    """Records the worker-side calls of each step, in order."""

    calls: list[tuple] = []  # class-level: the test reads what the engine's instance did

    def start_load_kv(self) -> None:
        self.calls.append(("start_load_kv",))

    def wait_for_layer_load(self, layer: int) -> None:
        self.calls.append(("wait_for_layer_load", layer))

    def save_kv_layer(self, layer, kv_layer, attn_metadata) -> None:
        assert kv_layer is self.kv_caches[layer]
        self.calls.append(("save_kv_layer", layer))

    def wait_for_save(self) -> None:
        self.calls.append(("wait_for_save",))
