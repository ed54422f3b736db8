"""The runner's side of images: the encoder outputs it holds (keyed by content hash) and the step's input
embeddings with image rows written over the placeholder tokens.

Each step, before the forward: drop the entries the scheduler freed (``SchedulerOutput.free_encoder_mm_hashes``),
run the vision encoder once over the images it scheduled (``scheduled_encoder_inputs``; images of one size go
through in one batch), then, for each request whose chunk [computed, computed + scheduled) overlaps an image's
placeholder span, copy the overlapping slice of that image's embeddings into the step's rows::

    chunk:      positions 8..15 of a request (step rows r..r+7)
    image:      placeholders at 10..25 -> embedding rows 0..15
    overlap:    positions 10..15 -> step rows r+2..r+7 take embedding rows 0..5

Steps without such rows pass ``input_ids`` as usual (so decode steps keep their CUDA graphs); steps with them run
eagerly with ``inputs_embeds``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.multimodal.processing import mrope_positions


class EncoderRunner:
    def __init__(self, model: Any, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.cache: dict[str, torch.Tensor] = {}  # mm_hash -> [num_image_tokens, hidden_size] on the device
        self.req_features: dict[str, list[MultiModalFeature]] = {}  # running requests that have images
        self.num_encoded = 0  # images run through the encoder (tests read it)
        # M-RoPE models (Qwen2-VL): each running request with images -> ([3, num_prompt_tokens] positions, delta)
        self.uses_mrope = bool(getattr(model, "uses_mrope", False))
        self.merge_size = int(getattr(model, "spatial_merge_size", 1))
        self.mrope: dict[str, tuple[np.ndarray, int]] = {}
        # Gemma 3: one image's tokens attend to each other both ways (AttentionMetadata.bidirectional_spans)
        self.bidirectional = bool(getattr(model, "bidirectional_image_attention", False))

    def update(self, sched: SchedulerOutput) -> None:
        """Track the step's requests, free what the scheduler freed, encode what it scheduled."""
        for req_id in sched.finished_req_ids:
            self.req_features.pop(req_id, None)
            self.mrope.pop(req_id, None)
        for data in sched.scheduled_new_reqs:
            if data.mm_features:
                self.req_features[data.req_id] = data.mm_features
                if self.uses_mrope:
                    self.mrope[data.req_id] = mrope_positions(
                        data.num_prompt_tokens, data.mm_features, self.merge_size
                    )
        for mm_hash in sched.free_encoder_mm_hashes:
            self.cache.pop(mm_hash, None)
        if sched.scheduled_encoder_inputs:
            self.encode(
                [
                    self.req_features[req_id][i]
                    for req_id, indices in sched.scheduled_encoder_inputs.items()
                    for i in indices
                ]
            )

    @torch.inference_mode()
    def encode(self, features: list[MultiModalFeature]) -> None:
        """Run the vision encoder over ``features`` not yet held (one call; the model batches them)."""
        todo: dict[str, MultiModalFeature] = {}
        for f in features:
            if f.mm_hash not in self.cache:
                todo.setdefault(f.mm_hash, f)
        if not todo:
            return
        group = list(todo.values())
        embeds = self.model.embed_images([f.data for f in group])  # each [num_tokens, hidden_size]
        for f, e in zip(group, embeds):
            if e.shape[0] != f.length:
                raise RuntimeError(f"the encoder made {e.shape[0]} embeddings for an image of {f.length} placeholders")
            self.cache[f.mm_hash] = e
        self.num_encoded += len(group)

    def rope_positions(
        self, req_ids: list[str], cu: np.ndarray, positions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """M-RoPE: the step's positions for the model. A request with images reads its prompt positions from its
        3-D table and later ones as p + delta (all three streams equal). Returns ``(positions [T], positions_3d
        [3, T] or None)``: the 3-D array when some token is a prompt token of such a request (that step runs
        eagerly), else the plain positions shifted (decode steps keep their CUDA graphs)."""
        if not self.mrope:
            return positions, None
        index = {req_id: i for i, req_id in enumerate(req_ids)}
        spans = []  # (first row, end row, table, delta) of the step's requests with images
        for req_id, (table, delta) in self.mrope.items():
            i = index.get(req_id)
            if i is not None:
                spans.append((int(cu[i]), int(cu[i + 1]), table, delta))
        if not spans:
            return positions, None
        out = positions.copy()
        in_prompt_any = False
        for a, b, table, delta in spans:
            out[a:b] += delta
            in_prompt_any = in_prompt_any or positions[a] < table.shape[1]  # rows of a request only grow
        if not in_prompt_any:
            return out, None
        out3 = np.broadcast_to(out, (3, len(out))).copy()  # [3, T] text: three equal streams
        for a, b, table, _ in spans:
            p = positions[a:b]
            in_prompt = p < table.shape[1]
            out3[:, a:b][:, in_prompt] = table[:, p[in_prompt]]
        return out, out3

    def step_spans(
        self, req_ids: list[str], num_computed: np.ndarray, num_sched: np.ndarray, cu: np.ndarray
    ) -> list[tuple[int, MultiModalFeature, int, int]]:
        """``(first step row, feature, first embedding row, rows)`` for every overlap of a scheduled chunk with an
        image's placeholders (empty: a text-only step). A loop over the step's requests that have images only."""
        if not self.req_features:
            return []
        spans = []
        index = {req_id: i for i, req_id in enumerate(req_ids)}
        for req_id, features in self.req_features.items():
            i = index.get(req_id)
            if i is None:
                continue
            start = int(num_computed[i])
            end = start + int(num_sched[i])
            if start >= features[-1].end:
                continue  # past its last image: decoding
            for f in features:
                a, b = max(start, f.offset), min(end, f.end)
                if a < b:
                    spans.append((int(cu[i]) + a - start, f, a - f.offset, b - a))
        return spans

    def bidirectional_spans(
        self, spans: list[tuple[int, MultiModalFeature, int, int]], cu: np.ndarray
    ) -> tuple[tuple[int, int, int], ...]:
        """``(request index, first position, end position)`` of each image the step's ``spans`` (``step_spans``)
        touch, for a model whose image tokens attend both ways (``()`` for others)."""
        if not self.bidirectional:
            return ()
        return tuple(
            (int(np.searchsorted(cu, row, side="right")) - 1, f.offset, f.end) for row, f, _, _ in spans
        )

    def inputs_embeds(
        self, input_ids: torch.Tensor, spans: list[tuple[int, MultiModalFeature, int, int]]
    ) -> torch.Tensor:
        """[num_tokens, hidden_size]: the token embeddings of ``input_ids`` ([num_tokens]) with each span's image
        rows written in. An image missing from the cache is encoded here (the scheduler's plan normally did)."""
        missing = [f for _, f, _, _ in spans if f.mm_hash not in self.cache]
        if missing:
            self.encode(missing)
        embeds = self.model.embed_input_ids(input_ids)  # [num_tokens, hidden_size]
        for row, f, first, n in spans:
            embeds[row : row + n] = self.cache[f.mm_hash][first : first + n]
        return embeds
