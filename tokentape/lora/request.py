"""vLLM's LoRARequest (`vllm.lora.request`): which adapter a request runs with."""

from __future__ import annotations

import msgspec

from tokentape.events.validation import check_int, check_str


class LoRARequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """A PEFT adapter by vLLM's name, integer id (>= 1, unique per adapter) and folder.
    Two requests with the same lora_int_id run with the same adapter: the first loads it
    (add_lora) unless it is loaded already. `base_model_name` is vLLM's field, kept for its
    callers; whether an adapter fits the model is checked by its shapes."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        check_str("lora_name", self.lora_name)
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
        check_int("lora_int_id", self.lora_int_id, 1)
        check_str("lora_path", self.lora_path)
        if self.base_model_name is not None:
            check_str("base_model_name", self.base_model_name)

    # vLLM's aliases.
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
