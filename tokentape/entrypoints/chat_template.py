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
    """The messages cannot be rendered (no template, a bad message, the template refused);
    `param`: the request field at fault."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


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

    def render(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text. `continue_final_message` (vLLM's, as transformers does it): the
        text ends where the final message's content ends, open for the model to continue.
        `template_kwargs` (vLLM's chat_template_kwargs): more variables for the template
        (e.g. `enable_thinking`); they cannot replace the messages or the flags."""
        if self.source is None:
            raise ChatTemplateError(
                "this model has no chat template (no chat_template in tokenizer_config.json, "
                "no chat_template.jinja); use /v1/completions"
            )
        if self._compiled is None:
            text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
            text += "<|assistant|>\n" if add_generation_prompt else ""
        else:
            variables = {
                **(template_kwargs or {}),
                "messages": messages,
                "add_generation_prompt": add_generation_prompt,
                "bos_token": self.bos_token,
                "eos_token": self.eos_token,
            }
            try:
                text = self._compiled.render(**variables)
            except ChatTemplateError:
                raise
            except Exception as exc:  # a template error is the request's problem
                raise ChatTemplateError(
                    f"the chat template failed: {type(exc).__name__}: {exc}"
                ) from None
        return _continued(text, messages) if continue_final_message else text


def _continued(text: str, messages: list[dict[str, str]]) -> str:
    """The rendered text cut after the final message's content (transformers' rule)."""
    final = messages[-1]["content"] if messages else ""
    at = text.rfind(final.strip()) if final.strip() else -1
    if at < 0:
        raise ChatTemplateError(
            "continue_final_message is set but the final message does not appear in the "
            "chat after applying the chat template",
            param="continue_final_message",
        )
    return text[: at + len(final.strip())]


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def message_text(role: str, content: object, name: str | None = None) -> dict[str, str]:
    """One message as the template sees it: text content, or the text parts joined (and the
    participant's `name`, when given, for templates that show it)."""
    named = {"name": name} if name is not None else {}
    if content is None:
        return {"role": role, "content": "", **named}
    if isinstance(content, str):
        return {"role": role, "content": content, **named}
    parts = []
    for part in content:  # type: ignore[attr-defined]
        if (
            not isinstance(part, dict)
            or part.get("type") != "text"
            or not isinstance(part.get("text"), str)
        ):
            raise ChatTemplateError(f"only text content parts are supported, got {str(part)[:80]}")
        parts.append(part["text"])
    return {"role": role, "content": "".join(parts), **named}
