"""Connectors by name: built-in ones are imported on first use; others register here or are found through
``kv_connector_module_path`` (a module that defines a class named ``kv_connector``)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pagedllm.kv_transfer.base import KVConnectorBase, KVConnectorRole

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig, KVTransferConfig

# name -> (module, class name)
_REGISTRY: dict[str, tuple[str, str]] = {
    "OffloadingConnector": ("pagedllm.kv_transfer.cpu_offloading", "OffloadingConnector"),
    "P2pConnector": ("pagedllm.kv_transfer.p2p", "P2pConnector"),
    "P2pNcclConnector": ("pagedllm.kv_transfer.p2p", "P2pConnector"),  # vLLM's name for it
}


def register_connector(name: str, module: str, class_name: str) -> None:
    """Make ``name`` build ``module.class_name`` (imported when first built)."""
    if name in _REGISTRY and _REGISTRY[name] != (module, class_name):
        raise ValueError(f"kv_connector {name!r} is already registered as {_REGISTRY[name]}")
    _REGISTRY[name] = (module, class_name)


def registered_connectors() -> list[str]:
    return sorted(_REGISTRY)


def get_connector_class(transfer: KVTransferConfig) -> type[KVConnectorBase]:
    """The class ``transfer`` names; ``ValueError`` naming the field when it cannot be found."""
    name = transfer.kv_connector
    if transfer.kv_connector_module_path is not None:
        module_name, class_name = transfer.kv_connector_module_path, name
    elif name in _REGISTRY:
        module_name, class_name = _REGISTRY[name]
    else:
        raise ValueError(
            f"kv_transfer_config.kv_connector: unknown connector {name!r}; registered: "
            f"{', '.join(registered_connectors())} (or give kv_connector_module_path)"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"kv_transfer_config.kv_connector_module_path: cannot import {module_name!r}: {e}") from e
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase)):
        raise ValueError(
            f"kv_transfer_config.kv_connector: {module_name!r} has no KVConnectorBase subclass named {class_name!r}"
        )
    if transfer.kv_role not in cls.supported_roles:
        raise ValueError(
            f"kv_transfer_config.kv_role: {name} takes {' or '.join(cls.supported_roles)}, got {transfer.kv_role!r}"
        )
    cls.check_config(transfer)
    return cls


def create_connector(config: EngineConfig, role: KVConnectorRole, kv_block_bytes: int) -> KVConnectorBase:
    """One side of the configured connector."""
    assert config.kv_transfer_config is not None
    return get_connector_class(config.kv_transfer_config)(config, role, kv_block_bytes)
