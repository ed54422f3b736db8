"""``LoRARequest``: which adapter a request runs with (vLLM's names and positional order)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, eq=False)
class LoRARequest:
    """A PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) and its ids.

    ``lora_int_id`` (>= 1) is the id the engine keys slots, caches and prefix-cache hashes by; ``lora_name``
    is what users (and the server's ``model`` field) call it. As in vLLM, two requests are equal when their
    names are.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise ValueError(f"lora_int_id must be an int, got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty path string, got {self.lora_path!r}")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)
