"""The oracle runner: a fake model whose next token is a pure function of
(prompt tokens, position, request seed).

Any correct schedule, whatever its batching, pipelining, preemptions or resets, must deliver
exactly `OracleRunner.expected_stream(...)` for every request; the tests compare against it.

`model="oracle"` makes each request's stream mostly repeat a short cycle with seeded
deviations, so n-gram drafts are sometimes accepted and sometimes rejected.
`model="oracle-random"` draws every token independently (drafts almost never match).

Its weights (oracle_weights.py) are a small parameter set that weight updates replace and
hash, as a real model's, while its tokens ignore them.

The oracle has no logits, so the sampling options that act on them (the penalties, min_tokens,
bad_words, logit_bias, min_p) and prompt_logprobs cannot be honoured: `check_params` refuses
such a request before anything is recorded. Ignoring them would give a stream no model could
produce, and a what-if replay with the oracle would then report a difference that is not there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokentape.engine.ngram import propose_ngram_drafts
from tokentape.engine.runners.base import LoadedLoRA, ScheduledBatch, WeightChunk, prompt_seed
from tokentape.engine.runners.oracle_weights import OracleWeights
from tokentape.engine.tokenizer import ByteTokenizer
from tokentape.events.schema import NO_DRAFTS, FrameEntry, LoRAAdded, SamplingParams

_MASK = (1 << 64) - 1
# Emit only the byte tokens of printable ASCII (never bos, eos or pad), so decoded text reads.
_FIRST_TOKEN = ByteTokenizer.encode(ByteTokenizer(), " ")[0]
_NUM_TOKENS = 95  # " " through "~"
_POSITION_MIX = 0xD6E8FEB86659FD93  # spreads a position over the key's bits before _mix
_CYCLE_STRIDE = 7919  # a request's cycle steps through the tokens by this prime
BATCHED_FROM = 16  # decodes in a step from which tokens_at draws them in one numpy pass


def _mix(x: Any) -> Any:
    """splitmix64's finaliser: a cheap, well-spread 64-bit hash, of an int or, element-wise,
    of a numpy uint64 array (whose arithmetic wraps where the masks cut an int)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


@dataclass(slots=True)
class _DeviceSeq:
    """The runner's own copy of a sequence, ahead of the scheduler by the steps in flight."""

    key: int
    tokens: list[int] = field(default_factory=list)


