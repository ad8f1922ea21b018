"""Tokenizer and chat template without transformers: `tokenizers` + a sandboxed jinja2 template.

Torch- and transformers-free so the ingress can tokenize prompts and detokenize streams while
starting fast. `apply_chat_template` renders the template the way transformers does (same jinja
environment options, globals and filters) so the ids match `AutoTokenizer.apply_chat_template`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from kvrelay.core.errors import KvrelayError

logger = logging.getLogger(__name__)

_SPECIAL_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class ChatTemplateError(KvrelayError, ValueError):
    """The chat template is missing or failed to render these messages."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Same override as transformers: jinja's own tojson escapes HTML characters.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in an environment configured like transformers'."""
    return _ENV.from_string(source)


def is_file(path: Path) -> bool:
    """`path.is_file()`, False for a name no file can have (template text: too long, ...)."""
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def read_chat_template(value: str) -> str:
    """The chat template `value` gives (vLLM's --chat-template): a file's text when it names a
    file, else the template text itself. ChatTemplateError, naming the file, when there is no
    such file or the template does not compile."""
    path = Path(value).expanduser()
    if is_file(path):
        where = f"chat template {str(path)!r}"
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ChatTemplateError(f"{where}: cannot read it: {exc}") from None
    elif any(c in value for c in "{}\n"):  # no file: template text (as vLLM tells them apart)
        where, text = "chat template text", value
    else:
        raise ChatTemplateError(f"chat template {value!r}: no such file")
    try:
        compile_chat_template(text)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"{where} does not compile: line {exc.lineno}: {exc.message}"
        ) from None
    return text


def _token_content(value: Any) -> str | None:
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


# Every file a Tokenizer reads from a model directory (those present): all a producer needs to
# turn prompts into the ids the model's worker expects.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "config.json",
)


def _json_file(files: Mapping[str, bytes], name: str) -> dict:
    raw = files.get(name)
    return json.loads(raw) if raw is not None else {}


def _find_chat_template(files: Mapping[str, bytes], tok_config: dict) -> str | None:
    jinja_file = files.get("chat_template.jinja")
    if jinja_file is not None:
        return jinja_file.decode()
    template = _json_file(files, "chat_template.json").get("chat_template")
    template = template or tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: pick "default"
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def read_tokenizer_files(directory: str | os.PathLike) -> dict[str, bytes]:
    """The `TOKENIZER_FILES` present in a model directory, name -> contents."""
    directory = Path(directory)
    return {
        name: (directory / name).read_bytes()
        for name in TOKENIZER_FILES
        if (directory / name).is_file()
    }


class Tokenizer:
    """Encode/decode and chat-format prompts for one model directory."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        special_tokens: dict[str, str],
        chat_template: str | None = None,
        eos_token_ids: Iterable[int] = (),
    ):
        self._tok = tokenizer
        self.special_tokens = special_tokens
        self.chat_template = chat_template
        self._template = compile_chat_template(chat_template) if chat_template else None
        # a template that never reads `tools` drops them: the caller describes them instead
        self.template_reads_tools = bool(
            chat_template
            and "tools" in jinja2.meta.find_undeclared_variables(_ENV.parse(chat_template))
        )
        ids = [self._tok.token_to_id(t) for t in (special_tokens.get("eos_token"),) if t]
        self.eos_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys([*eos_token_ids, *(i for i in ids if i is not None)])
        )
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)

    def with_chat_template(self, chat_template: str) -> Tokenizer:
        """This tokenizer rendering chats with `chat_template` instead of the model's own."""
        return Tokenizer(self._tok, self.special_tokens, chat_template, self.eos_token_ids)

    @classmethod
    def from_dir(cls, directory: str | os.PathLike) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json, the chat template and generation eos ids."""
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found (only fast tokenizer.json is supported)")
        return cls.from_files(read_tokenizer_files(directory))

    @classmethod
    def from_files(cls, files: Mapping[str, bytes]) -> Tokenizer:
        """The same from the contents of those files (`TOKENIZER_FILES`: name -> bytes)."""
        if "tokenizer.json" not in files:
            raise FileNotFoundError(
                "tokenizer.json is missing (only fast tokenizers are supported)"
            )
        tok_config = _json_file(files, "tokenizer_config.json")
        special = {k: v for k in _SPECIAL_KEYS if (v := _token_content(tok_config.get(k)))}
        gen_eos = _json_file(files, "generation_config.json").get("eos_token_id")
        if gen_eos is None:
            gen_eos = _json_file(files, "config.json").get("eos_token_id")
        eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        template = _find_chat_template(files, tok_config)
        tokenizer = HFTokenizer.from_str(files["tokenizer.json"].decode())
        return cls(tokenizer, special, template, eos)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what a grammar engine builds its token table
        from)."""
        return self._tok.to_str()

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = False
    ) -> list[list[int]]:
        """Token ids of several texts (parallel in the Rust tokenizer)."""
        encs = self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encs]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (invalid UTF-8 fragments become U+FFFD)."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text the chat template renders for `messages`."""
        if self._template is None:
            raise ChatTemplateError(
                "this model has no chat template; send a plain prompt, or give the model one "
                "(kvrelay up --chat-template FILE)"
            )
        if not messages:
            raise ChatTemplateError("cannot apply the chat template to an empty conversation")
        for m in messages:
            if not isinstance(m, Mapping):
                raise ChatTemplateError(f"chat messages must be objects, got {m!r}")
        # transformers drops None-valued fields before rendering.
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        context = {**self.special_tokens, **kwargs}
        try:
            return self._template.render(
                messages=chat,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
        except (TypeError, KeyError, AttributeError) as exc:
            raise ChatTemplateError(f"invalid chat messages for the template: {exc!r}") from exc

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs
    ) -> list[int]:
        """Token ids of the rendered chat (identical to transformers' apply_chat_template)."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **kwargs))


class IncrementalDetokenizer:
    """Turns streamed token ids into text deltas that never split a multi-byte character.

    Decodes a small window (from `prefix_offset`) with and without the new tokens and emits the
    difference; text ending in U+FFFD (an incomplete UTF-8 sequence) is held back until the next
    token completes it or `flush()` is called at the end of the stream.
    """

    _CONTEXT = 5  # prompt tokens decoded as left context (spacing of sentencepiece tokenizers)

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-self._CONTEXT :]) if prompt_ids else []
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.num_prompt_context = len(self.ids)

    @property
    def output_ids(self) -> list[int]:
        return self.ids[self.num_prompt_context :]

    def _window(self, end: int) -> str:
        return self.tokenizer.decode(self.ids[self.prefix_offset : end], self.skip_special_tokens)

    def add(self, token_ids: Iterable[int]) -> str:
        """Append generated tokens; return the newly completed text."""
        self.ids.extend(int(t) for t in token_ids)
        if len(self.ids) == self.read_offset:
            return ""
        prefix_text = self._window(self.read_offset)
        new_text = self._window(len(self.ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """Text still held back (an unfinished character renders as U+FFFD); call at the end."""
        if len(self.ids) == self.read_offset:
            return ""
        prefix_text = self._window(self.read_offset)
        new_text = self._window(len(self.ids))
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text) :]
