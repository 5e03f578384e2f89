"""The model's tokenizer and chat template, from tokenizer.json / tokenizer_config.json.

The chat template is read where transformers puts it: `chat_template.jinja` (transformers
>= 4.43 saves it there, and 5.x only there), else `tokenizer_config.json`'s `chat_template`
(a string, or a list of named templates of which "default" is the one used).

Uses the `tokenizers` library and jinja2 only (no torch, no transformers), so the frontend
can import it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        path = Path(model_dir)
        self._tok = _HFTokenizer.from_file(str(path / "tokenizer.json"))
        cfg_path = path / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        template = _chat_template(path, self.config)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        # What transformers' apply_chat_template gives templates: its `tojson` (jinja's
        # sorts keys and escapes HTML, which would show the model other tool JSON than HF
        # does) and `raise_exception`.
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(template) if template else None
        # Whether the template renders a `tools` list itself (else the caller writes tools
        # into the messages: services/frontend/tool_prompt.py).
        self.renders_tools = bool(template) and "tools" in template
        self.special_ids = frozenset(self._tok.token_to_id(t) for t in self._special_tokens())

    def _special_tokens(self) -> list[str]:
        return [t.content for t in self._tok.get_added_tokens_decoder().values() if t.special]

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        if self._template is None:
            raise ValueError("this model has no chat template")
        return self._template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.config.get("bos_token", ""),
            eos_token=self.config.get("eos_token", ""),
        )


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise(message: str) -> None:
    raise TemplateError(message)


def _chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(
        template, list
    ):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default")
    return template
