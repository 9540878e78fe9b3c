"""Chat prompts: a checkpoint's own template (tokenizer_config.json's `chat_template`, or
`chat_template.jinja`), rendered with jinja2 in a sandbox as transformers does; the built-in
models and the oracle get a simple one:

    <|system|>
    You are terse.
    <|user|>
    Hello
    <|assistant|>
"""

from __future__ import annotations

import json
import os
from typing import Any

BUILTIN_TEMPLATE = "builtin"


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (no template, a bad message, the template refused)."""


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer configs
        value = value.get("content", "")
    return value if isinstance(value, str) else ""


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = "") -> None:
        """`source`: a jinja template, BUILTIN_TEMPLATE, or None (the model has none)."""
        self.source = source
        self._compiled: Any = None
        if source is not None and source != BUILTIN_TEMPLATE:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._compiled = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def for_model(cls, model: str) -> ChatTemplate:
        """The folder's template if it has one (None if it has none); the simple one for the
        built-in models and the oracle."""
        if not os.path.isdir(model):
            return cls(BUILTIN_TEMPLATE)
        config: dict[str, Any] = {}
        path = os.path.join(model, "tokenizer_config.json")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        jinja_file = os.path.join(model, "chat_template.jinja")
        if source is None and os.path.exists(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                source = f.read()
        return cls(
            source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        )

    @property
    def available(self) -> bool:
        return self.source is not None

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self.source is None:
            raise ChatTemplateError(
                "this model has no chat template (no chat_template in tokenizer_config.json, "
                "no chat_template.jinja); use /v1/completions"
            )
        if self._compiled is None:
            text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
            return text + ("<|assistant|>\n" if add_generation_prompt else "")
        try:
            return self._compiled.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except ChatTemplateError:
            raise
        except Exception as exc:  # a template error is the request's problem, not the server's
            raise ChatTemplateError(
                f"the chat template failed: {type(exc).__name__}: {exc}"
            ) from None


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def message_text(role: str, content: object) -> dict[str, str]:
    """One message as the template sees it: text content, or the text parts joined."""
    if content is None:
        return {"role": role, "content": ""}
    if isinstance(content, str):
        return {"role": role, "content": content}
    parts = []
    for part in content:  # type: ignore[attr-defined]
        if (
            not isinstance(part, dict)
            or part.get("type") != "text"
            or not isinstance(part.get("text"), str)
        ):
            raise ChatTemplateError(f"only text content parts are supported, got {str(part)[:80]}")
        parts.append(part["text"])
    return {"role": role, "content": "".join(parts)}
