"""Scoring endpoints: /score (and /v1/score) for text pairs, /rerank (and /v1/rerank, /v2/rerank) for a query
against documents (Jina's and Cohere's shape: ``top_n``, ``return_documents``, results by relevance).

A cross-encoder (a classifier with one label) reads each pair as one input (the tokenizer's pair encoding) and
scores it with the sigmoid of its logit; an embedding model embeds both texts and scores their cosine.
"""

from __future__ import annotations

from typing import Any

import torch
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedllm.entrypoints.openai.errors import bad_request
from pagedllm.entrypoints.openai.protocol_pooling import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from pagedllm.entrypoints.openai.serving_embedding import OpenAIServingPooling
from pagedllm.entrypoints.openai.serving_engine import new_request_id
from pagedllm.pooling.score import score_pairs


class OpenAIServingScore(OpenAIServingPooling):
    async def _score(
        self,
        raw_request: Request,
        req: Any,
        pairs: list[tuple[str, str]],
        request_id: str,
        endpoint: str,
        param: str,
    ) -> tuple[list[float], int] | None:
        """Each pair's score and the prompt tokens used; None when the client went away. ``param``: the field a
        bad input (too long, say) is blamed on."""
        pooler = self.check_pooling(req.model, endpoint)
        if pooler.is_classifier:
            if pooler.num_labels != 1:
                raise bad_request(
                    f"{endpoint} needs a cross-encoder with one label; this classifier has {pooler.num_labels} "
                    "labels: use /classify",
                    "model",
                )
            params = self.params(req, "score")
            outs = await self.run_batch(
                raw_request, [a for a, _ in pairs], params, request_id, [b for _, b in pairs], param=param
            )
            if outs is None:
                return None
            return [float(o.outputs.data[0]) for o in outs], self.usage(outs).prompt_tokens
        params = self.params(req, "embed")
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))  # each distinct text embedded once
        outs = await self.run_batch(raw_request, texts, params, request_id, param=param)
        if outs is None:
            return None
        by_text = {t: o.outputs.data for t, o in zip(texts, outs)}
        scores = [
            torch.nn.functional.cosine_similarity(by_text[a], by_text[b], dim=0).item() for a, b in pairs
        ]
        return scores, self.usage(outs).prompt_tokens

    async def create_score(self, req: ScoreRequest, raw_request: Request) -> Response:
        for name in ("text_1", "text_2"):
            value = getattr(req, name)
            if value is None:
                raise bad_request(f"{name} is required", name)
        try:
            pairs = score_pairs(req.text_1, req.text_2, ("text_1", "text_2"))
        except ValueError as e:
            raise bad_request(str(e), str(e).split(" ", 1)[0]) from None
        request_id = new_request_id("score")
        result = await self._score(raw_request, req, pairs, request_id, "/score", "text_2")
        if result is None:
            return Response(status_code=499)
        scores, num_tokens = result
        data = [ScoreData(index=i, score=s) for i, s in enumerate(scores)]
        resp = ScoreResponse(
            id=request_id,
            model=self.response_model_name(req.model),
            data=data,
            usage={"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        )
        return JSONResponse(resp.model_dump())

    async def create_rerank(self, req: RerankRequest, raw_request: Request) -> Response:
        if not isinstance(req.query, str) or not req.query:
            raise bad_request("query must be a non-empty string", "query")
        docs = req.documents
        if not isinstance(docs, list) or not docs:
            raise bad_request("documents must be a non-empty list of strings", "documents")
        if not all(isinstance(d, str) and d for d in docs):
            raise bad_request("documents must be a list of non-empty strings", "documents")
        if req.top_n is not None and req.top_n < 0:
            raise bad_request(f"top_n must be >= 0, got {req.top_n}", "top_n")
        request_id = new_request_id("rerank")
        pairs = [(req.query, d) for d in docs]
        result = await self._score(raw_request, req, pairs, request_id, "/rerank", "documents")
        if result is None:
            return Response(status_code=499)
        scores, num_tokens = result
        order = sorted(range(len(docs)), key=lambda i: scores[i], reverse=True)
        if req.top_n:
            order = order[: req.top_n]
        results = [
            RerankResult(
                index=i,
                document=RerankDocument(text=docs[i]) if req.return_documents else None,
                relevance_score=scores[i],
            )
            for i in order
        ]
        resp = RerankResponse(
            id=request_id,
            model=self.response_model_name(req.model),
            usage=RerankUsage(total_tokens=num_tokens),
            results=results,
        )
        return JSONResponse(resp.model_dump(exclude_none=True))
