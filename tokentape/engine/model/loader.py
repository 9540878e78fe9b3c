"""Weights: the built-in models' seeded init, Hugging Face checkpoint folders (safetensors),
validated weight updates and the content hash that identifies a set of weights."""

from __future__ import annotations

import glob
import hashlib
import os
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from tokentape.engine.model.decoder import CausalLM
from tokentape.engine.model.hf_config import config_from_hf, read_json_object
from tokentape.engine.model.model_config import (
    BUILTIN_CONFIGS,
    CheckpointError,
    ModelConfig,
)
from tokentape.engine.model.weight_checks import checked_update, first_non_finite, non_finite_values
from tokentape.engine.model_registry import unknown_model
from tokentape.engine.tokenizer import (
    ByteTokenizer,
    Tokenizer,
    byte_tokenizer_json,
    checkpoint_tokenizer,
)

WeightsSource = Mapping[str, torch.Tensor] | str | os.PathLike[str]

# Buffers older checkpoints carry that this model computes itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


def expected_shapes(model: CausalLM) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def init_weights(model: CausalLM, seed: int) -> None:
    """Deterministic weights: normal(0, 0.02) for matrices and embeddings, ones for norms,
    zeros for biases, drawn on the CPU in float32 in parameter order from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                value = torch.ones(p.shape)
            elif name.endswith(".bias"):
                value = torch.zeros(p.shape)
            else:
                value = torch.empty(p.shape).normal_(0.0, 0.02, generator=gen)
            p.copy_(value)


def builtin_model(name: str, seed: int = 0) -> tuple[ModelConfig, CausalLM]:
    """A built-in config ('tiny', 'qwen3-0.6b'), weights drawn from `seed`, CPU, float32."""
    config = BUILTIN_CONFIGS[name]
    model = CausalLM(config)
    init_weights(model, seed)
    return config, model


def check_model_folder(name: str) -> None:
    """Refuse a model name that is neither built in nor an existing folder, saying which: a
    path that does not exist, a file, or an unknown name."""
    if name in BUILTIN_CONFIGS or os.path.isdir(name):
        return
    if os.path.lexists(name):
        raise CheckpointError(
            f"{name}: not a folder (a checkpoint is a folder holding config.json and *.safetensors)"
        )
    if os.sep in name or "/" in name or name.startswith((".", "~")):
        raise CheckpointError(
            f"{name}: no such folder (tokentape loads local checkpoint "
            "folders; it downloads nothing)"
        )
    raise unknown_model(name)


def check_checkpoint_files(name: str) -> None:
    """What `name` needs to load, checked without reading any weights (so, in milliseconds,
    before a command touches its outputs): a built-in name, or a folder whose config.json
    parses and whose weight files are all there."""
    check_model_folder(name)
    if name not in BUILTIN_CONFIGS:
        config_from_hf(name)
        weight_files(name)


def weight_files(path: str | os.PathLike[str]) -> list[str]:
    """The folder's *.safetensors files; every shard its index names must be there."""
    files = sorted(glob.glob(os.path.join(glob.escape(os.fspath(path)), "*.safetensors")))
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.lexists(index):
        weight_map = read_json_object(index, "").get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: has no weight_map object")
        for shard in sorted(set(map(str, weight_map.values()))):
            if os.path.join(path, shard) not in files:
                raise CheckpointError(f"{os.path.join(path, shard)}: missing (named by {index})")
    if not files:
        pattern = os.path.join(path, "*.safetensors")
        if glob.glob(os.path.join(glob.escape(os.fspath(path)), "*.bin")):
            raise CheckpointError(
                f"{pattern}: missing; the folder holds PyTorch .bin weights, "
                "and tokentape reads safetensors only"
            )
        raise CheckpointError(f"{pattern}: missing (no weight files in the checkpoint folder)")
    return files


def read_checkpoint(
    path: str | os.PathLike[str],
) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, str]]:
    """config.json and every tensor of the folder's *.safetensors, with the file of each."""
    config = config_from_hf(path)
    return (config, *read_weight_files(path))


