"""Chat prompts: the model directory's chat template (``tokenizer_config.json``'s
``chat_template``), rendered as transformers renders it, in jinja2's sandbox.

``ChatTemplate.load(directory)`` reads the template (a string, or the list of named templates
transformers accepts, of which ``default`` is used) with the tokenizer's ``bos_token`` and
``eos_token``; a model without one (the bundled byte-level models have no directory at all) gets
``None``, and the server refuses chat requests naming what is missing. Rendering uses
``ImmutableSandboxedEnvironment`` (a template cannot reach Python objects' internals or mutate its
inputs) with ``trim_blocks`` and ``lstrip_blocks``, ``raise_exception`` and ``strftime_now`` as
transformers defines them; a template that raises is a 400 naming it, never a 500.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final, NoReturn

import attrs
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from compiler.online.protocol import ChatMessage, bad

__all__ = ["ChatTemplate"]

MAX_CONFIG_BYTES: Final = 16 << 20


def _special(value: object) -> str:
    """A special token as tokenizer_config.json writes it: a string or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return ""


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return time.strftime(fmt)


@attrs.frozen
class ChatTemplate:
    """A checkpoint's chat template (``source``, jinja2) with its ``bos_token`` and ``eos_token``:
    ``load`` reads it from a model directory, ``render`` turns chat messages into the prompt text in
    jinja2's immutable sandbox (see the module)."""

    source: str
    bos_token: str
    eos_token: str

    @staticmethod
    def load(directory: str | None) -> ChatTemplate | None:
        """The template of the checkpoint in ``directory`` (None: no directory, no config, or no template)."""
        if directory is None:
            return None
        path = Path(directory) / "tokenizer_config.json"
        try:
            if not path.is_file() or path.stat().st_size > MAX_CONFIG_BYTES:
                return None
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(config, dict):
            return None
        template = config.get("chat_template")
        if isinstance(template, list):  # transformers' named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if not isinstance(template, str) or not template:
            return None
        return ChatTemplate(template, _special(config.get("bos_token")), _special(config.get("eos_token")))

    def render(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool) -> str:
        """The prompt text, or ``ApiError`` 400 when the template refuses the messages."""
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            return env.from_string(self.source).render(
                messages=[{"role": m.role, "content": m.content} for m in messages], add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token,
            )
        except TemplateError as exc:
            raise bad("messages", f"the model's chat template refused the messages: {' '.join(str(exc).split())[:300]}") from None
