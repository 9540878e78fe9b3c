"""LoRA through AsyncLLM (the engine core in its own process) and the server: adapters by
name (--lora-modules, /v1/load_lora_adapter), a request's `model` choosing one, /v1/models
listing them, and every refusal a 4xx that records nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from adapter_files import write_adapter, write_tiny_base

from tokentape import LLM, AsyncLLM, LoRARequest, SamplingParams
from tokentape.entrypoints.api_server import ServerOptions, build_app
from tokentape.errors import LoRAError
from tokentape.events import schema as ev
from tokentape.replay.tape import load_tape
from tokentape.replay.verify import verify

pytest.importorskip("peft")

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = [5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora_serving")
    base = write_tiny_base(root / "base")
    write_adapter(root / "sql", base, rank=8, seed=1)
    write_adapter(root / "chat", base, rank=4, targets=["q_proj", "o_proj"], seed=2)
    return root


def offline_tokens(root: Path, adapter: str | None) -> list[int]:
    lora = None if adapter is None else LoRARequest(adapter, 1, str(root / adapter))
    with LLM(str(root / "base"), tape=None, enable_lora=True) as llm:
        return list(llm.generate([PROMPT], GREEDY, lora_request=lora)[0].outputs[0].token_ids)


def test_async_llm_serves_adapters_from_its_engine_core_process(root: Path, tmp_path: Path) -> None:
    tape = tmp_path / "a.tape"
    engine = AsyncLLM(str(root / "base"), tape=str(tape), enable_lora=True, max_loras=2)
    sql = LoRARequest("sql", 1, str(root / "sql"))

    async def tokens(request_id: str, lora: LoRARequest | None) -> list[int]:
        async for out in engine.generate(PROMPT, GREEDY, request_id, lora_request=lora):
            last = out
        return list(last.outputs[0].token_ids)

    async def main() -> tuple[list[int], list[int]]:
        with_sql, base = await asyncio.gather(tokens("a", sql), tokens("b", None))
        assert await engine.list_loras() == {1}
        assert not await engine.add_lora(sql)  # loaded already
        with pytest.raises(LoRAError, match="does not exist"):  # crosses as itself
            await engine.add_lora(LoRARequest("gone", 2, str(tmp_path / "gone")))
        with pytest.raises(LoRAError, match="does not exist"):
            await tokens("c", LoRARequest("gone", 2, str(tmp_path / "gone")))
        assert await engine.remove_lora(1) and await engine.list_loras() == set()
        return with_sql, base

    try:
        with_sql, base = asyncio.run(main())
    finally:
        engine.shutdown()
    assert with_sql == offline_tokens(root, "sql") and base == offline_tokens(root, None)
    kinds = [ev.kind_of(e) for _, e in load_tape(tape).events() if "LoRA" in ev.kind_of(e)]
    assert kinds == ["LoRAAdded", "LoRARemoved"]
    assert verify(tape).ok


def test_the_server_serves_adapters_by_name(root: Path) -> None:
    engine = AsyncLLM(str(root / "base"), tape=False, multiprocess_mode=False, enable_lora=True)
    options = ServerOptions(lora_modules=(("sql", str(root / "sql")),), enable_runtime_lora=True)

    async def main() -> None:
        app = build_app(engine, "base", options=options)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:

            async def complete(model: str) -> httpx.Response:
                body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
                body |= {"ignore_eos": True, "return_token_ids": True}
                return await http.post("/v1/completions", json=body)

            r = await http.get("/v1/models")
            cards = {c["id"]: c for c in r.json()["data"]}
            assert set(cards) == {"base", "sql"} and cards["sql"]["parent"] == "base"
            r = await complete("sql")
            assert r.status_code == 200 and r.json()["model"] == "sql"
            assert r.json()["choices"][0]["token_ids"] == offline_tokens(root, "sql")
            r = await complete("base")
            assert r.json()["choices"][0]["token_ids"] == offline_tokens(root, None)
            assert (await complete("nope")).status_code == 404
            # Loaded at run time, then served by its name; unloaded, it is gone.
            r = await http.post(
                "/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(root / "chat")}
            )
            assert r.status_code == 200 and "added successfully" in r.text
            assert (await complete("chat")).status_code == 200
            r = await http.post(
                "/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(root / "chat")}
            )
            assert r.status_code == 400 and "already been loaded" in r.text
            r = await http.post(
                "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(root / "x")}
            )
            assert r.status_code == 400 and "does not exist" in r.text
            assert (await complete("bad")).status_code == 404
            r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
            assert r.status_code == 200 and "removed successfully" in r.text
            assert (await complete("chat")).status_code == 404
            r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
            assert r.status_code == 404

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_the_runtime_endpoints_need_the_switch(root: Path) -> None:
    engine = AsyncLLM(str(root / "base"), tape=False, multiprocess_mode=False, enable_lora=True)

    async def main() -> None:
        transport = httpx.ASGITransport(app=build_app(engine, "base"))
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            body = {"lora_name": "sql", "lora_path": str(root / "sql")}
            assert (await http.post("/v1/load_lora_adapter", json=body)).status_code == 404

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_serve_checks_its_lora_modules_before_it_starts(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokentape.cli import main as cli

    base = ["serve", "--model", "tiny", "--no-tape", "--port", "0"]
    assert cli([*base, "--lora-modules", f"sql={root / 'sql'}"]) == 2
    assert "--lora-modules needs --enable-lora" in capsys.readouterr().err
    assert cli([*base, "--enable-lora", "--lora-modules", f"x={tmp_path / 'gone'}"]) == 2
    assert "the folder does not exist" in capsys.readouterr().err
    modules = [f"a={root / 'sql'}", f"a={root / 'chat'}"]
    assert cli([*base, "--enable-lora", "--lora-modules", *modules]) == 2
    assert "every name must be unique" in capsys.readouterr().err