def read_weight_files(
    path: str | os.PathLike[str],
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of the folder's *.safetensors, with the file of each."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for file in weight_files(path):
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    tensors[name] = f.get_tensor(name)
                    origin[name] = file
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 (safetensors has its own error types)
            raise CheckpointError(f"{file}: cannot read the safetensors file ({exc})") from None
    return tensors, origin


def load_checkpoint(path: str | os.PathLike[str]) -> tuple[ModelConfig, CausalLM]:
    """Build the model of a Hugging Face checkpoint folder (Llama, Qwen2, Qwen3) on the CPU.
    Names, shapes, dtypes and values (no NaN or infinity) are checked before it is built."""
    config, tensors, origin = read_checkpoint(path)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # the same tensor as the embeddings
    where = os.path.join(path, "*.safetensors")
    _check_layer_count(config, tensors, where)
    with torch.device("meta"):  # the shapes without allocating: config.json may be wrong
        shapes = expected_shapes(CausalLM(config))
    for name in shapes:
        if name not in tensors:
            raise CheckpointError(f"{where}: missing tensor {name!r}")
    for name, t in tensors.items():
        if name not in shapes:
            raise CheckpointError(
                f"{origin[name]}: unexpected tensor {name!r} for a {config.model_type} model"
            )
        if tuple(t.shape) != shapes[name]:
            raise CheckpointError(
                f"{origin[name]}: tensor {name!r} has shape {tuple(t.shape)}, "
                f"config.json implies {shapes[name]}"
            )
        if not t.is_floating_point():  # as update_weights refuses it: a cast would hide the error
            raise CheckpointError(
                f"{origin[name]}: tensor {name!r} is {t.dtype}, not floating point"
            )
    bad = first_non_finite(tensors)
    if bad is not None:
        raise CheckpointError(f"{origin[bad]}: tensor {bad!r} {non_finite_values(tensors[bad])}")
    model = CausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(tensors[name].to(torch.float32))
    return config, model


def _check_layer_count(
    config: ModelConfig, tensors: Mapping[str, torch.Tensor], where: str
) -> None:
    """Layers config.json names that the weights lack, found from the names alone (building
    even an empty model of, say, a billion layers would take minutes)."""
    layers = {int(m.group(1)) for m in map(_LAYER_NAME.match, tensors) if m}
    if layers and config.num_hidden_layers > max(layers) + 1:
        raise CheckpointError(
            f"{where}: missing tensor 'model.layers.{max(layers) + 1}.*' (config.json says "
            f"num_hidden_layers = {config.num_hidden_layers}; the weights hold {len(layers)})"
        )


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """The folder's tokenizer.json through `tokenizers`; without one, a tokenizer that refuses
    text (tokenizer.checkpoint_tokenizer)."""
    return checkpoint_tokenizer(path)


def prepare_update(model: CausalLM, weights: WeightsSource) -> dict[str, torch.Tensor]:
    """Validate a weight update against the model without touching it: names known, shapes
    equal, floating point, no NaN or infinity once cast; returns the tensors cast to the
    model's dtype and device."""
    if isinstance(weights, (str, os.PathLike)):
        _, tensors, origin = read_checkpoint(weights)
    elif isinstance(weights, Mapping):
        tensors = {k: v for k, v in weights.items() if not k.endswith(_IGNORED_SUFFIXES)}
        origin = {}
    else:
        raise TypeError(
            "update_weights takes a state_dict or a checkpoint folder, "
            f"got {type(weights).__name__}"
        )
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return checked_update(dict(model.named_parameters()), tensors, origin)


def tensor_sha256(name: str, t: torch.Tensor) -> str:
    """sha256 over one tensor's name, dtype, shape and bytes (a chunk's record on the tape)."""
    h = hashlib.sha256()
    _hash_tensor(h, name, t)
    return "sha256:" + h.hexdigest()


def chunk_record(
    tensors: Mapping[str, torch.Tensor],
) -> tuple[list[str], list[list[int]], list[str]]:
    """A checked chunk as the tape records it: names, shapes and SHA-256s, in name order.
    The tensors are hashed side by side, one a CPU (hashlib lets go of the GIL while it
    hashes), the largest first so that the last to finish is a small one."""
    names = sorted(tensors)
    largest = sorted(names, key=lambda n: tensors[n].numel() * tensors[n].element_size())[::-1]
    hashes = dict(zip(largest, hash_pool().map(_sha256_of(tensors), largest)))
    return names, [list(tensors[n].shape) for n in names], [hashes[n] for n in names]


def _sha256_of(tensors: Mapping[str, torch.Tensor]) -> Callable[[str], str]:
    return lambda name: tensor_sha256(name, tensors[name])


_pool: tuple[int, ThreadPoolExecutor] | None = None  # (the process that made it, the pool)
_pool_lock = threading.Lock()


def hash_pool() -> ThreadPoolExecutor:
    """The process's threads for hashing tensors, one a CPU it may run on (made on first use,
    and again in a process forked after: a fork has none of its parent's threads)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            affinity = getattr(os, "sched_getaffinity", None)
            cpus = len(affinity(0)) if affinity is not None else os.cpu_count() or 1
            _pool = (os.getpid(), ThreadPoolExecutor(cpus, thread_name_prefix="tokentape-sha256"))
        return _pool[1]


def weights_hash(model: CausalLM) -> str:
    """sha256 over every parameter's name, dtype, shape and bytes, in name order."""
    params = dict(model.named_parameters())
    return WeightsHashStream(params).hexdigest(params)


def _hash_tensor(h: Any, name: str, t: torch.Tensor) -> None:
    t = t.detach().contiguous().cpu()
    h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
    h.update(t.view(torch.uint8).reshape(-1).numpy() if t.numel() else b"")


class WeightsHashStream:
    """weights_hash of weights that come in pieces, in any order (a transfer's chunks): one
    SHA-256 over the names in order, taken on as far as the tensors come (`take`), so that
    little is left to hash once the last arrives (`hexdigest`). A name sent again takes the
    hash back to before it (`forget`)."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = sorted(names)
        self._position = {name: i for i, name in enumerate(self.names)}
        self._hashed = [hashlib.sha256()]  # the hash of names[:i], for each i hashed so far

    def take(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Hash on through the names `tensors` holds, up to the first one it lacks."""
        h = self._hashed[-1].copy()
        for name in self.names[len(self._hashed) - 1 :]:
            t = tensors.get(name)
            if t is None:
                return
            _hash_tensor(h, name, t)
            self._hashed.append(h.copy())

    def forget(self, names: Iterable[str]) -> None:
        """These names' tensors change: the hash goes back to before the first of them."""
        first = min((self._position[n] for n in names if n in self._position), default=None)
        if first is not None:
            del self._hashed[first + 1 :]

    def hexdigest(self, tensors: Mapping[str, torch.Tensor]) -> str:
        """The hash, the names not taken yet hashed from `tensors` (every name is there)."""
        self.take(tensors)
        if len(self._hashed) <= len(self.names):
            raise KeyError(f"weights hash: no tensor {self.names[len(self._hashed) - 1]!r}")
        return "sha256:" + self._hashed[-1].hexdigest()


def save_checkpoint(
    model: CausalLM, path: str | os.PathLike[str], byte_tokenizer: bool = True
) -> str:
    """Write `model` as a Hugging Face checkpoint folder (config.json, model.safetensors) that
    this loader, transformers and vLLM all read; returns the folder's path. Tied embeddings
    are written once, as Hugging Face does. `byte_tokenizer`: the built-in models' tokenizer
    goes with them as tokenizer.json (when the vocabulary holds its ids), so the folder
    encodes text as the built-in model does; pass False for a model with a tokenizer of its
    own, and copy that."""
    import json

    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    config = model.config
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config.to_hf_dict(), f, indent=2)
    if byte_tokenizer and config.vocab_size >= ByteTokenizer.vocab_size:
        with open(os.path.join(path, "tokenizer.json"), "w") as f:
            f.write(byte_tokenizer_json())
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return os.fspath(path)