class OracleRunner:
    eos_token_id: int | None = None
    extra_eos_token_ids: tuple[int, ...] = ()

    def __init__(
        self,
        cyclic: bool = True,
        seed: int = 0,
        vocab_size: int = ByteTokenizer.vocab_size,
        prompt_lookup_max: int = 3,
        prompt_lookup_min: int = 1,
    ) -> None:
        self.cyclic = cyclic
        self.seed = seed
        self.vocab_size = vocab_size
        self.model_id = "oracle" if cyclic else "oracle-random"
        self.lookup = (prompt_lookup_max, prompt_lookup_min)
        self._seqs: dict[str, _DeviceSeq] = {}
        self._results: dict[int, list[FrameEntry]] = {}
        self.weights = OracleWeights(seed)  # replaced by updates, ignored by the tokens

    # -- LoRA adapters (runners.base.ServesLoRA): read and checked, ignored by the tokens ------

    def add_lora(self, lora_int_id: int, lora_path: str, max_rank: int) -> LoadedLoRA:
        from tokentape.lora.peft_adapter import load_peft_adapter  # torch: only when used

        adapter = load_peft_adapter(lora_path, max_rank)  # no model: no shapes to check
        return LoadedLoRA(
            adapter.adapter_id, adapter.rank, adapter.scaling, list(adapter.target_modules)
        )

    def remove_lora(self, lora_int_id: int) -> None:
        pass

    def restore_lora(self, record: LoRAAdded) -> None:
        pass

    # -- the pure function ---------------------------------------------------------------------

    def request_key(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        return prompt_seed(self.seed if params.seed is None else params.seed, prompt_token_ids)

    def token_at(self, key: int, position: int) -> int:
        span = _NUM_TOKENS
        h = _mix(key ^ (position * _POSITION_MIX & _MASK))
        if self.cyclic and h & 3:  # three times in four, follow the request's cycle
            period = 2 + key % 4
            return _FIRST_TOKEN + ((key >> 8) + (position % period) * _CYCLE_STRIDE) % span
        return _FIRST_TOKEN + (h >> 8) % span

    def tokens_at(self, keys: list[int], positions: list[int]) -> list[int]:
        """token_at for many (key, position) pairs at once: the same arithmetic on numpy
        uint64 arrays, so a step's decodes cost one pass, not a hash each in Python."""
        k = np.array(keys, dtype=np.uint64)
        pos = np.array(positions, dtype=np.uint64)
        h = _mix(k ^ (pos * _POSITION_MIX & _MASK))
        drawn = _FIRST_TOKEN + (h >> 8) % _NUM_TOKENS
        if self.cyclic:
            cycle = _FIRST_TOKEN + ((k >> 8) + (pos % (2 + k % 4)) * _CYCLE_STRIDE) % _NUM_TOKENS
            drawn = np.where(h & 3, cycle, drawn)
        return drawn.tolist()  # type: ignore[no-any-return]

    def expected_stream(
        self, prompt_token_ids: list[int], params: SamplingParams, max_model_len: int = 1 << 62
    ) -> list[int]:
        """The output a correct engine must deliver for this request."""
        key = self.request_key(prompt_token_ids, params)
        out: list[int] = []
        pos = len(prompt_token_ids)
        while True:
            tok = self.token_at(key, pos)
            out.append(tok)
            pos += 1
            if tok in params.stop_token_ids or (tok == self.eos_token_id and not params.ignore_eos):
                return out
            if len(out) >= params.max_tokens or pos >= max_model_len:
                return out

    def check_params(self, params: SamplingParams) -> None:
        """Refuse the options that change a model's logits (see the module's doc)."""
        used = [
            name
            for name, on in (
                ("presence_penalty", params.presence_penalty != 0.0),
                ("frequency_penalty", params.frequency_penalty != 0.0),
                ("repetition_penalty", params.repetition_penalty != 1.0),
                ("min_tokens", params.min_tokens > 0),
                ("bad_words", bool(params.bad_words)),
                ("min_p", params.min_p > 0),
                ("logit_bias", bool(params.logit_bias)),
                ("prompt_logprobs", params.prompt_logprobs is not None),
            )
            if on
        ]
        if used:
            raise ValueError(
                f"the oracle runner ({self.model_id}) has no logits and cannot honour "
                f"{', '.join(used)}; use a model (e.g. model='tiny') for such a request"
            )

    # -- weight updates (runners.base.UpdatesWeights; oracle_weights.py) -----------------------

    def run_worker_call(
        self, call: Callable[[], Any], timeout: float | None
    ) -> tuple[Any, BaseException | None, str | None]:
        """collective_rpc's call, here (the oracle's steps run when they are submitted)."""
        return self.weights.call_and_rehash(call)

    def update_weights(self, weights: object) -> str:
        return self.weights.update_weights(weights)

    def stage_weights(self, weights: object) -> WeightChunk:
        return self.weights.stage_weights(weights)

    def load_staged_weights(self) -> str:
        return self.weights.load_staged_weights()

    # -- the runner protocol -------------------------------------------------------------------

    def submit(self, batch: ScheduledBatch) -> None:
        for req_id in batch.finished_req_ids:
            self._seqs.pop(req_id, None)
        frame: list[FrameEntry | None] = []
        # Decodes without drafts, drawn together after the loop: frame slots, ids, sequences.
        plain_at: list[int] = []
        plain_ids: list[str] = []
        plain_seqs: list[_DeviceSeq] = []
        token_ids, new_requests, partial = (
            batch.token_ids,
            batch.new_requests,
            batch.partial_prefills,
        )
        seqs = self._seqs
        for e in batch.entries:
            req_id = e.req_id
            known = token_ids.get(req_id) if token_ids else None
            new = new_requests.get(req_id) if new_requests else None
            if new is not None:
                seq = seqs[req_id] = _DeviceSeq(self.request_key(new.prompt_token_ids, new.params))
                seq.tokens = list(known or ())
            else:
                seq = seqs[req_id]
                if known:
                    seq.tokens[e.num_computed_before :] = known
            if partial and req_id in partial:
                continue
            if not e.num_spec_tokens:
                plain_at.append(len(frame))
                plain_ids.append(req_id)
                plain_seqs.append(seq)
                frame.append(None)
                continue
            tokens = seq.tokens
            pos = first = len(tokens)
            drafts = propose_ngram_drafts(tokens, e.num_spec_tokens, *self.lookup)
            out = []
            for d in drafts:  # verify the drafts against what the "model" would sample
                if d != self.token_at(seq.key, pos):
                    break
                out.append(d)
                pos += 1
            out.append(self.token_at(seq.key, pos))
            tokens += out
            frame.append(FrameEntry(req_id, out, drafts, position=first))
        if plain_seqs:
            keys = [seq.key for seq in plain_seqs]
            positions = [len(seq.tokens) for seq in plain_seqs]
            sampled = (
                self.tokens_at(keys, positions)
                if len(keys) >= BATCHED_FROM  # numpy's call overhead pays from here
                else list(map(self.token_at, keys, positions))
            )
            for at, req_id, seq, pos, token in zip(
                plain_at, plain_ids, plain_seqs, positions, sampled
            ):
                frame[at] = FrameEntry(req_id, [token], NO_DRAFTS, None, None, None, pos)
                seq.tokens.append(token)
        self._results[batch.step] = frame  # type: ignore[assignment]  # every None filled

    def collect(self, step: int) -> list[FrameEntry]:
        return self._results.pop(step)

    def close(self) -> None:
        self._seqs.clear()
        self._results.clear()
