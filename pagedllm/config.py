"""Start-up configuration: small dataclasses, each checked in ``__post_init__``, passed explicitly."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def resolve_model_path(model: str) -> str:
    """Return a local directory for ``model``: the path itself, or a hub snapshot when online.

    Raises ``ValueError`` when it is neither a directory with a config.json nor downloadable.
    """
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"model directory {model!r} has no config.json")
        return model
    if os.path.sep in model.strip("/") and model.count("/") > 1 or model.startswith((".", "/")):
        raise ValueError(f"model path {model!r} does not exist")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(
            model, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
        )
    except Exception as e:  # noqa: BLE001 - any hub failure means "not found" to the user
        raise ValueError(f"model {model!r} is neither a local directory nor reachable on the hub: {e}") from e


class PlainHFConfig:
    """An HF config's attributes as plain data (``PretrainedConfig.to_dict()``), readable with ``getattr``.

    This is what crosses to the engine core process: unpickling a transformers config class there would import
    transformers (seconds at start-up) only to read attributes. Nested configs stay dicts.
    """

    def __init__(self, attrs: dict[str, Any]) -> None:
        self.__dict__.update(attrs)

    @classmethod
    def from_hf(cls, config: Any) -> PlainHFConfig:
        """``config.to_dict()`` plus the aliases of its ``attribute_map`` (``num_experts`` for Qwen3-MoE's
        ``num_local_experts``, ...), which ``to_dict`` leaves out but model code reads."""
        attrs = config.to_dict()
        for alias, name in (getattr(config, "attribute_map", None) or {}).items():
            if alias not in attrs and name in attrs:
                attrs[alias] = attrs[name]
        return cls(attrs)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"PlainHFConfig({self.__dict__.get('model_type', '?')})"


@dataclass
class ModelConfig:
    model: str
    tokenizer: str | None = None
    dtype: str | torch.dtype = "auto"
    max_model_len: int | None = None
    seed: int = 0
    trust_remote_code: bool = False
    load_format: str = "auto"  # "auto" (safetensors) | "dummy" (random weights)
    served_model_name: str | None = None
    # vLLM's names: "fp8" (online from a float checkpoint, or an fp8 checkpoint), "gptq", "awq",
    # "compressed-tensors"; None reads config.json's quantization_config (see pagedllm.quantization)
    quantization: str | None = None
    # vLLM's names: "generate" (text generation), "pooling" (embed / classify / score), "auto": pooling for an
    # encoder or sequence-classification architecture or a sentence-transformers checkpoint (modules.json)
    runner: str = "auto"
    # vLLM's pooler_config: {"pooling_type": "CLS" | "MEAN" | "LAST", "normalize": bool} over the checkpoint's
    pooler_overrides: dict[str, Any] | None = None
    # Multimodal models (vLLM's names): the most items of each modality per prompt ({"image": N}; unset: 999), and
    # the directory under which file:// image URLs may be read (None: never), and the GiB of preprocessed images
    # the front-end keeps, keyed by content, so a repeated image skips the image processor (0: none).
    limit_mm_per_prompt: dict[str, int] | None = None
    allowed_local_media_path: str | None = None
    mm_processor_cache_gb: float = 4.0
    hf_config: Any = field(default=None, init=False, repr=False)
    model_path: str = field(default="", init=False)
    quant_config: Any = field(default=None, init=False, repr=False)  # QuantizationConfig | None
    runner_type: str = field(default="generate", init=False)  # "generate" | "pooling": what ``runner`` resolved to
    pooler_config: Any = field(default=None, init=False, repr=False)  # pagedllm.pooling.config.PoolerConfig
    # A multimodal model's whole HF config (vision tower, projector, text model); None for a text-only model, whose
    # hf_config is all there is. hf_config is then the text model's config.
    mm_hf_config: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        from transformers import AutoConfig

        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(
                f"load_format must be 'auto', 'safetensors' or 'dummy', got {self.load_format!r}"
            )
        self.model_path = resolve_model_path(self.model)
        if self.tokenizer is None:
            self.tokenizer = self.model_path
        self.hf_config = AutoConfig.from_pretrained(self.model_path, trust_remote_code=self.trust_remote_code)
        text_config = getattr(self.hf_config, "text_config", None)
        top_archs = getattr(self.hf_config, "architectures", None) or []
        from pagedllm.multimodal.processing import is_multimodal_architecture

        if top_archs and is_multimodal_architecture(top_archs[0]):
            # Images in, text out: the model is built from the whole config; everything else reads the text model's
            # config (layers, heads, vocabulary), named by the multimodal architecture.
            self.mm_hf_config = self.hf_config
            text_config.architectures = list(top_archs)
            self.hf_config = text_config
        elif text_config is not None and not hasattr(self.hf_config, "num_hidden_layers"):
            self.hf_config = text_config

        archs = getattr(self.hf_config, "architectures", None) or []
        if not archs:
            raise ValueError(f"config.json of {self.model!r} names no architectures")
        self._resolve_runner(archs[0])
        from pagedllm.quantization import resolve_quantization

        # ValueError naming the offending quantization_config field
        self.quant_config = resolve_quantization(self.quantization, self.hf_config)
        self.dtype = self._resolve_dtype(self.dtype)
        derived = self.derived_max_model_len()
        if self.max_model_len is None:
            self.max_model_len = derived
        elif not isinstance(self.max_model_len, int) or self.max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive integer, got {self.max_model_len!r}")
        elif self.max_model_len > derived:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) is larger than the model's maximum context ({derived})"
            )
        if self.served_model_name is None:
            self.served_model_name = self.model
        self._check_multimodal_options()

    def _check_multimodal_options(self) -> None:
        limit = self.limit_mm_per_prompt
        if limit is not None:
            if not isinstance(limit, dict) or any(
                k != "image" or not isinstance(v, int) or isinstance(v, bool) or v < 0 for k, v in limit.items()
            ):
                raise ValueError(
                    f'limit_mm_per_prompt must be a dict like {{"image": N}} with N >= 0, got {limit!r}'
                )
        path = self.allowed_local_media_path
        if path is not None and not os.path.isdir(path):
            raise ValueError(f"allowed_local_media_path {path!r} is not a directory")
        gb = self.mm_processor_cache_gb
        if isinstance(gb, bool) or not isinstance(gb, (int, float)) or not gb >= 0:
            raise ValueError(f"mm_processor_cache_gb must be a number >= 0, got {gb!r}")

    def _resolve_runner(self, architecture: str) -> None:
        """Set ``runner_type`` (and ``pooler_config`` for a pooling model); ``ValueError`` naming ``runner`` or
        listing the supported architectures."""
        from pagedllm.models.registry import get_model_class, get_pooling_model_class
        from pagedllm.pooling.config import (
            apply_pooler_overrides,
            is_pooling_architecture,
            resolve_pooler_config,
        )

        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner must be 'auto', 'generate' or 'pooling', got {self.runner!r}")
        runner = self.runner
        if runner == "auto":
            has_st = os.path.isfile(os.path.join(self.model_path, "modules.json"))
            runner = "pooling" if is_pooling_architecture(architecture) or has_st else "generate"
        if runner == "generate":
            if is_pooling_architecture(architecture):
                raise ValueError(
                    f"runner: {architecture} is a pooling model (embed / classify / score); it cannot generate "
                    "text: use runner='pooling'"
                )
            get_model_class(architecture, import_module=False)  # ValueError listing the supported ones
        else:
            get_pooling_model_class(architecture, import_module=False)
            config = resolve_pooler_config(self.model_path, self.hf_config, architecture)
            self.pooler_config = apply_pooler_overrides(config, self.pooler_overrides)
        if runner == "generate" and self.pooler_overrides:
            raise ValueError("pooler_config applies to pooling models only (runner='pooling')")
        self.runner_type = runner

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for key in ("hf_config", "mm_hf_config"):
            cfg = state.get(key)
            if cfg is not None and not isinstance(cfg, PlainHFConfig):
                state[key] = PlainHFConfig.from_hf(cfg)
        return state

    def _resolve_dtype(self, dtype: str | torch.dtype) -> torch.dtype:
        if isinstance(dtype, torch.dtype):
            return dtype
        if dtype == "auto":
            cfg = getattr(self.hf_config, "dtype", None) or self.hf_config.__dict__.get("torch_dtype")
            if isinstance(cfg, str):
                cfg = _DTYPES.get(cfg)
            # float32 checkpoints run in bfloat16 on GPUs, as in vLLM; on CPU we keep float32.
            return cfg if isinstance(cfg, torch.dtype) else torch.float32
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
        return _DTYPES[dtype]

    def derived_max_model_len(self) -> int:
        """The longest context served: the model's positions (``max_position_embeddings``). A sliding window does
        not cap it: the attention backends apply the window (per layer, see ``pagedllm/attention/base.py``)."""
        derived = int(getattr(self.hf_config, "max_position_embeddings", 2048) or 2048)
        if self.runner_type == "pooling":
            archs = getattr(self.hf_config, "architectures", None) or [""]
            if archs[0].startswith(("XLMRoberta", "Roberta")):  # positions start after pad_token_id
                derived -= int(getattr(self.hf_config, "pad_token_id", 1) or 0) + 1
            st_path = os.path.join(self.model_path, "sentence_bert_config.json")
            if os.path.isfile(st_path):
                with open(st_path) as f:
                    st_max = json.load(f).get("max_seq_length")
                if st_max:
                    derived = min(derived, int(st_max))
        return derived

    @property
    def sliding_window(self) -> int | None:
        """The attention window when the model uses one (Qwen2/3 configs carry one they do not use). Which layers
        use it is the model's business (``layer_types``; see ``pagedllm/models/llama.py``)."""
        window = getattr(self.hf_config, "sliding_window", None)
        if not window or getattr(self.hf_config, "use_sliding_window", True) is False:
            return None
        return int(window)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def is_multimodal(self) -> bool:
        return getattr(self, "mm_hf_config", None) is not None  # (configs pickled before the field: None)

    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    @property
    def num_kv_heads(self) -> int:
        cfg = self.hf_config
        return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)

    @property
    def head_dim(self) -> int:
        cfg = self.hf_config
        hd = getattr(cfg, "head_dim", None)
        return int(hd) if hd else cfg.hidden_size // cfg.num_attention_heads


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclass
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None  # size the cache by hand (bytes for all layers)
    num_gpu_blocks_override: int | None = None  # or by block count
    enable_prefix_caching: bool = True
    cpu_kv_cache_bytes_default: int = 1 << 30  # CPU: cache bytes when nothing else is given
    # "auto": the model dtype; "fp8" / "fp8_e4m3": float8_e4m3fn with per-layer k/v scales (vLLM's
    # kv_cache_dtype; scales from the checkpoint, else 1.0). See pagedllm/attention/base.py.
    cache_dtype: str = "auto"
    # True: a model mixing sliding-window and full-attention layers keeps every block for every layer (one KV cache
    # group) instead of freeing its sliding layers' blocks behind their window (vLLM's flag; core/kv_cache_manager.py)
    disable_hybrid_kv_cache_manager: bool = False

    def __post_init__(self) -> None:
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.cache_dtype!r}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two in [1, 128], got {self.block_size!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes!r}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override!r}")
        if not isinstance(self.disable_hybrid_kv_cache_manager, bool):
            raise ValueError(
                f"disable_hybrid_kv_cache_manager must be a bool, got {self.disable_hybrid_kv_cache_manager!r}"
            )

    def kv_cache_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's element type: ``model_dtype`` for "auto", else ``torch.float8_e4m3fn``."""
        return model_dtype if self.cache_dtype == "auto" else torch.float8_e4m3fn


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


