"""The actors of examples/rlhf_ray.py: the trainer and the engine workers (AsyncLLM).

Ray's workers import this module by name: a driver run as `python examples/rlhf_ray.py` has
examples/ on their path (Ray adds the script's directory); another driver (a test) passes it
in the runtime_env's PYTHONPATH.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from typing import Any

import ray
import torch

from tokentape import AsyncLLM, LoRARequest, RequestOutputKind, SamplingParams
from tokentape.engine.async_llm import frontend_tokenizer

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 5, 8,"]
# Rollout lengths, per prompt: rollouts differ in length, and each is still being generated
# when the pause comes (TOKENS_BEFORE_UPDATE tokens in). The engine core runs on while the
# actor's event loop waits for the CPU, so the pause comes some steps late: 9-17 tokens in
# with two busy loops beside, 36-44 in the first iteration with a busy loop at nice 0 (Ray's
# actors run at nice 15). Twice CI saw every rollout of an engine, 512 tokens, end before its
# pause: once when AsyncLLM's reader did not yield to the streams between batches of steps,
# once when the core ran in a session (a scheduler autogroup) of its own, out of reach of the
# actor's nice. The longest rollout sets the time an iteration takes.
ROLLOUT_TOKENS = (64, 128, 256, 512)
TOKENS_BEFORE_UPDATE = 8  # what the trainer learns from: each rollout's first tokens
LEARNING_RATE = 0.05
LORA_RANK = 8  # the LoRA rollout step's adapter: rank 8 on every layer's q_proj and v_proj
LORA_ROLLOUT_TOKENS = 24
WAIT_S = 300.0  # the longest a rollout may take to reach TOKENS_BEFORE_UPDATE tokens

RequestSpec = tuple[str, list[int], dict[str, Any]]  # request id, prompt token ids, params


def request_specs(engine: int, iteration: int, scale: int = 1) -> list[RequestSpec]:
    """An engine's rollout requests for an iteration: seeded sampling and greedy mixed (a
    seeded draw is keyed by (seed, position), so a fresh engine continuing from the same
    prefix draws the same tokens). `scale`: rollouts that many times longer."""
    encode = frontend_tokenizer("tiny").encode
    specs = []
    for j, text in enumerate(PROMPTS):
        kw: dict[str, Any] = {"max_tokens": ROLLOUT_TOKENS[j] * scale, "ignore_eos": True}
        kw.update(
            {"temperature": 1.0, "top_p": 0.95, "seed": 1000 * iteration + 100 * engine + j}
            if j % 2 == 0
            else {"temperature": 0.0}
        )
        specs.append((f"it{iteration}-r{j}", encode(f"{text} ({engine}.{iteration})"), kw))
    return specs


def sampling_params(kw: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**kw)


def lora_request_specs(engine: int, iteration: int) -> list[RequestSpec]:
    """An engine's requests of the LoRA rollout step: the iteration's prompts, shorter."""
    return [
        (f"it{iteration}-lora{j}", prompt, {**kw, "max_tokens": LORA_ROLLOUT_TOKENS})
        for j, (_, prompt, kw) in enumerate(request_specs(engine, iteration))
    ]


def lora_request(iteration: int, path: str) -> LoRARequest:
    """The adapter of an iteration's LoRA rollout step (a new id each iteration)."""
    return LoRARequest(f"policy-it{iteration}", iteration + 1, path)


@ray.remote(num_cpus=0)  # a few milliseconds of arithmetic per step; a real trainer asks for GPUs
class Trainer:
    """Holds the policy (the built-in tiny model, weights drawn from seed 0 as the engines')
    and makes a deterministic update from the rollouts: a stand-in for an optimizer step."""

    def __init__(self) -> None:
        from tokentape.engine.model.loader import builtin_model

        self.model = builtin_model("tiny", seed=0)[1]

    def train_step(self, iteration: int, rollouts: list[dict[str, list[int]]]) -> str:
        """Every weight moves along a seeded Gaussian direction, scaled by the mean reward of
        the rollouts (the share of distinct tokens: a rollout that repeats itself scores low).
        Returns the new weights' content hash (what an engine records on WeightsUpdated)."""
        from tokentape.engine.model.loader import weights_hash

        tokens = [t for r in rollouts for _, t in sorted(r.items())]
        reward = sum(len(set(t)) / max(len(t), 1) for t in tokens) / max(len(tokens), 1)
        generator = torch.Generator().manual_seed(1 + iteration)
        with torch.no_grad():
            for _, p in sorted(self.model.named_parameters()):
                p.add_(torch.randn(p.shape, generator=generator), alpha=LEARNING_RATE * reward)
        return weights_hash(self.model)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def save_lora_adapter(self, iteration: int, folder: str) -> str:
        """The iteration's LoRA adapter as a PEFT folder (a stand-in for LoRA training: A
        and B drawn from the iteration's seed), where every engine can read it."""
        from tokentape.lora.peft_adapter import save_peft_adapter

        generator = torch.Generator().manual_seed(100 + iteration)
        weights = {}
        for name, module in sorted(self.model.named_modules()):
            if name.endswith(("self_attn.q_proj", "self_attn.v_proj")):
                n_out, n_in = module.weight.shape
                a = torch.randn(LORA_RANK, n_in, generator=generator) / n_in**0.5
                b = torch.randn(n_out, LORA_RANK, generator=generator) * 0.05
                weights[name] = (a, b)
        path = os.path.join(folder, f"lora-it{iteration}")
        save_peft_adapter(path, weights, lora_alpha=2 * LORA_RANK)
        return path

    # -- torch.distributed: the trainer is rank 0 and broadcasts every tensor --------------------

    def group_address(self) -> str:
        with socket.socket() as s:  # a free port on this node for the group's rendezvous
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def join_group(self, address: str, rank: int, world_size: int) -> None:
        torch.distributed.init_process_group(
            "gloo", init_method=address, rank=rank, world_size=world_size
        )

    def weight_meta(self) -> list[tuple[str, list[int], str]]:
        return [
            (k, list(v.shape), str(v.dtype).removeprefix("torch."))
            for k, v in self.model.state_dict().items()
        ]

    def broadcast(self) -> None:
        for t in self.model.state_dict().values():
            torch.distributed.broadcast(t.detach().contiguous(), src=0)


