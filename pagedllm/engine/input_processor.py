"""From what a user sends (text, token ids, chat messages) to validated ``EngineCoreRequest``s.

``InputProcessor.process`` tokenizes, validates against the model (vocabulary, ``max_model_len``), fills the
engine-side fields of ``SamplingParams`` (``max_tokens``, ``_bad_words_token_ids``, extra eos ids) on a copy,
and fans a request with ``n > 1`` out into ``n`` core requests, one per sampled sequence. Errors are
``ValueError``s whose message starts with the offending field's name.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from pagedllm.core.sched_output import EngineCoreRequest
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import AnyTokenizer

# Largest `logprobs` / `prompt_logprobs` accepted unless the model config says otherwise (vLLM's default).
DEFAULT_MAX_LOGPROBS = 20
# Most images per prompt unless limit_mm_per_prompt says otherwise (vLLM's default).
DEFAULT_MM_LIMIT = 999

_CHAT_ROLES = ("system", "user", "assistant", "tool")

PromptType = str | list[int] | Mapping[str, Any]


class _ModelInfo(Protocol):
    """What the processor needs from ``ModelConfig`` (tests may pass any object with these)."""

    max_model_len: int | None

    @property
    def vocab_size(self) -> int: ...


@dataclass
class ProcessedRequest:
    """A validated request: the parent as the user sees it, plus one core request per sampled sequence."""

    request_id: str
    prompt: str | None  # the prompt text, when the user gave text
    prompt_token_ids: list[int]
    params: SamplingParams  # the parent's params: a copy of the user's, with max_tokens filled in
    core_requests: list[EngineCoreRequest]  # children in index order; ids f"{i}_{request_id}" when n > 1
    arrival_time: float  # time.monotonic() clock
    priority: int = 0


def child_request_id(index: int, request_id: str, n: int) -> str:
    """The core request id of sequence ``index`` of a request with ``n`` sequences."""
    return request_id if n == 1 else f"{index}_{request_id}"


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class InputProcessor:
    """Tokenizes and validates requests for one model. Stateless apart from config; safe to share."""

    def __init__(self, model_config: _ModelInfo, tokenizer: AnyTokenizer) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.max_model_len = int(model_config.max_model_len)
        self.vocab_size = int(model_config.vocab_size)
        self.max_logprobs = int(getattr(model_config, "max_logprobs", None) or DEFAULT_MAX_LOGPROBS)
        gen_eos_ids = _generation_config_eos_ids(getattr(model_config, "model_path", None))
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None and gen_eos_ids:
            eos = gen_eos_ids[0]
        self.eos_token_id: int | None = eos
        # Other ids the model ends turns with (e.g. Llama 3's <|eot_id|>): they become stop token ids.
        self.extra_eos_token_ids: list[int] = [t for t in gen_eos_ids if t != eos]
        # Multimodal models: the image preprocessing (its HF image processor loads on the first image).
        self.mm_processor: Any = None
        mm_config = getattr(model_config, "mm_hf_config", None)
        if mm_config is not None:
            from pagedllm.multimodal.processing import MultiModalProcessor

            self.mm_processor = MultiModalProcessor(
                model_config.model_path, mm_config, getattr(model_config, "trust_remote_code", False)
            )
        limit = getattr(model_config, "limit_mm_per_prompt", None) or {}
        self.max_images_per_prompt = int(limit.get("image", DEFAULT_MM_LIMIT))
        from pagedllm.multimodal.media import MediaConnector

        self.media = MediaConnector(getattr(model_config, "allowed_local_media_path", None))
        self.processor_cache = None  # preprocessed chat images by content (data URLs), when the model takes images
        gb = getattr(model_config, "mm_processor_cache_gb", 0)
        if self.mm_processor is not None and gb > 0:
            from pagedllm.multimodal.processing import ProcessorCache

            self.processor_cache = ProcessorCache(int(gb * 2**30))

    # ------------------------------------------------------------------ text

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds BOS for llama-like tokenizers."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render chat messages to prompt text with the tokenizer's template (or ``chat_template``: a Jinja
        string or a path to a file holding one). Extra keyword arguments reach the template (``tools``...).

        Tokenize the result with ``tokenize(text, add_special_tokens=False)``: templates put BOS in themselves.
        """
        messages = validate_chat_messages(conversation)
        template = _load_chat_template(chat_template)
        if template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(
                "chat_template: the tokenizer has no chat template; pass one (a Jinja string or a file path)"
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **kwargs,
            )
        except ValueError as e:
            raise ValueError(f"messages: the chat template rejected the conversation: {e}") from e
        except Exception as e:  # jinja2 TemplateError and friends: raise_exception() in templates
            raise ValueError(f"messages: the chat template failed on the conversation: {e}") from e
        if not isinstance(text, str):  # some tokenizers return a list for a batch of one
            text = text[0]
        return text

    # ------------------------------------------------------------------ requests

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: Any = None,
    ) -> ProcessedRequest:
        """Validate and tokenize one request; ``prompt`` is text, token ids, ``{"prompt": text}`` or
        ``{"prompt_token_ids": ids}`` (both keys: the ids are used, the text is reported back).
        ``lora_request`` (a ``LoRARequest`` or None) goes to every child; the engine core loads it.

        ``arrival_time`` must come from ``time.monotonic()`` (the default); metrics subtract it from later times.
        ``params`` is not modified. Raises ``ValueError`` naming the field.
        """
        if lora_request is not None:
            from pagedllm.lora.request import LoRARequest

            if not isinstance(lora_request, LoRARequest):
                raise ValueError(
                    f"lora_request must be a LoRARequest or None, got {type(lora_request).__name__}"
                )
        multimodal = isinstance(prompt, Mapping) and prompt.get("multi_modal_data") is not None
        given = prompt
        if multimodal and self.mm_processor is not None and "prompt_token_ids" not in prompt:
            text = prompt.get("prompt")
            if isinstance(text, str):  # laid out as the checkpoint's processor lays it out (Gemma 3's blank lines)
                prompt = {**prompt, "prompt": self.mm_processor.prompt_text_with_images(text, self.tokenizer)}
        prompt_text, prompt_token_ids = self._prompt_to_ids(prompt)
        if prompt is not given:
            prompt_text = given["prompt"]  # reported back as the user wrote it
        mm_features = None
        if multimodal:
            prompt_token_ids, mm_features = self.process_multi_modal_data(
                prompt_token_ids, prompt["multi_modal_data"]
            )
        self._validate_prompt(prompt_token_ids)
        params = self._prepare_params(params, len(prompt_token_ids))
        if arrival_time is None:
            arrival_time = time.monotonic()
        core_requests = [
            EngineCoreRequest(
                request_id=child_request_id(i, request_id, params.n),
                prompt_token_ids=prompt_token_ids,
                sampling_params=self._child_params(params, i),
                eos_token_id=self.eos_token_id,
                arrival_time=arrival_time,
                priority=priority,
                lora_request=lora_request,
                mm_features=mm_features,
            )
            for i in range(params.n)
        ]
        return ProcessedRequest(
            request_id=request_id,
            prompt=prompt_text,
            prompt_token_ids=prompt_token_ids,
            params=params,
            core_requests=core_requests,
            arrival_time=arrival_time,
            priority=priority,
        )

    def _prompt_to_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, Mapping):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
            if unknown:
                raise ValueError(
                    f"prompt: unknown keys {sorted(unknown)}; use 'prompt' or 'prompt_token_ids' (and "
                    "'multi_modal_data')"
                )
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise ValueError(f"prompt must be a string, got {type(text).__name__}")
            if "prompt_token_ids" in prompt:
                return text, self._check_token_ids(prompt["prompt_token_ids"])
            if text is None:
                raise ValueError("prompt: a prompt dict needs 'prompt' or 'prompt_token_ids'")
            prompt = text
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenize(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, self._check_token_ids(prompt)
        raise ValueError(
            f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}"
        )

    def process_multi_modal_data(
        self, prompt_token_ids: list[int], mm_data: Any, field: str = "multi_modal_data"
    ) -> tuple[list[int], list[Any]]:
        """``{"image": image | [images]}`` (PIL images, or URL strings the media connector loads) -> the prompt
        with each image placeholder expanded, and one ``MultiModalFeature`` per image. ``ValueError`` naming
        ``field``: a text-only model, an unknown modality, more images than ``limit_mm_per_prompt``, an image that
        does not decode, placeholders that do not match the images."""
        if not isinstance(mm_data, Mapping):
            raise ValueError(f'{field} must be a dict like {{"image": image_or_list}}, got {type(mm_data).__name__}')
        unknown = set(mm_data) - {"image"}
        if unknown:
            raise ValueError(f"{field}: unsupported modalities {sorted(unknown)}; only 'image' is supported")
        images = mm_data.get("image")
        if images is None:
            return prompt_token_ids, []
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        if self.mm_processor is None:
            raise ValueError(
                f"{field}: {getattr(self.model_config, 'model', 'this model')} is a text-only model; it takes no "
                "images"
            )
        if len(images) > self.max_images_per_prompt:
            raise ValueError(
                f"{field}.image: {len(images)} images given, more than limit_mm_per_prompt allows "
                f"({self.max_images_per_prompt})"
            )
        from pagedllm.multimodal.processing import PreprocessedImage

        images = [
            img if isinstance(img, PreprocessedImage) else self.media.load_image(img, f"{field}.image[{i}]")
            for i, img in enumerate(images)
        ]
        return self.mm_processor.process(prompt_token_ids, images, f"{field}.image")

    @property
    def image_placeholder(self) -> str | None:
        """The text that marks an image in a prompt (``<image>`` for LLaVA); None for a text-only model."""
        if self.mm_processor is None:
            return None
        return self.mm_processor.placeholder_text(self.tokenizer)

    def expanded_prompt_len(self, prompt_token_ids: list[int], num_images: int) -> int:
        """The prompt's length once each of its ``num_images`` one-token image placeholders is expanded."""
        if not num_images or self.mm_processor is None or not self.mm_processor.num_image_tokens:
            return len(prompt_token_ids)  # (Qwen2-VL: known once each image is preprocessed)
        return len(prompt_token_ids) + num_images * self.mm_processor.tokens_added_per_image

    def load_chat_images(self, images: list[ChatImage], preprocess: bool = False) -> list[Any]:
        """PIL images of ``extract_chat_images``' parts (URLs fetched, data URLs decoded); the image limit is
        checked before anything is fetched. With ``preprocess``, each image also goes through the image
        processor: ``PreprocessedImage``s, a data URL seen before (``processor_cache``) as it was made then. May block on
        the network and takes the processor's time: servers call it off the event loop."""
        if len(images) > self.max_images_per_prompt:
            raise ValueError(
                f"{images[self.max_images_per_prompt].field}: {len(images)} images in the conversation, more "
                f"than limit_mm_per_prompt allows ({self.max_images_per_prompt})"
            )
        if not (preprocess and self.mm_processor is not None):
            return [self.media.load_image(img.source, img.field) for img in images]
        out = []
        cache = self.processor_cache
        for img in images:
            key = None
            if cache is not None and isinstance(img.source, str) and img.source.startswith("data:"):
                key = cache.key(img.source)  # a data URL is its content; a fetched URL's content may change
                hit = cache.get(key)
                if hit is not None:
                    out.append(hit)
                    continue
            item = self.mm_processor.preprocess_images([self.media.load_image(img.source, img.field)], img.field)[0]
            if key is not None:
                cache.put(key, item)
            out.append(item)
        return out

    def _check_token_ids(self, token_ids: Any) -> list[int]:
        if not isinstance(token_ids, (list, tuple)):
            raise ValueError(f"prompt_token_ids must be a list of ints, got {type(token_ids).__name__}")
        # C-speed checks first (a 1,000-prompt benchmark hands over a million ids); the error paths name the ids.
        if not set(map(type, token_ids)) <= {int}:  # bool is not int here, as in _is_int
            bad = [t for t in token_ids if not _is_int(t)]
            raise ValueError(f"prompt_token_ids must be ints, got {bad[:5]}")
        if token_ids and (min(token_ids) < 0 or max(token_ids) >= self.vocab_size):
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            raise ValueError(
                f"prompt_token_ids contains ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}"
            )
        return list(token_ids)

    def _validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty (it has no tokens)")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt (length {len(prompt_token_ids)}) is longer than the maximum model length of "
                f"{self.max_model_len}; at least one position must be left to generate into"
            )

    def _prepare_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        params.verify_vocab(self.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ValueError(f"{name} must be at most {self.max_logprobs}, got {value}")
        if params.stop and not params.detokenize:
            raise ValueError("stop strings need detokenize=True")
        if params.structured_outputs is not None:
            from pagedllm.structured_output.grammar import validate_structured_outputs

            validate_structured_outputs(params.structured_outputs)
        params = params.clone()
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - prompt_len
            params.min_tokens = min(params.min_tokens, params.max_tokens)
        if self.extra_eos_token_ids and not params.ignore_eos:
            params.stop_token_ids = params.stop_token_ids + [
                t for t in self.extra_eos_token_ids if t not in params.stop_token_ids
            ]
        params._bad_words_token_ids = self._bad_words_token_ids(params.bad_words or [])
        return params

    def _bad_words_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """Each bad word as token ids, both at the start of a text and after a space (as a new word): the
        two tokenize differently for BPE vocabularies whose words carry their leading space."""
        result: list[list[int]] = []
        for word in bad_words:
            word = word.lstrip()
            if not word:
                continue
            plain = self.tokenize(word, add_special_tokens=False)
            spaced = self.tokenize(" " + word, add_special_tokens=False)
            for ids in (plain, spaced):
                if ids and ids not in result:
                    bad = [t for t in ids if not 0 <= t < self.vocab_size]
                    if bad:
                        raise ValueError(
                            f"bad_words: {word!r} tokenizes to ids outside the vocabulary: {bad}"
                        )
                    result.append(ids)
        return result

    def _child_params(self, params: SamplingParams, index: int) -> SamplingParams:
        if params.n == 1:
            return params
        child = params.clone()
        child.n = 1
        child.best_of = 1
        if child.seed is not None:
            child.seed = params.seed + index
        return child


def validate_chat_messages(conversation: Any) -> list[dict[str, Any]]:
    """Check chat messages and return copies with list-of-parts content flattened to one string.

    Each message is a dict with ``role`` in system/user/assistant/tool and ``content`` a string or a list of
    ``{"type": "text", "text": ...}`` parts (joined with newlines). An assistant message may have
    ``content: None`` when it carries ``tool_calls``. Other keys pass through. Raises ``ValueError`` naming
    ``messages``.
    """
    if not isinstance(conversation, list) or not conversation:
        raise ValueError("messages must be a non-empty list of message dicts")
    out = []
    for i, message in enumerate(conversation):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if role not in _CHAT_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(_CHAT_ROLES)}, got {role!r}")
        content = message.get("content")
        if isinstance(content, list):
            content = "\n".join(_text_part(part, i, j) for j, part in enumerate(content))
        elif content is None and role == "assistant" and message.get("tool_calls"):
            pass
        elif not isinstance(content, str):
            raise ValueError(
                f"messages[{i}].content must be a string or a list of text parts, got {type(content).__name__}"
            )
        out.append({**message, "content": content})
    return out