USAGE_CONTEXTS = ("llm", "api_server")  # the offline ``LLM`` class, ``pagedllm serve``


def default_batch_limits(device: torch.device, usage_context: str = "llm") -> tuple[int, int]:
    """``(max_num_batched_tokens, max_num_seqs)`` when the user sets neither: vLLM's table. GPUs of at least
    70 GiB other than the A100 (H100, H200, ...): 16384 tokens offline, 8192 served, 1024 sequences; smaller
    GPUs: 8192 offline, 2048 served, 256 sequences. CPU: 8192 and 256 (one step prefills a whole CPU batch)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        if props.total_memory >= 70 * 2**30 and "a100" not in props.name.lower():
            return (16384 if usage_context == "llm" else 8192), 1024
        return (8192 if usage_context == "llm" else 2048), 256
    return 8192, 256


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass
class KVTransferConfig:
    """A KV connector (pagedllm/kv_transfer/): vLLM's ``kv_transfer_config``. ``kv_connector`` names a registered
    connector, or a class in ``kv_connector_module_path``; the connector reads ``kv_connector_extra_config``."""

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_connector_module_path: str | None = None
    # vLLM's top-level address fields (its P2pNcclConnector reads them); a connector's extra config may override
    kv_ip: str | None = None
    kv_port: int | None = None

    @classmethod
    def from_dict(cls, value: dict[str, Any] | KVTransferConfig) -> KVTransferConfig:
        if isinstance(value, KVTransferConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"kv_transfer_config must be a dict, got {type(value).__name__}")
        known = {
            "kv_connector", "kv_role", "kv_connector_extra_config", "kv_connector_module_path", "kv_ip", "kv_port"
        }  # fmt: skip
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown keys {unknown}; known: {sorted(known)}")
        if "kv_connector" not in value:
            raise ValueError("kv_transfer_config.kv_connector is required")
        return cls(**value)

    def __post_init__(self) -> None:
        if not isinstance(self.kv_connector, str) or not self.kv_connector:
            raise ValueError(f"kv_transfer_config.kv_connector must be a connector name, got {self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {KV_ROLES}, got {self.kv_role!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError(
                "kv_transfer_config.kv_connector_extra_config must be a dict, got "
                f"{type(self.kv_connector_extra_config).__name__}"
            )
        path = self.kv_connector_module_path
        if path is not None and (not isinstance(path, str) or not path):
            raise ValueError(f"kv_transfer_config.kv_connector_module_path must be a module name, got {path!r}")
        if self.kv_ip is not None and (not isinstance(self.kv_ip, str) or not self.kv_ip):
            raise ValueError(f"kv_transfer_config.kv_ip must be a host name or address, got {self.kv_ip!r}")
        if self.kv_port is not None:
            try:
                self.kv_port = int(self.kv_port)  # vLLM's examples give it as a string
            except (TypeError, ValueError):
                raise ValueError(f"kv_transfer_config.kv_port must be a port number, got {self.kv_port!r}") from None


def resolve_kv_transfer_config(
    kv_transfer_config: dict[str, Any] | KVTransferConfig | None,
    kv_offloading_size: float | None,
    kv_offloading_backend: str | None,
    swap_space: float | None,
) -> KVTransferConfig | None:
    """The connector the flags ask for: ``kv_transfer_config`` as given, or CPU offloading of
    ``kv_offloading_size`` GiB (vLLM's flag; ``swap_space``, vLLM's older name, sizes the same pool)."""
    size, size_field = kv_offloading_size, "kv_offloading_size"
    if swap_space is not None:
        if size is not None and size != swap_space:
            raise ValueError(
                f"swap_space ({swap_space} GiB) and kv_offloading_size ({size} GiB) size the same CPU pool: give one"
            )
        size, size_field = swap_space, "swap_space"
    if kv_offloading_backend not in (None, "native"):
        raise ValueError(f"kv_offloading_backend must be 'native', got {kv_offloading_backend!r}")
    if size is None:
        if kv_offloading_backend is not None:
            raise ValueError("kv_offloading_backend needs kv_offloading_size (GiB of CPU memory)")
        return None if kv_transfer_config is None else KVTransferConfig.from_dict(kv_transfer_config)
    if isinstance(size, bool) or not isinstance(size, (int, float)) or size <= 0:
        raise ValueError(f"{size_field} must be a positive number of GiB, got {size!r}")
    if kv_transfer_config is not None:
        raise ValueError(f"{size_field} turns on CPU offloading: it cannot be combined with kv_transfer_config")
    return KVTransferConfig(
        "OffloadingConnector", "kv_both", {"cpu_bytes_to_use": int(size * 2**30)}
    )


@dataclass
class SchedulerConfig:
    """``max_num_seqs`` / ``max_num_batched_tokens`` left None take the device's defaults
    (``default_batch_limits``) when the engine core starts (``resolve_defaults``), where the device is known."""

    max_model_len: int
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # "fcfs" | "priority"
    async_scheduling: bool = False  # plan step N+1 while step N runs (see core/scheduler.py)
    num_lookahead_tokens: int = 0  # KV slots reserved past a decoding request's tokens (draft-model drafts)
    usage_context: str = "llm"  # one of USAGE_CONTEXTS: which column of default_batch_limits applies
    # A waiting request is admitted only if the blocks left free still cover the next this-many tokens of every
    # running request (fewer when its max_tokens is nearer): admitting into the room they are about to grow
    # into would only get requests preempted and recomputed. 0: admit while blocks last (vLLM's rule).
    admission_headroom_tokens: int = field(default_factory=lambda: _env_int("PAGEDLLM_ADMISSION_HEADROOM", 128))
    # vLLM's burst knobs (core/scheduler.py has the rules). long_prefill_token_threshold > 0: no request computes
    # more than this many tokens in one step, and a prompt with more than this many tokens left is "long".
    # 0 (vLLM's default) is off, unless max_num_partial_prefills > 1 derives it as vLLM does (4% of max_model_len).
    long_prefill_token_threshold: int = 0
    # At most this many requests mid-prefill at once, of which at most max_long_partial_prefills long ones;
    # 1 and 1 (vLLM's defaults) leave admission unlimited, as in vLLM. Only vLLM's V0 engine implements these two.
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1

    def __post_init__(self) -> None:
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs!r}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens!r}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.admission_headroom_tokens < 0:
            raise ValueError(f"admission_headroom_tokens must be >= 0, got {self.admission_headroom_tokens!r}")
        if self.usage_context not in USAGE_CONTEXTS:
            raise ValueError(f"usage_context must be one of {USAGE_CONTEXTS}, got {self.usage_context!r}")
        self._check_partial_prefills()
        self._check_unchunked()

    def _check_partial_prefills(self) -> None:
        """vLLM's checks on the burst knobs (ValueError naming the field), and its derived threshold."""
        for name in ("long_prefill_token_threshold", "max_num_partial_prefills", "max_long_partial_prefills"):
            value, least = getattr(self, name), 0 if name == "long_prefill_token_threshold" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        if self.max_long_partial_prefills > self.max_num_partial_prefills:
            raise ValueError(
                f"max_long_partial_prefills ({self.max_long_partial_prefills}) must be <= max_num_partial_prefills "
                f"({self.max_num_partial_prefills})"
            )
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold > 0 chunks prompts: it needs enable_chunked_prefill")
        if self.max_num_partial_prefills > 1:
            if not self.enable_chunked_prefill:
                raise ValueError("max_num_partial_prefills > 1 needs chunked prefill (enable_chunked_prefill)")
            if self.long_prefill_token_threshold == 0:
                self.long_prefill_token_threshold = int(self.max_model_len * 0.04)
            if self.long_prefill_token_threshold > self.max_model_len:
                raise ValueError(
                    f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) must be <= max_model_len "
                    f"({self.max_model_len})"
                )

    def resolve_defaults(self, device: torch.device) -> None:
        """Fill whichever of ``max_num_batched_tokens`` / ``max_num_seqs`` is None from
        ``default_batch_limits(device, usage_context)``; without chunked prefill the token budget is at least
        ``max_model_len``."""
        if self.max_num_batched_tokens is not None and self.max_num_seqs is not None:
            return
        tokens, seqs = default_batch_limits(device, self.usage_context)
        if self.max_num_seqs is None:
            self.max_num_seqs = seqs
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = tokens if self.enable_chunked_prefill else max(self.max_model_len, tokens)
        self._check_unchunked()

    def _check_unchunked(self) -> None:
        tokens = self.max_num_batched_tokens
        if not self.enable_chunked_prefill and tokens is not None and tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when chunked prefill is off; raise it or lower max_model_len"
            )


