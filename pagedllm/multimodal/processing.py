"""Front-end preprocessing: images -> the model's pixel tensors (its HF image processor), placeholder expansion,
content hashes. Runs where prompts are tokenized (``InputProcessor``), never in the engine core.

A prompt marks each image with the model's image token (``<image>`` for LLaVA), once per image, in order. Each mark
is expanded to the number of embeddings the vision encoder makes for that image. A token-id prompt whose marks are
already expanded (as HF's processor returns them) is taken as it is.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedllm.multimodal.inputs import MultiModalFeature


def sub_config(config: Any, name: str) -> Any:
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
    vision = sub_config(config, "vision_config")
    num = (int(vision.image_size) // int(vision.patch_size)) ** 2 + 1
    return num - 1 if getattr(config, "vision_feature_select_strategy", "default") == "default" else num


def _preprocessor_config(model_path: str | None) -> dict[str, Any]:
    import json
    import os

    path = os.path.join(model_path or "", "preprocessor_config.json")
    if not model_path or not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def qwen2_vl_max_image_tokens(config: Any, model_path: str | None) -> int:
    """Embeddings of the largest image Qwen2-VL's processor makes: ``max_pixels`` (``size.longest_edge``) over the
    area one embedding covers (a ``merge x merge`` block of ``patch x patch`` patches)."""
    vision = sub_config(config, "vision_config")
    pre = _preprocessor_config(model_path)
    max_pixels = pre.get("max_pixels") or (pre.get("size") or {}).get("longest_edge") or 12845056
    side = int(vision.patch_size) * int(vision.spatial_merge_size)
    return max(1, int(max_pixels) // (side * side))


def select_best_resolution(size: tuple[int, int], pinpoints: Sequence[Sequence[int]]) -> tuple[int, int]:
    """LLaVA-NeXT's tiling: of the ``(height, width)`` resolutions in ``pinpoints``, the one that keeps most of an
    image of ``size`` (height, width) once scaled to fit, then wastes least (transformers'
    ``select_best_resolution``, the same arithmetic)."""
    height, width = size
    best = None
    best_effective, best_wasted = 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (int(h), int(w)), effective, wasted
    if best is None:
        raise ValueError("image_grid_pinpoints is empty")
    return best


def llava_next_num_tiles(config: Any, height: int, width: int) -> int:
    """Crops the LLaVA-NeXT image processor makes of an image ``height x width``: the whole image resized, then the
    tiles of the best pinpoint resolution (each the vision tower's input size)."""
    tile = int(sub_config(config, "vision_config").image_size)
    best_h, best_w = select_best_resolution((height, width), config.image_grid_pinpoints)
    return -(-best_h // tile) * -(-best_w // tile) + 1


def llava_next_num_image_tokens(config: Any, height: int, width: int) -> int:
    """Embeddings LLaVA-NeXT makes for an image ``height x width`` (before preprocessing), as transformers'
    ``LlavaNextProcessor`` counts them: the base image's patches, then the tiles' patch grid with the rows or
    columns of the letterbox padding cut off ("unpadding"), plus one ``image_newline`` per remaining row."""
    vision = sub_config(config, "vision_config")
    tile = int(vision.image_size)
    side = tile // int(vision.patch_size)  # patches a tile side
    best_h, best_w = select_best_resolution((height, width), config.image_grid_pinpoints)
    cur_h, cur_w = side * (best_h // tile), side * (best_w // tile)
    if width / height > cur_w / cur_h:
        new_h = int(round(height * (cur_w / width), 7))
        cur_h -= (cur_h - new_h) // 2 * 2
    else:
        new_w = int(round(width * (cur_h / height), 7))
        cur_w -= (cur_w - new_w) // 2 * 2
    base = side * side + (0 if getattr(config, "vision_feature_select_strategy", "default") == "default" else 1)
    return base + cur_h * cur_w + cur_h


def llava_next_max_image_tokens(config: Any, model_path: str | None = None) -> int:
    """An upper bound of ``llava_next_num_image_tokens`` over image sizes: per pinpoint, the base image and the whole
    tile grid with a newline per row (unpadding only removes)."""
    vision = sub_config(config, "vision_config")
    tile = int(vision.image_size)
    side = tile // int(vision.patch_size)
    most = 0
    for h, w in config.image_grid_pinpoints:
        rows, cols = side * (int(h) // tile), side * (int(w) // tile)
        most = max(most, rows * (cols + 1))
    return side * side + 1 + most


QWEN2_VL_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
GEMMA3_ARCHITECTURE = "Gemma3ForConditionalGeneration"


def gemma3_num_image_tokens(config: Any, model_path: str | None = None) -> int:
    """Embeddings Gemma 3 makes per image: ``mm_tokens_per_image`` (its pooled patch grid)."""
    return int(getattr(config, "mm_tokens_per_image", None) or 256)


def keeps_image_spans_whole(architecture: str) -> bool:
    """Whether the model's attention within an image's tokens is bidirectional (Gemma 3), so that the scheduler must
    compute all of an image's placeholder tokens in one step (core/scheduler.py, ``_plan_encoder``)."""
    return architecture == GEMMA3_ARCHITECTURE

# architecture -> the most embeddings one image takes (sizes the encoder cache)
_MAX_IMAGE_TOKENS = {
    "LlavaForConditionalGeneration": lambda config, model_path: llava_num_image_tokens(config),
    "LlavaNextForConditionalGeneration": llava_next_max_image_tokens,
    **{arch: qwen2_vl_max_image_tokens for arch in QWEN2_VL_ARCHITECTURES},
    GEMMA3_ARCHITECTURE: gemma3_num_image_tokens,
}


def is_multimodal_architecture(architecture: str) -> bool:
    return architecture in _MAX_IMAGE_TOKENS


def max_tokens_per_image(config: Any, model_path: str | None = None) -> int:
    """The most placeholder tokens (encoder embeddings) one image takes: sizes the encoder cache."""
    return _MAX_IMAGE_TOKENS[config.architectures[0]](config, model_path)


@dataclass(frozen=True)
class PreprocessedImage:
    """An image already through the checkpoint's image processor: its encoder inputs (``preprocess``' dict) and
    their content hash. A server makes these off its event loop (the processor takes tens of milliseconds an
    image); ``MultiModalProcessor.process`` takes them as they are."""

    data: dict[str, np.ndarray]
    mm_hash: str


class ProcessorCache:
    """Preprocessed images by the content they came from (a data URL's text: its bytes, base64), least recently used
    dropped once they hold more than ``max_bytes`` of arrays (vLLM's ``mm_processor_cache_gb``). A repeated image
    then skips decoding, the image processor and hashing. Shared by a server's worker threads (locked); an entry's
    arrays are never written (the models stack or concatenate them into new tensors)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.queries = 0
        self.hits = 0
        self._items: OrderedDict[str, PreprocessedImage] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @staticmethod
    def key(content: str) -> str:
        return hashlib.blake2b(content.encode(), digest_size=16).hexdigest()

    def get(self, key: str) -> PreprocessedImage | None:
        with self._lock:
            self.queries += 1
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
                self.hits += 1
            return item

    def put(self, key: str, item: PreprocessedImage) -> None:
        size = sum(v.nbytes for v in item.data.values())
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._items:
                return
            self._items[key] = item
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self._bytes -= sum(v.nbytes for v in old.data.values())

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)


class MultiModalProcessor:
    """Images -> ``MultiModalFeature``s and the prompt with expanded placeholders, for one model."""

    def __init__(self, model_path: str, hf_config: Any, trust_remote_code: bool = False) -> None:
        self.architecture = hf_config.architectures[0]
        self.hf_config = hf_config
        self.image_token_id = image_token_id_of(hf_config)
        vision = sub_config(hf_config, "vision_config")
        self.is_qwen2_vl = self.architecture in QWEN2_VL_ARCHITECTURES
        self.is_llava_next = self.architecture == "LlavaNextForConditionalGeneration"
        self.is_gemma3 = self.architecture == GEMMA3_ARCHITECTURE
        self.num_image_tokens = 0  # per image, when every image takes the same number (LLaVA-1.5)
        if self.is_qwen2_vl:  # dynamic resolution: an image's tokens follow its size
            self.merge_size = int(vision.spatial_merge_size)
            self.vision_start_token_id = int(hf_config.vision_start_token_id)
            self.vision_end_token_id = int(hf_config.vision_end_token_id)
        elif self.is_llava_next:  # tiles: an image's tokens follow its size
            self.image_size = int(vision.image_size)
        elif self.is_gemma3:  # <start_of_image> marks an image (expanded with N image tokens, <end_of_image>)
            self.num_image_tokens = gemma3_num_image_tokens(hf_config)
            self.image_size = int(vision.image_size)
            self.boi_token_id = int(hf_config.boi_token_id)
            self.eoi_token_id = int(hf_config.eoi_token_id)
        else:
            self.num_image_tokens = llava_num_image_tokens(hf_config)
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

    def placeholder_text(self, tokenizer: Any) -> str:
        """What marks one image in a chat prompt: the image token, wrapped in Qwen2-VL's vision start / end;
        Gemma 3's ``<start_of_image>`` with the blank lines its processor puts around an image."""
        if self.is_gemma3:
            return self.prompt_text_with_images(tokenizer.convert_ids_to_tokens(self.boi_token_id), tokenizer)
        if self.is_qwen2_vl:
            return "".join(
                tokenizer.convert_ids_to_tokens(
                    [self.vision_start_token_id, self.image_token_id, self.vision_end_token_id]
                )
            )
        return tokenizer.convert_ids_to_tokens(self.image_token_id)

    def prompt_text_with_images(self, text: str, tokenizer: Any) -> str:
        """A text prompt that comes with images, as the checkpoint's processor lays it out before tokenizing:
        Gemma 3's processor puts a blank line before and after each ``<start_of_image>`` (its image tokens and
        ``<end_of_image>`` go in after it, in token space here); other models' text is kept."""
        if not self.is_gemma3:
            return text
        boi = tokenizer.convert_ids_to_tokens(self.boi_token_id)
        return text.replace(boi, f"\n\n{boi}\n\n")

    @property
    def tokens_added_per_image(self) -> int:
        """Tokens one single-token image mark adds once expanded, where every image takes the same number (LLaVA-1.5:
        ``<image>`` -> N image tokens; Gemma 3: ``<start_of_image>`` -> itself, N image tokens, ``<end_of_image>``)."""
        return self.num_image_tokens + 1 if self.is_gemma3 else self.num_image_tokens - 1

    def preprocess(self, images: Sequence[Any], field: str) -> list[dict[str, np.ndarray]]:
        """Each image's encoder inputs: ``{"pixel_values": [3, H, W]}`` (LLaVA), its crops and size
        ``{"pixel_values": [num_crops, 3, H, W], "image_sizes": [2]}`` (LLaVA-NeXT: height, width), or Qwen2-VL's
        flattened patches ``{"pixel_values": [t * h * w, C * T * P * P], "image_grid_thw": [3]}``."""
        try:
            out = self.image_processor(images=list(images), return_tensors="np")
        except Exception as e:  # noqa: BLE001 - a processor failure is the input's fault here
            raise ValueError(f"{field}: the image processor failed: {e}") from e
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        if self.is_gemma3 and np.asarray(out.get("num_crops", 0)).any():
            raise ValueError(f"{field}: Gemma 3's pan-and-scan crops (do_pan_and_scan) are not supported")
        if self.is_qwen2_vl:
            grids = np.asarray(out["image_grid_thw"], dtype=np.int64)  # [num_images, 3]
            sizes = grids.prod(axis=1)
            starts = np.concatenate([[0], np.cumsum(sizes)])
            return [
                {"pixel_values": pixels[starts[i] : starts[i + 1]], "image_grid_thw": grids[i]}
                for i in range(len(grids))
            ]
        expected_ndim = 5 if self.is_llava_next else 4  # LLaVA-NeXT: [num_images, most crops, 3, H, W]
        if pixels.ndim != expected_ndim or pixels.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(
                f"{field}: the image processor returned pixel values of shape {tuple(pixels.shape)}; the vision "
                f"tower takes {self.image_size}x{self.image_size}"
            )
        if self.is_llava_next:  # each image's crops, then zeros up to the most crops any image has
            image_sizes = np.asarray(out["image_sizes"], dtype=np.int64)  # [num_images, 2] height, width
            return [
                {"pixel_values": p[: llava_next_num_tiles(self.hf_config, *map(int, hw))], "image_sizes": hw}
                for p, hw in zip(pixels, image_sizes)
            ]
        return [{"pixel_values": p} for p in pixels]

    def preprocess_images(self, images: Sequence[Any], field: str) -> list[PreprocessedImage]:
        """``preprocess`` and hash each image: what ``process`` needs of it, made ahead (e.g. in a worker
        thread)."""
        return [PreprocessedImage(d, _hash_data(self.architecture, d)) for d in self.preprocess(images, field)]

    def num_tokens(self, data: dict[str, np.ndarray]) -> int:
        """Embeddings the encoder makes for one preprocessed image."""
        if self.is_qwen2_vl:
            return int(np.prod(data["image_grid_thw"])) // (self.merge_size**2)
        if self.is_llava_next:
            return llava_next_num_image_tokens(self.hf_config, *(int(x) for x in data["image_sizes"]))
        return self.num_image_tokens

    def process(
        self, prompt_token_ids: list[int], images: Sequence[Any], field: str = "multi_modal_data.image"
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """Expand each image's placeholder in ``prompt_token_ids``; ``ValueError`` naming ``field`` when the prompt's
        placeholders do not match the images. ``images``: PIL images, or ``PreprocessedImage``s (kept as they
        are)."""
        raw = [img for img in images if not isinstance(img, PreprocessedImage)]
        made = iter(self.preprocess_images(raw, field) if raw else ())
        items = [img if isinstance(img, PreprocessedImage) else next(made) for img in images]
        datas = [item.data for item in items]
        sizes = [self.num_tokens(d) for d in datas]
        if self.is_gemma3:
            prompt_token_ids = self._gemma3_marks(prompt_token_ids)
        # Each placeholder: (start, 1) to expand, or (start, n) already expanded (n: the next image's tokens). Within a
        # run of image tokens, an image takes n when at least n are left (and n > 1), else one (adjacent images
        # without text between them).
        marks: list[tuple[int, int]] = []
        for start, length in _runs(prompt_token_ids, self.image_token_id):
            j = 0
            while j < length:
                n = sizes[len(marks)] if len(marks) < len(sizes) else 1
                step = n if 1 < n <= length - j else 1
                marks.append((start + j, step))
                j += step
        if len(marks) != len(images):
            raise ValueError(
                f"{field}: the prompt has {len(marks)} image placeholder(s) but {len(images)} image(s) were given; "
                "put the model's image token (e.g. <image>) in the prompt once per image"
            )
        ids: list[int] = []
        features: list[MultiModalFeature] = []
        prev = 0
        for i, (start, length) in enumerate(marks):
            ids.extend(prompt_token_ids[prev:start])
            n = sizes[i]
            features.append(
                MultiModalFeature(
                    modality="image",
                    mm_hash=items[i].mm_hash,
                    offset=len(ids),
                    length=n,
                    data=datas[i],
                )
            )
            ids.extend([self.image_token_id] * n)
            prev = start + length
        ids.extend(prompt_token_ids[prev:])
        return ids, features

    def _gemma3_marks(self, token_ids: list[int]) -> list[int]:
        """Gemma 3: each ``<start_of_image>`` not already followed by the image token becomes ``<start_of_image>
        <image> <end_of_image>`` (the single image token is then expanded to ``mm_tokens_per_image``, as
        transformers' ``Gemma3Processor`` lays an image out); an expanded prompt is kept as it is."""
        out: list[int] = []
        for i, t in enumerate(token_ids):
            out.append(t)
            expanded = i + 1 < len(token_ids) and token_ids[i + 1] == self.image_token_id
            if t == self.boi_token_id and not expanded:
                out.extend((self.image_token_id, self.eoi_token_id))
        return out


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


def _hash_data(architecture: str, data: dict[str, np.ndarray]) -> str:
    """128-bit content hash of the preprocessed image (what the encoder sees: pixels, and the grid where there is
    one): keys the encoder cache and the prefix-cache blocks over the image's placeholders."""
    h = hashlib.blake2b(digest_size=16)
    h.update(architecture.encode())
    for key in sorted(data):
        value = np.ascontiguousarray(data[key])
        h.update(repr((key, value.dtype.str, value.shape)).encode())
        h.update(value.tobytes())
    return h.hexdigest()


def mrope_positions(
    num_prompt_tokens: int, features: Sequence[MultiModalFeature], merge_size: int
) -> tuple[np.ndarray, int]:
    """Qwen2-VL's 3-D positions (temporal, height, width) of a prompt, as transformers' ``get_rope_index``: text
    tokens count on from the last position on all three streams; an image's tokens take its grid coordinates
    (t, h / merge, w / merge) offset by the position it starts at, and the text after it starts at that position
    plus ``max(h, w) / merge``. Returns ``([3, num_prompt_tokens] int64, delta)``: a generated token at position
    p (p >= num_prompt_tokens) takes p + delta on all three streams."""
    out = np.empty((3, num_prompt_tokens), dtype=np.int64)
    pos = 0  # next text position
    prev = 0  # prompt index after the last image
    for f in features:
        n_text = f.offset - prev
        out[:, prev : f.offset] = np.arange(pos, pos + n_text)
        pos += n_text
        t, h, w = (int(x) for x in f.data["image_grid_thw"])
        h, w = h // merge_size, w // merge_size
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        out[:, f.offset : f.end] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + pos
        pos += max(h, w)
        prev = f.end
    out[:, prev:] = np.arange(pos, pos + num_prompt_tokens - prev)
    delta = int(out.max()) + 1 - num_prompt_tokens if num_prompt_tokens else 0
    return out, delta
