"""Pooling models: per-request settings (``PoolingParams``), the checkpoint's pooling settings (``PoolerConfig``)
and the poolers that turn a step's hidden states into one vector per request."""

from pagedllm.pooling.params import POOLING_TASKS, PoolingParams

__all__ = ["POOLING_TASKS", "PoolingParams"]
