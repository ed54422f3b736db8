"""Front-end preprocessing: images -> the model's pixel tensors (its HF image processor), placeholder expansion,
content hashes. Runs where prompts are tokenized (``InputProcessor``), never in the engine core.

A prompt marks each image with the model's image token (``<image>`` for LLaVA), once per image, in order. Each mark
is expanded to the number of embeddings the vision encoder makes for that image. A token-id prompt whose marks are
already expanded (as HF's processor returns them) is taken as it is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from pagedllm.multimodal.inputs import MultiModalFeature


def _sub(config: Any, name: str) -> Any:
    """A nested config as an object with attributes (a ``PlainHFConfig`` keeps nested configs as dicts)."""
    value = getattr(config, name)
    if isinstance(value, dict):
        from pagedllm.config import PlainHFConfig

        return PlainHFConfig(value)
    return value


def image_token_id_of(config: Any) -> int:
    token_id = getattr(config, "image_token_id", None)
    if token_id is None:
        token_id = getattr(config, "image_token_index", None)
    if token_id is None:
        raise ValueError("the model config has no image_token_id / image_token_index")
    return int(token_id)


def llava_num_image_tokens(config: Any) -> int:
    """Embeddings LLaVA-1.5 makes per image: one per patch of the CLIP tower's square input, plus the CLS
    position unless ``vision_feature_select_strategy`` is "default" (which drops it)."""
    vision = _sub(config, "vision_config")
    num = (int(vision.image_size) // int(vision.patch_size)) ** 2 + 1
    return num - 1 if getattr(config, "vision_feature_select_strategy", "default") == "default" else num


# architecture -> embeddings per image (a function of the full HF config)
_NUM_IMAGE_TOKENS = {"LlavaForConditionalGeneration": llava_num_image_tokens}


def is_multimodal_architecture(architecture: str) -> bool:
    return architecture in _NUM_IMAGE_TOKENS


def max_tokens_per_image(config: Any) -> int:
    """The most placeholder tokens (encoder embeddings) one image takes: sizes the encoder cache."""
    return _NUM_IMAGE_TOKENS[config.architectures[0]](config)


class MultiModalProcessor:
    """Images -> ``MultiModalFeature``s and the prompt with expanded placeholders, for one model."""

    def __init__(self, model_path: str, hf_config: Any, trust_remote_code: bool = False) -> None:
        self.architecture = hf_config.architectures[0]
        self.image_token_id = image_token_id_of(hf_config)
        self.num_image_tokens = _NUM_IMAGE_TOKENS[self.architecture](hf_config)
        vision = _sub(hf_config, "vision_config")
        self.image_size = int(vision.image_size)
        self._model_path = model_path
        self._trust_remote_code = trust_remote_code
        self._image_processor: Any = None

    @property
    def image_processor(self) -> Any:
        """The checkpoint's HF image processor (``AutoImageProcessor``; its PIL backend without torchvision)."""
        if self._image_processor is None:
            from transformers import AutoImageProcessor

            self._image_processor = AutoImageProcessor.from_pretrained(
                self._model_path, trust_remote_code=self._trust_remote_code
            )
        return self._image_processor

    def preprocess(self, images: Sequence[Any], field: str) -> np.ndarray:
        """``[num_images, 3, H, W]`` float32 pixel values."""
        try:
            out = self.image_processor(images=list(images), return_tensors="np")
        except Exception as e:  # noqa: BLE001 - a processor failure is the input's fault here
            raise ValueError(f"{field}: the image processor failed: {e}") from e
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        if pixels.ndim != 4 or pixels.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(
                f"{field}: the image processor returned pixel values of shape {tuple(pixels.shape)}; the vision "
                f"tower takes {self.image_size}x{self.image_size}"
            )
        return pixels

    def process(
        self, prompt_token_ids: list[int], images: Sequence[Any], field: str = "multi_modal_data.image"
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """Expand each image's placeholder in ``prompt_token_ids``; ``ValueError`` naming ``field`` when the prompt's
        placeholders do not match the images."""
        n = self.num_image_tokens
        # Each placeholder: (start, 1) to expand, or (start, n) already expanded. A run of k * n marks is k expanded
        # images; any other run is that many single marks (adjacent images without text between them).
        marks: list[tuple[int, int]] = []
        for start, length in _runs(prompt_token_ids, self.image_token_id):
            step = n if n > 1 and length % n == 0 else 1
            marks.extend((start + j, step) for j in range(0, length, step))
        if len(marks) != len(images):
            raise ValueError(
                f"{field}: the prompt has {len(marks)} image placeholder(s) but {len(images)} image(s) were given; "
                "put the model's image token (e.g. <image>) in the prompt once per image"
            )
        pixels = self.preprocess(images, field) if images else None
        ids: list[int] = []
        features: list[MultiModalFeature] = []
        prev = 0
        for i, (start, length) in enumerate(marks):
            ids.extend(prompt_token_ids[prev:start])
            pv = pixels[i]
            features.append(
                MultiModalFeature(
                    modality="image",
                    mm_hash=_hash_pixels(self.architecture, pv),
                    offset=len(ids),
                    length=n,
                    data={"pixel_values": pv},
                )
            )
            ids.extend([self.image_token_id] * n)
            prev = start + length
        ids.extend(prompt_token_ids[prev:])
        return ids, features


def _runs(token_ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each run of ``token_id``."""
    runs: list[tuple[int, int]] = []
    start = -1
    for i, t in enumerate(token_ids):
        if t == token_id:
            if start < 0:
                start = i
        elif start >= 0:
            runs.append((start, i - start))
            start = -1
    if start >= 0:
        runs.append((start, len(token_ids) - start))
    return runs


def _hash_pixels(architecture: str, pixel_values: np.ndarray) -> str:
    """128-bit content hash of the preprocessed image (what the encoder sees): keys the encoder cache and the
    prefix-cache blocks over the image's placeholders."""
    h = hashlib.blake2b(digest_size=16)
    h.update(architecture.encode())
    h.update(repr((pixel_values.dtype.str, pixel_values.shape)).encode())
    h.update(np.ascontiguousarray(pixel_values).tobytes())
    return h.hexdigest()
