"""The runner's table of loaded LoRA adapters (vLLM's LoRAModelManager): each adapter takes a
slot, and its weights go into that slot of every linear layer it changes (layers.LoRASlots),
prepared once (A and B transposed, B times the scaling, in the model's dtype and device), so
a forward pass only looks up each row's slot. They are a few MB: a sleep leaves them where
they are."""

from __future__ import annotations

from torch import nn

from tokentape.errors import LoRAError
from tokentape.lora.layers import LoRASlots
from tokentape.lora.peft_adapter import TARGET_MODULES, PeftAdapter


class LoRAModelManager:
    """Up to `capacity` adapters on `model`'s target layers (its nn.Linear modules named
    TARGET_MODULES), by vLLM's lora_int_id."""

    def __init__(self, model: nn.Module, capacity: int) -> None:
        self.capacity = capacity
        self.layers: dict[str, nn.Linear] = {
            name: m
            for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in TARGET_MODULES
        }
        for m in self.layers.values():
            m.lora = LoRASlots(capacity, m.in_features, m.out_features)  # type: ignore[assignment]
        self._slots: dict[int, int] = {}  # lora_int_id -> slot
        self._free = list(range(capacity - 1, -1, -1))  # popped from the end: slot 0 first

    @property
    def shapes(self) -> dict[str, tuple[int, int]]:
        """Every target layer's (in_features, out_features), by module name."""
        return {name: (m.in_features, m.out_features) for name, m in self.layers.items()}

    def check(self, adapter: PeftAdapter) -> None:
        """Refuse an adapter of another base model, or one there is no slot for."""
        adapter.check_against(self.shapes)
        if not self._free:
            raise LoRAError(
                f"LoRA adapter {adapter.path}: {self.capacity} adapters are loaded already "
                "(max_cpu_loras); remove one first"
            )

    def add(self, lora_int_id: int, adapter: PeftAdapter) -> None:
        self.check(adapter)
        if lora_int_id in self._slots:
            raise LoRAError(f"LoRA adapter {lora_int_id} is loaded already")
        slot = self._free.pop()
        self._slots[lora_int_id] = slot
        for name, (a, b) in adapter.weights.items():
            layer = self.layers[name]
            dtype, device = layer.weight.dtype, layer.weight.device
            a_t = a.t().to(dtype=dtype, device=device)
            b_t = (b * adapter.scaling).t().to(dtype=dtype, device=device)
            slots = layer.lora
            assert isinstance(slots, LoRASlots)
            slots.set(slot, a_t, b_t)

    def remove(self, lora_int_id: int) -> None:
        slot = self._slots.pop(lora_int_id, None)
        if slot is None:
            raise LoRAError(f"LoRA adapter {lora_int_id} is not loaded")
        for layer in self.layers.values():
            assert isinstance(layer.lora, LoRASlots)
            layer.lora.clear(slot)
        self._free.append(slot)

    def slot(self, lora_int_id: int) -> int:
        """The slot of a loaded adapter; -1 for 0 (the base model)."""
        if not lora_int_id:
            return -1
        return self._slots[lora_int_id]