@dataclass
class ChatImage:
    """An image part of a chat message: where it came from (the request field, for errors) and its source (a URL
    string or a PIL image)."""

    field: str
    source: Any


def extract_chat_images(
    conversation: Any, image_placeholder: str | None
) -> tuple[list[dict[str, Any]], list[ChatImage]]:
    """Take the image parts out of chat messages: ``{"type": "image_url", "image_url": {"url": ...}}`` (or the
    URL as a plain string) and ``{"type": "image_pil", "image_pil": PIL.Image}``, as vLLM accepts them. A message
    with images gets content ``"\n".join(placeholders + [its text])``, one ``image_placeholder`` per image (vLLM's
    layout for LLaVA-style models); other messages are returned as they are. ``image_placeholder`` None (a
    text-only model): any image part is a ``ValueError`` naming it."""
    if not isinstance(conversation, list):
        return conversation, []
    images: list[ChatImage] = []
    out = []
    for i, message in enumerate(conversation):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(
            isinstance(p, dict) and p.get("type") in ("image_url", "image_pil") for p in content
        ):
            out.append(message)
            continue
        texts, num_images = [], 0
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("image_url", "image_pil"):
                texts.append(_text_part(part, i, j))
                continue
            field = f"messages[{i}].content[{j}].{kind}"
            if image_placeholder is None:
                raise ValueError(f"{field}: this model is text-only; it takes no images")
            source = part.get(kind)
            if kind == "image_url":
                source = source.get("url") if isinstance(source, dict) else source
                if not isinstance(source, str) or not source:
                    raise ValueError(f"{field}.url must be a non-empty string")
                field += ".url"
            elif source is None:
                raise ValueError(f"{field} must be a PIL image")
            images.append(ChatImage(field, source))
            num_images += 1
        out.append({**message, "content": "\n".join([image_placeholder] * num_images + ["\n".join(texts)])})
    return out, images


def _text_part(part: Any, i: int, j: int) -> str:
    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
        raise ValueError(
            f'messages[{i}].content[{j}] must be {{"type": "text", "text": str}} (or an image_url / image_pil part), '
            f"got {part!r:.80}"
        )
    return part["text"]


def _load_chat_template(chat_template: str | None) -> str | None:
    if chat_template is None:
        return None
    if not isinstance(chat_template, str) or not chat_template:
        raise ValueError("chat_template must be a non-empty string")
    if "{" not in chat_template and os.path.isfile(chat_template):
        with open(chat_template, encoding="utf-8") as f:
            return f.read()
    return chat_template


def _generation_config_eos_ids(model_path: str | None) -> list[int]:
    """``eos_token_id`` from ``generation_config.json`` next to the model, as a list (empty if absent)."""
    if not model_path:
        return []
    path = os.path.join(model_path, "generation_config.json")
    if not os.path.isfile(path):
        return []
    try:
        with open(path, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, ValueError):
        return []
    if _is_int(eos):
        return [eos]
    if isinstance(eos, list):
        return [t for t in eos if _is_int(t)]
    return []
