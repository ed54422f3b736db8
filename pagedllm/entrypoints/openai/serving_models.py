"""The names a request's ``model`` field may take: the served base names and the loaded LoRA adapters.

``--lora-modules name=path`` loads adapters at start-up; with ``--allow-runtime-lora-updating`` (or env
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``) ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` change
the set while the server runs. Adapters load in the engine core (``AsyncLLM.add_lora``), so a bad one is refused
before its name is usable; each gets a fresh ``lora_int_id`` (ids key the prefix cache, so a name loaded again
never meets KV computed with the old weights). Unloading forgets the name; requests already running with it
finish with it.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from typing import Any

from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request
from pagedllm.entrypoints.openai.protocol import ModelCard, ModelList
from pagedllm.entrypoints.openai.serve_cli import parse_lora_modules  # noqa: F401 (its home is the CLI)
from pagedllm.lora.request import LoRARequest

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating_from_env() -> bool:
    return os.environ.get(RUNTIME_LORA_ENV, "").strip().lower() in ("1", "true", "yes")


def model_not_found(model: str, served: list[str]) -> OpenAIError:
    return OpenAIError(
        f"The model `{model}` does not exist; this server serves {', '.join(served)}.",
        status_code=404,
        param="model",
        code="model_not_found",
    )


class OpenAIServingModels:
    """Base model names and LoRA adapters by name; shared by every handler of one server."""

    def __init__(self, engine: Any, served_model_names: list[str]) -> None:
        self.engine = engine
        self.base_model_names = list(served_model_names)
        self.lora_requests: dict[str, LoRARequest] = {}  # name -> request, in load order
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()  # loads and unloads one at a time (names are checked across an await)

    @property
    def model_name(self) -> str:
        return self.base_model_names[0]

    def all_names(self) -> list[str]:
        return self.base_model_names + list(self.lora_requests)

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter ``model`` names (None: a base name, or no name); 404 for any other name."""
        if model is None or model in self.base_model_names:
            return None
        lora = self.lora_requests.get(model)
        if lora is None:
            raise model_not_found(model, self.all_names())
        return lora

    def model_list(self, root: str, max_model_len: int) -> ModelList:
        cards = [ModelCard(id=name, root=root, max_model_len=max_model_len) for name in self.base_model_names]
        cards += [
            ModelCard(
                id=lora.lora_name, root=lora.lora_path, parent=self.model_name, max_model_len=max_model_len
            )
            for lora in self.lora_requests.values()
        ]
        return ModelList(data=cards)

    async def load_lora_adapter(self, lora_name: Any, lora_path: Any) -> LoRARequest:
        """Load an adapter under a new name: 400 naming ``lora_name`` / ``lora_path`` when it cannot be."""
        if not isinstance(lora_name, str) or not lora_name:
            raise bad_request("lora_name must be a non-empty string", "lora_name")
        if not isinstance(lora_path, str) or not lora_path:
            raise bad_request("lora_path must be a non-empty string", "lora_path")
        async with self._lock:
            if lora_name in self.base_model_names or lora_name in self.lora_requests:
                raise bad_request(f"The model `{lora_name}` has already been loaded.", "lora_name")
            lora = LoRARequest(lora_name, next(self._ids), lora_path)
            try:
                await self.engine.add_lora(lora)
            except ValueError as e:
                message = str(e).removeprefix("lora_request: ")
                raise bad_request(f"lora_path: {message}", "lora_path") from None
            self.lora_requests[lora_name] = lora
            return lora

    async def unload_lora_adapter(self, lora_name: Any) -> None:
        """Forget an adapter's name (404 when unknown); requests running with it finish with it."""
        if not isinstance(lora_name, str) or not lora_name:
            raise bad_request("lora_name must be a non-empty string", "lora_name")
        async with self._lock:
            lora = self.lora_requests.pop(lora_name, None)
            if lora is None:
                raise OpenAIError(
                    f"The lora adapter `{lora_name}` cannot be found.",
                    status_code=404,
                    param="lora_name",
                    code="model_not_found",
                )
            await self.engine.remove_lora(lora.lora_int_id)