@ray.remote(num_cpus=1)
class EngineWorker:
    """One inference engine: AsyncLLM (its engine core in a child process, which writes the
    tape) driven from this actor's event loop, with a consumer task per request."""

    def __init__(self, index: int, tape: str | None, engine_args: dict[str, Any]) -> None:
        self.index = index
        self.llm = AsyncLLM("tiny", tape=tape, **engine_args)
        self.tokens: dict[str, list[int]] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.pausing: asyncio.Task[tuple[dict[str, list[int]], dict[str, int]]] | None = None
        self.progress = asyncio.Event()  # set at every delivery to a rollout

    async def start(self, specs: list[RequestSpec], pause_after: int | None = None) -> None:
        """Start the rollouts; with `pause_after` k, pause as soon as each has its first k
        tokens (`paused()` says when). The watch starts here, with the rollouts: a second
        actor call to start it would arrive some steps late on a busy machine."""
        for req_id, prompt, kw in specs:
            params = SamplingParams(**kw, output_kind=RequestOutputKind.DELTA)
            self.tokens[req_id] = []
            self.tasks[req_id] = asyncio.create_task(self._stream(req_id, prompt, params))
        self.pausing = (
            asyncio.create_task(self._pause_after_tokens(pause_after))
            if pause_after is not None
            else None
        )

    async def _stream(self, req_id: str, prompt: list[int], params: SamplingParams) -> None:
        try:
            async for out in self.llm.generate(prompt, params, req_id):
                self.tokens[req_id] += out.outputs[0].token_ids
                self.progress.set()
        finally:
            self.progress.set()

    async def wait_tokens(self, k: int = TOKENS_BEFORE_UPDATE) -> dict[str, list[int]]:
        """Each running rollout's first k tokens, once it has them (they keep generating)."""

        async def ready() -> None:  # checked at every delivery, not on a timer
            while any(len(self.tokens[r]) < k and not t.done() for r, t in self.tasks.items()):
                self.progress.clear()
                await self.progress.wait()

        await asyncio.wait_for(ready(), WAIT_S)
        for task in self.tasks.values():
            if task.done() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return {r: t[:k] for r, t in self.tokens.items()}

    async def _pause_after_tokens(self, k: int) -> tuple[dict[str, list[int]], dict[str, int]]:
        first = await self.wait_tokens(k)
        return first, await self.pause()

    async def paused(self) -> tuple[dict[str, list[int]], dict[str, int]]:
        """Once the pause that `start(..., pause_after=k)` asked for took effect: each
        rollout's first k tokens and the tokens each had at the pause."""
        if self.pausing is None:
            raise RuntimeError("paused(): start() was not given pause_after")
        return await self.pausing

    async def pause(self) -> dict[str, int]:
        """pause(keep, clear_cache=True); the tokens each request had when it took effect."""
        await self.llm.pause_generation(mode="keep", clear_cache=True)
        for _ in range(20):  # the drained tokens are with the streams: let them take them
            await asyncio.sleep(0)
        return {r: len(t) for r, t in self.tokens.items()}

    async def update_weights(self, weights: dict[str, torch.Tensor]) -> str:
        return await self.llm.update_weights(weights)

    async def join_group(self, address: str, rank: int, world_size: int) -> None:
        torch.distributed.init_process_group(
            "gloo", init_method=address, rank=rank, world_size=world_size
        )

    async def receive_weights(self, meta: list[tuple[str, list[int], str]]) -> str:
        """The trainer's broadcast, tensor by tensor in its order, then update_weights."""
        weights = {}
        for name, shape, dtype in meta:
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            torch.distributed.broadcast(t, src=0)
            weights[name] = t
        return await self.llm.update_weights(weights)

    async def collective_rpc(self, method: str, args: list[Any]) -> Any:
        """The worker extension's `method` in the engine core's worker; its one result."""
        return (await self.llm.collective_rpc(method, args=tuple(args)))[0]

    async def lora_rollouts(
        self, specs: list[RequestSpec], lora_path: str, iteration: int
    ) -> dict[str, list[int]]:
        """The LoRA rollout step: every request with the iteration's adapter; their tokens."""
        lora = lora_request(iteration, lora_path)

        async def rollout(req_id: str, prompt: list[int], kw: dict[str, Any]) -> list[int]:
            async for out in self.llm.generate(
                prompt, SamplingParams(**kw), req_id, lora_request=lora
            ):
                last = out
            return list(last.outputs[0].token_ids)

        tokens = await asyncio.gather(*(rollout(*spec) for spec in specs))
        return {spec[0]: t for spec, t in zip(specs, tokens)}

    async def resume(self) -> None:
        await self.llm.resume_generation()

    async def finish(self) -> dict[str, list[int]]:
        """Wait for every rollout to end; their tokens (then forgotten here)."""
        await asyncio.gather(*self.tasks.values())
        tokens, self.tokens, self.tasks = self.tokens, {}, {}
        return tokens

    async def shutdown(self) -> None:
        self.llm.shutdown()  # closes the tape (in the engine core)

    async def crash(self) -> None:
        """Die as the OOM killer would kill the actor: SIGKILL, nothing cleaned up."""
        os.kill(os.getpid(), signal.SIGKILL)
