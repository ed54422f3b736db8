"""``PoolerConfig``: how a pooling model turns hidden states into one vector, read from the checkpoint.

Sources, in order: sentence-transformers' ``modules.json`` (its Pooling module's ``config.json`` gives the pooling
type, in the classic ``pooling_mode_*`` flags or the newer ``pooling_mode`` string; a Normalize module turns
normalization on), else the architecture's default (encoders pool the first token, CLS; decoders the last one).
Matryoshka support (``dimensions``) comes from config.json's ``is_matryoshka`` / ``matryoshka_dimensions``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

POOLING_TYPES = ("CLS", "MEAN", "LAST")

# Architectures that run as pooling models whatever ``runner`` says (there is nothing to generate with).
ENCODER_ARCHITECTURES = ("BertModel", "XLMRobertaModel", "RobertaModel")
# Encoders pool the first token by default; every other pooling model the last one.
_CLS_DEFAULT = ENCODER_ARCHITECTURES + (
    "BertForSequenceClassification",
    "XLMRobertaForSequenceClassification",
)


def config_num_labels(hf_config: Any) -> int:
    """A classifier's number of outputs: ``num_labels``, else the size of ``id2label`` (a plain config keeps only
    that), else transformers' default of 2."""
    num = getattr(hf_config, "num_labels", None)
    if num:
        return int(num)
    id2label = getattr(hf_config, "id2label", None) or {}
    return len(id2label) or 2


def is_pooling_architecture(architecture: str) -> bool:
    """Whether ``architecture`` is a pooling model by itself (an encoder or a sequence classifier)."""
    return architecture in ENCODER_ARCHITECTURES or architecture.endswith("ForSequenceClassification")


@dataclass
class PoolerConfig:
    pooling_type: str  # one of POOLING_TYPES
    normalize: bool  # the default of PoolingParams.normalize for embeddings
    is_classifier: bool  # a sequence-classification head: classify / score, not embed
    num_labels: int = 0  # classifier outputs (0 for an embedding model)
    is_matryoshka: bool = False
    matryoshka_dimensions: list[int] | None = None
    # sentence-transformers modules read, for the start-up log: ["Transformer", "Pooling", "Normalize"]
    st_modules: list[str] = field(default_factory=list)


def _read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def _st_pooling_type(cfg: dict[str, Any], path: str) -> str:
    """The pooling type a sentence-transformers Pooling ``config.json`` asks for (``ValueError`` if unsupported)."""
    mode = cfg.get("pooling_mode")
    if isinstance(mode, str):  # sentence-transformers >= 6: one string
        names = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST", "last_token": "LAST"}
        if mode.lower() in names:
            return names[mode.lower()]
        raise ValueError(f"{path}: pooling_mode {mode!r} is not supported (cls, mean and lasttoken are)")
    flags = {
        "pooling_mode_cls_token": "CLS",
        "pooling_mode_mean_tokens": "MEAN",
        "pooling_mode_lasttoken": "LAST",
    }
    unsupported = [
        k
        for k in (
            "pooling_mode_max_tokens",
            "pooling_mode_mean_sqrt_len_tokens",
            "pooling_mode_weightedmean_tokens",
        )
        if cfg.get(k)
    ]
    chosen = [v for k, v in flags.items() if cfg.get(k)]
    if unsupported or len(chosen) != 1:
        raise ValueError(
            f"{path}: exactly one of pooling_mode_cls_token, pooling_mode_mean_tokens, pooling_mode_lasttoken must "
            f"be set (got {[k for k in flags if cfg.get(k)] + unsupported})"
        )
    return chosen[0]


def _read_st_modules(model_path: str) -> tuple[str | None, bool | None, list[str]]:
    """(pooling type, normalize, module names) from ``modules.json``; Nones when there is none."""
    modules_path = os.path.join(model_path, "modules.json")
    if not os.path.isfile(modules_path):
        return None, None, []
    pooling_type = None
    normalize = False
    names = []
    for module in _read_json(modules_path):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        names.append(kind)
        if kind == "Pooling":
            cfg_path = os.path.join(model_path, module.get("path", ""), "config.json")
            pooling_type = _st_pooling_type(_read_json(cfg_path), cfg_path)
        elif kind == "Normalize":
            normalize = True
        elif kind not in ("Transformer",):
            raise ValueError(
                f"{modules_path}: sentence-transformers module {module.get('type')!r} is not supported "
                "(Transformer, Pooling and Normalize are)"
            )
    return pooling_type, normalize, names


_OVERRIDABLE = ("pooling_type", "normalize")


def apply_pooler_overrides(config: PoolerConfig, overrides: dict[str, Any] | None) -> PoolerConfig:
    """``pooler_config`` as vLLM takes it (``{"pooling_type": "MEAN", "normalize": false}``) over the checkpoint's
    settings; ``ValueError`` naming ``pooler_config`` and the key that is wrong."""
    if not overrides:
        return config
    if not isinstance(overrides, dict):
        raise ValueError(f"pooler_config must be a dict, got {type(overrides).__name__}")
    unknown = sorted(set(overrides) - set(_OVERRIDABLE))
    if unknown:
        raise ValueError(f"pooler_config: unknown keys {unknown}; supported: {', '.join(_OVERRIDABLE)}")
    pooling_type = overrides.get("pooling_type")
    if pooling_type is not None:
        if not isinstance(pooling_type, str) or pooling_type.upper() not in POOLING_TYPES:
            raise ValueError(
                f"pooler_config.pooling_type must be one of {', '.join(POOLING_TYPES)}, got {pooling_type!r}"
            )
        config.pooling_type = pooling_type.upper()
    normalize = overrides.get("normalize")
    if normalize is not None:
        if not isinstance(normalize, bool):
            raise ValueError(f"pooler_config.normalize must be a boolean, got {normalize!r}")
        config.normalize = normalize
    return config


def resolve_pooler_config(model_path: str, hf_config: Any, architecture: str) -> PoolerConfig:
    """The pooler settings of the checkpoint at ``model_path`` (see the module docstring)."""
    st_type, st_normalize, names = _read_st_modules(model_path)
    is_classifier = architecture.endswith("ForSequenceClassification")
    default_type = "CLS" if architecture in _CLS_DEFAULT else "LAST"
    num_labels = 0
    if is_classifier:
        num_labels = config_num_labels(hf_config)
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    return PoolerConfig(
        pooling_type=st_type or default_type,
        normalize=True if st_normalize is None else st_normalize,
        is_classifier=is_classifier,
        num_labels=num_labels,
        is_matryoshka=bool(getattr(hf_config, "is_matryoshka", False) or dims),
        matryoshka_dimensions=list(dims) if dims else None,
        st_modules=names,
    )