SPEC_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "medusa", "mtp", "deepseek_mtp")
# Multi-token prediction: the draft head is an MTP layer shipped inside the target checkpoint (vLLM's "mtp"; its
# older name "deepseek_mtp" means the same here).
MTP_METHODS = ("mtp", "deepseek_mtp")
# Targets whose checkpoints hold MTP layers in the layout pagedllm/models/deepseek_mtp.py loads.
MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM",)
# Proposers that read the target's hidden states (its steps keep them: as computed, or in CUDA graphs' outputs).
HIDDEN_STATE_METHODS = ("eagle", "eagle3", "medusa", *MTP_METHODS)


@dataclass
class SpeculativeConfig:
    """``speculative_config`` as vLLM takes it: ``{"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_max": 4, "prompt_lookup_min": 2}`` or ``{"model": DRAFT_DIR, "num_speculative_tokens": k}``
    (method ``draft_model``, implied by ``model``) or ``{"method": "eagle" | "eagle3" | "medusa", "model": DIR, ...}``
    or ``{"method": "mtp", "num_speculative_tokens": k}`` (the target's own MTP layer; ``model`` defaults to the
    target's directory)."""

    num_speculative_tokens: int
    method: str | None = None
    model: str | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    draft_hf_config: Any = field(default=None, repr=False)  # the draft's HF config, read here once

    @classmethod
    def from_dict(cls, spec: dict[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        if isinstance(spec, SpeculativeConfig):
            return spec
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(spec).__name__}")
        names = {"num_speculative_tokens", "method", "model", "prompt_lookup_max", "prompt_lookup_min"}
        unknown = sorted(set(spec) - names)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown field(s) {', '.join(unknown)}; known: {sorted(names)}"
            )
        if "num_speculative_tokens" not in spec:
            if spec.get("method") not in MTP_METHODS:
                raise ValueError("speculative_config.num_speculative_tokens is required")
            spec = {**spec, "num_speculative_tokens": None}  # as vLLM: the checkpoint's number of MTP layers
        return cls(**spec)

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if k is None and self.method in MTP_METHODS:
            pass  # check_target sets it
        elif isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer >= 1, got {k!r}")
        if self.method is None:
            if self.model is None:
                methods = ", ".join(SPEC_METHODS)
                raise ValueError(
                    f"speculative_config.method is required (one of {methods}) unless model is given"
                )
            self.method = "draft_model"
        if self.method not in SPEC_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(SPEC_METHODS)}, got {self.method!r}"
            )
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is None and hi is None:
                lo = hi = 5
            lo = hi if lo is None else lo
            hi = lo if hi is None else hi
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {v!r}")
            if hi < lo:
                raise ValueError(
                    f"speculative_config.prompt_lookup_max ({hi}) must be >= prompt_lookup_min ({lo})"
                )
            self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
            if self.model is not None:
                raise ValueError("speculative_config.model is not used with method 'ngram'")
        elif self.method in MTP_METHODS and self.model is None:
            pass  # the target's own checkpoint (check_target fills it in)
        else:
            if self.model is None:
                raise ValueError(f"speculative_config.model is required with method {self.method!r}")
            if not os.path.isdir(self.model) or not os.path.isfile(os.path.join(self.model, "config.json")):
                raise ValueError(
                    f"speculative_config.model {self.model!r} is not a model directory with a config.json"
                )

    def check_target(self, target: ModelConfig) -> None:
        """Read the draft's config and check it can serve ``target`` (``ValueError`` naming the field)."""
        if self.method in ("ngram", "medusa"):
            return  # Medusa heads' config.json is no transformers config: MedusaProposer reads and checks it
        if self.method in MTP_METHODS:
            self._check_mtp_target(target)
            return
        from transformers import AutoConfig

        self.draft_hf_config = PlainHFConfig.from_hf(AutoConfig.from_pretrained(self.model))
        vocab = getattr(self.draft_hf_config, "vocab_size", None)
        if self.method == "draft_model" and vocab != target.vocab_size:
            raise ValueError(
                f"speculative_config.model: the draft's vocab_size ({vocab}) differs from the target's "
                f"({target.vocab_size}); a draft model must share the target's tokenizer"
            )

    def _check_mtp_target(self, target: ModelConfig) -> None:
        """An MTP draft is the target's own MTP layer: the architecture must have one in the layout we load, the
        config must declare it (``num_nextn_predict_layers``) and the checkpoint hold its weights."""
        from pagedllm.models.deepseek_mtp import num_mtp_layers

        arch = (getattr(target.hf_config, "architectures", None) or ["?"])[0]
        where = f"speculative_config.method {self.method!r}"
        if arch not in MTP_ARCHITECTURES:
            raise ValueError(
                f"{where} needs a target with multi-token-prediction layers ({', '.join(MTP_ARCHITECTURES)}); "
                f"{arch} has none"
            )
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = num_mtp_layers(target.hf_config)
        if target.quant_config is not None:
            raise ValueError(f"{where} with a quantized target is not supported yet")
        num_layers = target.hf_config.num_hidden_layers
        if num_mtp_layers(target.hf_config) < 1:
            raise ValueError(
                f"{where}: the target's config declares no MTP layers (num_nextn_predict_layers is 0 or absent)"
            )
        if self.model is None:
            self.model = target.model_path
        elif os.path.realpath(self.model) != os.path.realpath(target.model_path):
            raise ValueError(
                f"speculative_config.model must be the target's own checkpoint with method {self.method!r} "
                "(or be left out)"
            )
        if target.load_format == "dummy":
            return
        from pagedllm.spec_decode.mtp import checkpoint_has_mtp_layer

        if not checkpoint_has_mtp_layer(self.model, num_layers):
            raise ValueError(
                f"{where}: the checkpoint {self.model!r} has no MTP layer weights (model.layers.{num_layers}.*), "
                "though its config declares num_nextn_predict_layers"
            )


