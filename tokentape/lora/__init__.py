"""LoRA adapters per request, as vLLM serves them: `LoRARequest` (request.py), PEFT adapter
folders read and checked against the model (peft_adapter.py), the adapters' weights on the
model's linear layers and their per-row product (layers.py), and the runner's table of
loaded adapters (model_manager.py)."""

from tokentape.lora.request import LoRARequest

__all__ = ["LoRARequest"]
