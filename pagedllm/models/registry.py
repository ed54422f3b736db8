"""HF architecture name -> model class, imported on first use."""

from __future__ import annotations

import importlib

from torch import nn

# architecture name in config.json -> (module under pagedllm.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "GemmaForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("llama", "Phi3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v2", "DeepseekV3ForCausalLM"),
    # Images in, text out (pagedllm/multimodal).
    "LlavaForConditionalGeneration": ("llava", "LlavaForConditionalGeneration"),
    "LlavaNextForConditionalGeneration": ("llava", "LlavaNextForConditionalGeneration"),
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Gemma3ForConditionalGeneration": ("gemma3_mm", "Gemma3ForConditionalGeneration"),
}


# Pooling models (runner="pooling"): architecture -> (module, class). A decoder named by its causal-LM
# architecture runs here without its LM head (an embedder such as Qwen3-Embedding).
_POOLING_MODELS: dict[str, tuple[str, str]] = {
    "BertModel": ("bert", "BertModel"),
    "BertForSequenceClassification": ("bert", "BertForSequenceClassification"),
    "XLMRobertaModel": ("bert", "XLMRobertaModel"),
    "RobertaModel": ("bert", "XLMRobertaModel"),
    "XLMRobertaForSequenceClassification": ("bert", "XLMRobertaForSequenceClassification"),
    "LlamaForCausalLM": ("decoder_pooling", "DecoderEmbeddingModel"),
    "LlamaModel": ("decoder_pooling", "DecoderEmbeddingModel"),
    "Qwen2ForCausalLM": ("decoder_pooling", "Qwen2EmbeddingModel"),
    "Qwen2Model": ("decoder_pooling", "Qwen2EmbeddingModel"),
    "Qwen3ForCausalLM": ("decoder_pooling", "Qwen3EmbeddingModel"),
    "Qwen3Model": ("decoder_pooling", "Qwen3EmbeddingModel"),
    "LlamaForSequenceClassification": ("decoder_pooling", "LlamaForSequenceClassification"),
    "Qwen2ForSequenceClassification": ("decoder_pooling", "Qwen2ForSequenceClassification"),
    "Qwen3ForSequenceClassification": ("decoder_pooling", "Qwen3ForSequenceClassification"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def supported_pooling_architectures() -> list[str]:
    return sorted(_POOLING_MODELS)


def get_pooling_model_class(architecture: str, import_module: bool = True) -> type[nn.Module] | None:
    """The pooling-model class for ``architecture``; ``ValueError`` naming the supported ones when it is
    unknown."""
    if architecture not in _POOLING_MODELS:
        raise ValueError(
            f"architecture {architecture!r} cannot run as a pooling model (runner='pooling'); supported: "
            f"{', '.join(supported_pooling_architectures())}"
        )
    if not import_module:
        return None
    module_name, class_name = _POOLING_MODELS[architecture]
    module = importlib.import_module(f"pagedllm.models.{module_name}")
    return getattr(module, class_name)


def get_model_class(architecture: str, import_module: bool = True) -> type[nn.Module] | None:
    """The class for ``architecture``; ``ValueError`` naming the supported ones when it is unknown."""
    if architecture not in _MODELS:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        )
    if not import_module:
        return None
    module_name, class_name = _MODELS[architecture]
    module = importlib.import_module(f"pagedllm.models.{module_name}")
    return getattr(module, class_name)