@dataclass
class LoRAConfig:
    """Multi-LoRA serving (vLLM's names and defaults): at most ``max_loras`` distinct adapters per step (GPU
    slots), of rank <= ``max_lora_rank``, and ``max_cpu_loras`` (default ``max_loras``) kept on the host."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        cpu = self.max_cpu_loras
        if isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < self.max_loras:
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), got {cpu!r}")


@dataclass
class ParallelConfig:
    # Whole engine copies, each with its own KV cache (and GPU); see engine/data_parallel.py.
    data_parallel_size: int = 1
    # Ranks one model is sharded over (pagedllm/distributed): worker processes on this node.
    tensor_parallel_size: int = 1
    # "mp" (worker processes on this node), "ray" (Ray actors, any node of a Ray cluster; see
    # pagedllm/distributed/executor.py) or None: make_engine_config picks one (``default_executor_backend``).
    distributed_executor_backend: str | None = None
    # Stages the decoder layers are split over, each of tensor_parallel_size ranks (pagedllm/distributed).
    pipeline_parallel_size: int = 1
    # Decoder layers per stage; None: make_engine_config fills in vLLM's even split (or VLLM_PP_LAYER_PARTITION).
    pp_layer_partition: tuple[int, ...] | None = None
    # MoE models under tensor parallelism: each rank holds E / T whole experts instead of every expert's slice of
    # the intermediate dim (vLLM's --enable-expert-parallel; nothing changes without TP > 1).
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size"):
            d = getattr(self, name)
            if isinstance(d, bool) or not isinstance(d, int) or d < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {d!r}")
        backend = self.distributed_executor_backend
        if backend not in (None, "mp", "ray"):
            raise ValueError(
                f"distributed_executor_backend must be 'mp' (worker processes on this node), 'ray' (Ray actors, "
                f"several nodes) or None, got {backend!r}"
            )
        if backend == "ray":
            if importlib.util.find_spec("ray") is None:
                raise ValueError("distributed_executor_backend 'ray' needs Ray: pip install ray")
            if self.data_parallel_size > 1:
                raise ValueError(
                    "data_parallel_size > 1 with distributed_executor_backend 'ray' is not supported yet "
                    "(use distributed_executor_backend 'mp')"
                )
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel must be a bool, got {self.enable_expert_parallel!r}")

    @property
    def world_size(self) -> int:
        """Ranks (processes, GPUs) one engine uses: ``pipeline_parallel_size * tensor_parallel_size``."""
        return self.pipeline_parallel_size * self.tensor_parallel_size

    def default_executor_backend(self, device_type: str) -> str:
        """vLLM's rule for ``distributed_executor_backend=None``: "ray" when on CUDA the ranks outnumber this
        node's GPUs and Ray is installed (one engine, no data parallelism), else "mp"."""
        if (
            device_type == "cuda"
            and self.data_parallel_size == 1
            and self.world_size > torch.cuda.device_count()
            and importlib.util.find_spec("ray") is not None
        ):
            return "ray"
        return "mp"


