"""The server's parts without a server: chat templates, incremental detokenization, the
OpenAI error shape of a bad body."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokentape.engine.detokenizer import ByteDetokenizer, IncrementalDetokenizer, detokenizer
from tokentape.engine.tokenizer import ByteTokenizer
from tokentape.entrypoints import protocol as p
from tokentape.entrypoints.chat_template import ChatTemplate, ChatTemplateError, message_text
from tokentape.entrypoints.metrics import ServerMetrics
from tokentape.entrypoints.request_body import param_of_validation as _param_of
from tokentape.entrypoints.serving_engine import SSEFramer, sse_bytes


def test_builtin_chat_template() -> None:
    t = ChatTemplate.for_model("tiny")
    msgs = [
        message_text("system", "Be brief."),
        message_text("user", [{"type": "text", "text": "Hi"}]),
    ]
    assert t.render(msgs) == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    with pytest.raises(ChatTemplateError, match="text content"):
        message_text("user", [{"type": "image_url", "image_url": "x"}])


def test_a_checkpoint_template_and_a_checkpoint_without_one(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }};{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    (tmp_path / "a" / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": [{"name": "default", "template": template}],
                "bos_token": {"content": "<s>"},
            }
        )
    )
    t = ChatTemplate.for_model(str(tmp_path / "a"))
    assert t.render([{"role": "user", "content": "Hi"}]) == "<s>user: Hi;assistant:"
    bare = ChatTemplate.for_model(str(tmp_path / "b"))
    assert not bare.available
    with pytest.raises(ChatTemplateError, match="no chat template"):
        bare.render([{"role": "user", "content": "Hi"}])
    (tmp_path / "b" / "chat_template.jinja").write_text("{{ raise_exception('no system role') }}")
    with pytest.raises(ChatTemplateError, match="no system role"):
        ChatTemplate.for_model(str(tmp_path / "b")).render([{"role": "system", "content": "x"}])


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_incremental_detokenizer_holds_back_a_cut_character(chunk: int) -> None:
    tok = ByteTokenizer()
    ids = tok.encode("héllo wörld ✓ — done")
    d = IncrementalDetokenizer(tok.decode)
    deltas = [d.add(ids[i : i + chunk], i + chunk >= len(ids)) for i in range(0, len(ids), chunk)]
    assert "".join(deltas) == tok.decode(ids) and "\ufffd" not in "".join(deltas)


def test_the_byte_detokenizer_gives_the_windowed_one_s_text() -> None:
    """The byte tokenizer's fast path: the same text as the windowed detokenizer, whatever the
    cuts, with invalid bytes, cut characters and special tokens."""
    import random

    tok, rng = ByteTokenizer(), random.Random(0)
    assert isinstance(detokenizer(tok), ByteDetokenizer)
    for trial in range(500):
        ids = (
            tok.encode("héllo wörld ✓ — 日本語🙂")
            if trial % 2
            else [rng.randrange(0, 262) for _ in range(25)]
        )
        cuts = sorted(rng.sample(range(1, len(ids)), rng.randrange(0, 6)))
        parts = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)])]
        windowed, fast = IncrementalDetokenizer(tok.decode), ByteDetokenizer(tok)
        texts = [
            "".join(d.add(part, i == len(parts) - 1) for i, part in enumerate(parts))
            for d in (windowed, fast)
        ]
        assert texts[0] == texts[1] == tok.decode(ids)
        assert windowed.num_chars == fast.num_chars == len(texts[0])


def test_the_sse_framer_encodes_what_sse_bytes_does() -> None:
    tricky = 'x"choices":[]\\'  # the key's text inside a string (an x-request-id is the client's)
    framer = SSEFramer(p.CompletionResponse(tricky, 7, "m", []))
    choice = p.CompletionChoice(0, 'a "b"', "stop", token_ids=[5, 6])
    assert framer.chunk(choice) == sse_bytes(p.CompletionResponse(tricky, 7, "m", [choice]))
    chat = SSEFramer(p.ChatCompletionChunk("c", 1, "m", []))
    delta = p.ChatStreamChoice(0, p.ChatDelta(content="hi"), None)
    assert chat.chunk(delta) == sse_bytes(p.ChatCompletionChunk("c", 1, "m", [delta]))


def test_latency_histograms_render_cumulative_buckets() -> None:
    from tokentape.engine.core.messages import SchedulerStats

    m = ServerMetrics("tiny", SchedulerStats)
    for seconds in (0.0005, 0.001, 0.003, 100.0):
        m.itl.observe(seconds)
    lines = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in m.render().decode().splitlines()
        if line.startswith("vllm:inter_token_latency_seconds")
    }
    assert (
        lines['vllm:inter_token_latency_seconds_bucket{le="0.001",model_name="tiny"}'] == 2
    )  # le: <=
    assert lines['vllm:inter_token_latency_seconds_bucket{le="0.005",model_name="tiny"}'] == 3
    assert lines['vllm:inter_token_latency_seconds_bucket{le="+Inf",model_name="tiny"}'] == 4
    assert lines['vllm:inter_token_latency_seconds_count{model_name="tiny"}'] == 4
    assert lines['vllm:inter_token_latency_seconds_sum{model_name="tiny"}'] == pytest.approx(
        100.0045
    )


def test_the_bad_field_of_a_body_is_named() -> None:
    assert _param_of("Expected `int`, got `str` - at `$.max_tokens`") == "max_tokens"
    assert _param_of("Expected `str`, got `int` - at `$.messages[0].content`") == "messages"
    assert _param_of("Object missing required field `prompt`") == "prompt"
    assert _param_of("something else") is None


def test_the_serve_parser_and_its_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    from tokentape.engine.arg_utils import engine_args_from_cli as engine_args
    from tokentape.entrypoints.api_server import main
    from tokentape.entrypoints.cli.serve import add_parser

    sub = argparse.ArgumentParser(prog="tokentape").add_subparsers()
    srv = add_parser(sub)
    args = srv.parse_args(
        [
            "--model",
            "oracle",
            "--port",
            "0",
            "--pipeline-depth",
            "3",
            "--max-model-len",
            "64",
            "--drain-timeout",
            "0.5",
        ]
    )
    assert (args.model, args.port, args.drain_timeout) == ("oracle", 0, 0.5)
    assert engine_args(args) == {"seed": 0, "pipeline_depth": 3, "max_model_len": 64}
    lanes = srv.parse_args(["--cpu-threads", "1", "--stream-interval", "4"])
    assert engine_args(lanes) == {"seed": 0, "cpu_threads": 1} and lanes.stream_interval == 4
    existing = tmp_path / "old.tape"
    existing.write_bytes(b"")
    assert main(["--model", "oracle", "--tape", str(existing)]) == 2  # before any process starts
    assert "the file exists; pass --force to overwrite it" in capsys.readouterr().err
    # --force: bad engine arguments are still refused before the old tape is removed.
    assert main(["--model", "oracle", "--tape", str(existing), "--force", "--block-size", "0"]) == 2
    assert (
        main(["--model", "oracle", "--tape", str(existing), "--force", "--pipeline-depth", "9"])
        == 2
    )
    assert "pipeline_depth" in capsys.readouterr().err and existing.exists()
    assert main(["--port", "-1"]) == 2


def test_a_server_on_the_cpu_takes_vllm_s_server_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import argparse

    import torch

    from tokentape.engine.arg_utils import (
        SERVER_CPU_DEFAULTS,
        UsageContext,
        create_engine_config,
        engine_args_from_cli,
    )
    from tokentape.engine.config import EngineConfig
    from tokentape.entrypoints.cli.serve import add_parser

    srv = add_parser(argparse.ArgumentParser(prog="tokentape").add_subparsers())

    def served(*argv: str) -> tuple[int, int]:
        args = srv.parse_args(list(argv))
        config = create_engine_config(
            args.model, engine_args_from_cli(args), UsageContext.OPENAI_API_SERVER
        )
        return config.max_num_batched_tokens, config.max_num_seqs

    engine = (EngineConfig().max_num_batched_tokens, EngineConfig().max_num_seqs)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert served("--model", "tiny") == (2048, 128) != engine
    assert served("--max-num-batched-tokens", "512") == (512, 128)  # a flag given wins
    # The oracle runs no model; the engine's defaults elsewhere than a server.
    assert served("--model", "oracle") == engine
    args = srv.parse_args(["--model", "tiny"])
    config = create_engine_config("tiny", engine_args_from_cli(args), UsageContext.ENGINE_CONTEXT)
    assert (config.max_num_batched_tokens, config.max_num_seqs) == engine
    # A model on CUDA serves with the engine's defaults, the device asked where it would run.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert served("--model", "tiny") == engine
    on_cpu = create_engine_config("tiny", {"device": "cpu"}, UsageContext.OPENAI_API_SERVER)
    assert (on_cpu.max_num_batched_tokens, on_cpu.max_num_seqs) == (2048, 128)
    assert set(SERVER_CPU_DEFAULTS) <= set(vars(srv.parse_args([])))
    assert "(default: 2048 for a model on the CPU" in " ".join(srv.format_help().split())
