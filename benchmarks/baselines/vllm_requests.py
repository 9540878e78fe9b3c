"""Side script: vLLM's offline `LLM.generate` on a checkpoint folder, each request with its own
sampling options (greedy limits, penalties, min_tokens, bad words, top-k logprobs), at vLLM's
default settings otherwise; for tests/integrations/test_vllm_tokens.py. `make_llm` builds the
LLM for vllm_generate.py too.

Runs in vLLM's Python (never imports tokentape), through the sideserver protocol. The folder
has no tokenizer (`skip_tokenizer_init`), so prompts are token ids and bad words come as the
token-id sequences tokentape recorded: they go into SamplingParams' `_bad_words_token_ids`,
which is what vLLM's `update_from_tokenizer` fills from strings when it has a tokenizer.

Spec: {"model", "dtype", "seed", "max_model_len", "llm": {more LLM(...) arguments, optional}}.
Command `generate` (args: requests, a list of {"prompt": [int], "params": {SamplingParams
keyword arguments}, "bad_words_ids": [[int]] (optional)}) -> tokens (per request), logprobs
(per request and position: the [token id, logprob] pairs vLLM returned, the sampled token and
the top k; empty without `logprobs`).
"""

from __future__ import annotations

from typing import Any

import sideserver


def make_llm(spec: dict[str, Any]) -> Any:
    """vLLM's LLM on the spec's checkpoint folder (token ids in and out), at its defaults but
    for the spec's dtype, seed, max_model_len and its "llm" arguments, if any."""
    from vllm import LLM

    return LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype=spec["dtype"],
        seed=spec["seed"],
        max_model_len=spec["max_model_len"],
        **spec.get("llm", {}),
    )


def setup(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, sideserver.Handler]]:
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = make_llm(spec)

    def generate(args: dict[str, Any]) -> dict[str, Any]:
        prompts, params = [], []
        for r in args["requests"]:
            prompts.append(TokensPrompt(prompt_token_ids=r["prompt"]))
            p = SamplingParams(detokenize=False, **r["params"])
            if r.get("bad_words_ids"):
                p._bad_words_token_ids = [list(w) for w in r["bad_words_ids"]]
            params.append(p)
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        logprobs = [
            [[[t, lp.logprob] for t, lp in pos.items()] for pos in (o.outputs[0].logprobs or [])]
            for o in outs
        ]
        return {"tokens": tokens, "logprobs": logprobs}

    return {"vllm": vllm.__version__}, {"generate": generate}


if __name__ == "__main__":  # vLLM starts its engine core as a child process
    raise SystemExit(sideserver.run(setup))