@dataclass
class DeviceConfig:
    device: str | torch.device = "auto"

    def __post_init__(self) -> None:
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            self.device = torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(f"device {self.device!r} is not a valid torch device") from e
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for but CUDA is not available")


CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


_LEVEL_MODES = {0: "NONE", 1: "PIECEWISE", 2: "FULL_AND_PIECEWISE", 3: "FULL_AND_PIECEWISE"}


def parse_compilation_config(
    value: dict[str, Any] | str | int | None = None, optimization_level: int | None = None
) -> str:
    """vLLM's ``compilation_config`` and ``optimization_level`` (``-O0`` .. ``-O3``) -> the CUDA graph mode, one of
    ``CUDAGRAPH_MODES``.

    The modes: ``NONE`` no graphs (as ``enforce_eager``); ``FULL_DECODE_ONLY`` whole-forward graphs for pure-decode
    (and verification) batches only; ``PIECEWISE`` graphs around eager attention for every step; ``FULL_AND_PIECEWISE``
    both, whole graphs for decodes and pieces for the rest. ``FULL`` (whole graphs for mixed batches too) is beyond
    the Triton backend: it falls back to ``FULL_AND_PIECEWISE``, as vLLM does for such backends.

    ``compilation_config``: a dict, its JSON, or an object with a ``cudagraph_mode`` attribute (vLLM's
    ``CompilationConfig``); its ``cudagraph_mode`` (a name, any case, or vLLM's enum) wins over the level. Its other
    keys configure torch.compile in vLLM, which pagedllm does not use: they are ignored, with a warning. An integer
    (or its JSON) is a level, as vLLM once took it. The level's mode, as in vLLM: 0 NONE, 1 PIECEWISE, 2 and 3 (and
    no level) FULL_AND_PIECEWISE. ``ValueError`` naming the field for anything else."""
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"compilation_config: not valid JSON ({e})") from None
    if isinstance(value, int) and not isinstance(value, bool):
        value, optimization_level = None, value if optimization_level is None else optimization_level
    if optimization_level is not None and optimization_level not in _LEVEL_MODES:
        raise ValueError(f"optimization_level must be 0, 1, 2 or 3, got {optimization_level!r}")
    mode = None
    if value is not None:
        if isinstance(value, dict):
            ignored = sorted(k for k in value if k != "cudagraph_mode")
            mode = value.get("cudagraph_mode")
        elif hasattr(value, "cudagraph_mode"):
            ignored, mode = [], value.cudagraph_mode
        else:
            raise ValueError(f"compilation_config must be a dict (or its JSON), got {type(value).__name__}")
        if ignored:
            logger.warning(
                "compilation_config: %s ignored (torch.compile settings; pagedllm does not use it)", ignored
            )
    if mode is None:
        return _LEVEL_MODES[2 if optimization_level is None else optimization_level]
    mode = str(getattr(mode, "name", mode)).upper()  # a string, or vLLM's CUDAGraphMode enum
    if mode not in CUDAGRAPH_MODES:
        raise ValueError(
            f"compilation_config.cudagraph_mode must be one of {list(CUDAGRAPH_MODES)}, got {mode!r}"
        )
    if mode == "FULL":
        logger.warning(
            "cudagraph_mode FULL: mixed batches cannot be captured whole; using FULL_AND_PIECEWISE"
        )
        mode = "FULL_AND_PIECEWISE"
    return mode


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device_config: DeviceConfig
    enforce_eager: bool = False
    # CUDA graphs (parse_compilation_config): FULL_AND_PIECEWISE, FULL_DECODE_ONLY, PIECEWISE or NONE
    cudagraph_mode: str = "FULL_AND_PIECEWISE"
    attention_backend: str | None = None  # None = automatic
    log_stats: bool = True
    check_integrity_on_idle: bool = True  # check the KV block pool each time the engine runs out of work
    reasoning_parser: str | None = None  # structured outputs then apply after the reasoning ends
    speculative_config: SpeculativeConfig | None = None  # None: no speculative decoding
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    lora_config: LoRAConfig | None = None  # None: LoRA adapters are refused
    enable_sleep_mode: bool = False  # LLM.sleep / wake_up may release device memory (pagedllm/worker/sleep_mode.py)
    worker_extension_cls: str | None = None  # "module.Class" mixed into every rank's Worker (collective_rpc)
    kv_transfer_config: KVTransferConfig | None = None  # None: no KV connector
    # GiB of each rank's decoder-layer weights kept in host memory and streamed to the device every forward
    # (vLLM's cpu_offload_gb; pagedllm/worker/weight_offload.py). 0: every weight on the device.
    cpu_offload_gb: float = 0

    def __post_init__(self) -> None:
        check_cpu_offload_gb(self.cpu_offload_gb)

    @property
    def data_parallel_size(self) -> int:
        return self.parallel_config.data_parallel_size


def check_cpu_offload_gb(value: Any) -> None:
    """``ValueError`` naming ``cpu_offload_gb`` unless it is a finite number >= 0 (GiB)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"cpu_offload_gb must be a number of GiB, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"cpu_offload_gb must be a finite number >= 0 (GiB), got {value!r}")


def _check_pipeline_parallel(parallel_config: ParallelConfig, model_config: ModelConfig) -> None:
    """``ValueError`` naming ``pipeline_parallel_size`` for what pipeline parallelism does not support yet; fills
    ``parallel_config.pp_layer_partition`` (vLLM's even split, or ``VLLM_PP_LAYER_PARTITION``)."""
    from pagedllm.distributed.parallel_state import (
        PP_LAYER_PARTITION_ENV,
        pp_layer_partition,
        verify_pp_config,
    )

    pp = parallel_config.pipeline_parallel_size
    if parallel_config.data_parallel_size > 1:
        raise ValueError("data_parallel_size > 1 with pipeline_parallel_size > 1 is not supported yet")
    verify_pp_config(model_config.hf_config, pp)  # the architecture, and no more stages than layers
    if parallel_config.pp_layer_partition is None:
        parallel_config.pp_layer_partition = pp_layer_partition(
            model_config.num_layers, pp, os.environ.get(PP_LAYER_PARTITION_ENV)
        )
    verify_pp_config(model_config.hf_config, pp, parallel_config.pp_layer_partition)


def _apply_expert_parallel(parallel_config: ParallelConfig, model_config: ModelConfig) -> None:
    """Check that an MoE model's experts split over the TP ranks (``ValueError`` naming the field; MoE families
    without tensor parallelism name ``tensor_parallel_size``) and hand ``enable_expert_parallel`` to the model
    through its HF config (what the model classes see)."""
    from pagedllm.layers.fused_moe import EXPERT_PARALLEL_ATTR, verify_moe_tp_config

    tp, ep = parallel_config.tensor_parallel_size, parallel_config.enable_expert_parallel
    verify_moe_tp_config(model_config.hf_config, tp, ep)
    if tp > 1:  # without TP the flag does nothing (as vLLM); the attribute's absence reads as False
        setattr(model_config.hf_config, EXPERT_PARALLEL_ATTR, ep)


def _check_multimodal_composition(
    model_config: ModelConfig,
    spec: Any,
    pp: int,
    kv_transfer: Any,
    quantization: str | None,
) -> None:
    """What a multimodal model does not run with yet: refused (``ValueError`` naming the option), never
    ignored. Tensor parallelism works: the text model shards, the vision tower runs whole on every rank; so do data
    parallelism (each rank's engine encodes its own requests' images), n-gram speculation (its drafts are text
    tokens the target verifies), CPU offloading (blocks over an image are keyed by its content, like the device
    prefix cache's; an image whose tokens all load needs no encoding) and LoRA on the text model."""
    for name, on in (
        ("speculative_config (other than n-gram)", spec is not None and spec.method != "ngram"),
        ("pipeline_parallel_size", pp > 1),
        (
            "kv_transfer_config (other than CPU offloading)",
            kv_transfer is not None and kv_transfer.kv_connector != "OffloadingConnector",
        ),
        ("quantization", quantization is not None or model_config.quant_config is not None),
        ("runner='pooling'", model_config.runner_type == "pooling"),
    ):
        if on:
            arch = model_config.hf_config.architectures[0]
            raise ValueError(f"{name} is not supported with a multimodal model ({arch}) yet")


def _check_pooling_options(
    model_config: ModelConfig, speculative_config: Any, enable_lora: bool, tp: int, pp: int, dp: int
) -> None:
    """A pooling model runs on one device without speculative decoding or LoRA (``ValueError`` naming the
    option)."""
    for name, on in (
        ("speculative_config", speculative_config is not None),
        ("enable_lora", enable_lora),
        ("tensor_parallel_size", tp > 1),
        ("pipeline_parallel_size", pp > 1),
        ("data_parallel_size", dp > 1),
    ):
        if on:
            raise ValueError(f"{name} is not supported with a pooling model ({model_config.model})")


def make_engine_config(
    model: str,
    *,
    tokenizer: str | None = None,
    dtype: str | torch.dtype = "auto",
    max_model_len: int | None = None,
    block_size: int = 16,
    gpu_memory_utilization: float = 0.9,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
    seed: int = 0,
    device: str = "auto",
    load_format: str = "auto",
    trust_remote_code: bool = False,
    kv_cache_memory_bytes: int | None = None,
    num_gpu_blocks_override: int | None = None,
    enforce_eager: bool = False,
    compilation_config: dict[str, Any] | str | int | None = None,
    optimization_level: int | None = None,
    served_model_name: str | None = None,
    attention_backend: str | None = None,
    scheduling_policy: str = "fcfs",
    long_prefill_token_threshold: int = 0,
    max_num_partial_prefills: int = 1,
    max_long_partial_prefills: int = 1,
    check_integrity_on_idle: bool = True,
    async_scheduling: bool | None = None,
    reasoning_parser: str | None = None,
    speculative_config: dict[str, Any] | SpeculativeConfig | None = None,
    data_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    distributed_executor_backend: str | None = None,
    enable_expert_parallel: bool = False,
    quantization: str | None = None,
    enable_lora: bool = False,
    max_loras: int = 1,
    max_lora_rank: int = 16,
    max_cpu_loras: int | None = None,
    kv_cache_dtype: str = "auto",
    disable_hybrid_kv_cache_manager: bool = False,
    kv_transfer_config: dict[str, Any] | KVTransferConfig | None = None,
    kv_offloading_size: float | None = None,
    kv_offloading_backend: str | None = None,
    swap_space: float | None = None,
    usage_context: str = "llm",
    enable_sleep_mode: bool = False,
    worker_extension_cls: str | None = None,
    runner: str = "auto",
    pooler_config: dict[str, Any] | None = None,
    cpu_offload_gb: float = 0,
    limit_mm_per_prompt: dict[str, int] | None = None,
    allowed_local_media_path: str | None = None,
    mm_processor_cache_gb: float = 4.0,
) -> EngineConfig:
    """Build every config from vLLM-named keyword arguments (what ``LLM(...)`` and ``pagedllm serve`` take).
    ``usage_context``: "llm" (offline) or "api_server", which picks the batch defaults (``default_batch_limits``)."""
    if reasoning_parser is not None:
        from pagedllm.entrypoints.openai.reasoning_parsers import get_reasoning_parser

        get_reasoning_parser(reasoning_parser)  # ValueError naming the valid ones
    # ValueError naming the field, before anything is loaded
    kv_transfer = resolve_kv_transfer_config(
        kv_transfer_config, kv_offloading_size, kv_offloading_backend, swap_space
    )
    if kv_transfer is not None:
        from pagedllm.kv_transfer.factory import get_connector_class

        get_connector_class(kv_transfer)  # an unknown name, a module that does not import, a role it refuses
    cudagraph_mode = parse_compilation_config(compilation_config, optimization_level)
    check_cpu_offload_gb(cpu_offload_gb)
    if enable_sleep_mode and speculative_config is not None:
        raise ValueError("enable_sleep_mode: sleep mode with speculative decoding is not supported yet")
    if worker_extension_cls is not None:
        from pagedllm.worker.worker import load_extension_class

        load_extension_class(worker_extension_cls)  # ValueError naming worker_extension_cls
    device_config = DeviceConfig(device)
    lora_config = LoRAConfig(max_loras, max_lora_rank, max_cpu_loras) if enable_lora else None
    spec = None if speculative_config is None else SpeculativeConfig.from_dict(speculative_config)
    model_config = ModelConfig(
        model=model,
        tokenizer=tokenizer,
        dtype=dtype,
        max_model_len=max_model_len,
        seed=seed,
        trust_remote_code=trust_remote_code,
        load_format=load_format,
        served_model_name=served_model_name,
        quantization=quantization,
        runner=runner,
        pooler_overrides=pooler_config,
        limit_mm_per_prompt=limit_mm_per_prompt,
        allowed_local_media_path=allowed_local_media_path,
        mm_processor_cache_gb=mm_processor_cache_gb,
    )
    if model_config.is_multimodal:
        _check_multimodal_composition(
            model_config, spec, pipeline_parallel_size, kv_transfer, quantization
        )  # fmt: skip
    if model_config.runner_type == "pooling":
        _check_pooling_options(
            model_config,
            speculative_config,
            enable_lora,
            tensor_parallel_size,
            pipeline_parallel_size,
            data_parallel_size,
        )
        if cpu_offload_gb:
            raise ValueError(
                f"cpu_offload_gb is not supported with a pooling model ({model_config.model}); use runner='generate' "
                "or cpu_offload_gb=0"
            )
        if enable_sleep_mode:
            raise ValueError("enable_sleep_mode: sleep mode is for generating models; a pooling model has none")
    if dtype == "auto":
        # As vLLM: float32 checkpoints run in bfloat16 on GPUs. On CPU half types are slow: use float32.
        if device_config.device.type == "cuda" and model_config.dtype == torch.float32:
            model_config.dtype = torch.bfloat16
        elif device_config.device.type == "cpu":
            model_config.dtype = torch.float32
    cache_config = CacheConfig(
        block_size=block_size,
        gpu_memory_utilization=gpu_memory_utilization,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        num_gpu_blocks_override=num_gpu_blocks_override,
        enable_prefix_caching=enable_prefix_caching,
        cache_dtype=kv_cache_dtype,
        disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager,
    )
    scheduler_config = SchedulerConfig(
        max_model_len=model_config.max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=enable_chunked_prefill,
        policy=scheduling_policy,
        long_prefill_token_threshold=long_prefill_token_threshold,
        max_num_partial_prefills=max_num_partial_prefills,
        max_long_partial_prefills=max_long_partial_prefills,
        usage_context=usage_context,
        # None: on where it measures faster (CUDA, where the GPU would otherwise wait for Python); off on CPU,
        # where the host computes the step itself and there is nothing to overlap.
        async_scheduling=device_config.device.type == "cuda"
        if async_scheduling is None
        else async_scheduling,
    )
    parallel_config = ParallelConfig(
        data_parallel_size,
        tensor_parallel_size,
        distributed_executor_backend,
        pipeline_parallel_size=pipeline_parallel_size,
        enable_expert_parallel=enable_expert_parallel,
    )
    if parallel_config.world_size > 1 and parallel_config.distributed_executor_backend is None:
        parallel_config.distributed_executor_backend = parallel_config.default_executor_backend(
            device_config.device.type
        )
        if parallel_config.distributed_executor_backend == "ray":
            logger.info(
                "%d ranks but %d GPUs on this node: distributed_executor_backend 'ray'",
                parallel_config.world_size,
                torch.cuda.device_count(),
            )
    _apply_expert_parallel(parallel_config, model_config)
    if pipeline_parallel_size > 1:
        _check_pipeline_parallel(parallel_config, model_config)
    if tensor_parallel_size > 1:
        from pagedllm.distributed.parallel_state import verify_tp_config

        verify_tp_config(model_config.hf_config, tensor_parallel_size)  # ValueError naming the field
    if parallel_config.pipeline_parallel_size > 1:
        # The stages exchange step N's sampled tokens on the host before step N+1 (pagedllm/distributed/executor.py;
        # under TP alone rank 0 broadcasts them on the device instead, so scheduling stays asynchronous).
        if async_scheduling:
            raise ValueError("async_scheduling=True with pipeline_parallel_size > 1 is not supported yet")
        scheduler_config.async_scheduling = False
    if spec is not None:
        spec.check_target(model_config)
        if async_scheduling is None and scheduler_config.async_scheduling:
            # Speculation runs asynchronously when asked (async_scheduling=True): exact, checked on the CPU; it stays
            # synchronous by default until a GPU run shows the asynchronous loop faster with it.
            scheduler_config.async_scheduling = False
        if spec.method not in ("ngram", "medusa"):  # proposers that write their own KV for the drafts
            scheduler_config.num_lookahead_tokens = spec.num_speculative_tokens
        if spec.method in MTP_METHODS and parallel_config.tensor_parallel_size > 1:
            raise ValueError(
                f"speculative_config.method {spec.method!r} with tensor_parallel_size > 1 is not supported yet"
            )
    if kv_transfer is not None:
        for what, used in (
            ("speculative_config", spec is not None),
            ("tensor_parallel_size > 1 or pipeline_parallel_size > 1", parallel_config.world_size > 1),
            ("data_parallel_size > 1", parallel_config.data_parallel_size > 1),
        ):
            if used:
                raise ValueError(f"kv_transfer_config with {what} is not supported yet")
    return EngineConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        device_config=device_config,
        enforce_eager=enforce_eager,
        cudagraph_mode=cudagraph_mode,
        attention_backend=attention_backend,
        check_integrity_on_idle=check_integrity_on_idle,
        reasoning_parser=reasoning_parser,
        speculative_config=spec,
        parallel_config=parallel_config,
        lora_config=lora_config,
        enable_sleep_mode=enable_sleep_mode,
        worker_extension_cls=worker_extension_cls,
        kv_transfer_config=kv_transfer,
        cpu_offload_gb=cpu_offload_gb,
    )
