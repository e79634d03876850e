"""Chat templates: the GGUF's `tokenizer.chat_template` rendered the way HF transformers renders it.

transformers compiles chat templates in an `ImmutableSandboxedEnvironment(trim_blocks=True,
lstrip_blocks=True)` with the `jinja2.ext.loopcontrols` extension, a `tojson` filter that is plain
`json.dumps(ensure_ascii=False)`, and the globals `raise_exception` and `strftime_now`. Templates
are written against that environment, so rendering them in any other way (jinja2's own `tojson`
HTML-escapes, for one) gives prompts the model never saw in training.

    template = ChatTemplate.from_model(model)          # or ChatTemplate(source, bos_token=...)
    text = template.render(messages, add_generation_prompt=True, enable_thinking=False)

A file without a template gets the Qwen3 ChatML template (`ChatTemplate.builtin`); a template
that does not parse or fails while rendering raises `TokenizerError` with the reason.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from importlib import resources
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from deltarun.base.errors import TokenizerError

TEMPLATE_KEY = "tokenizer.chat_template"
BUILTIN_NAME = "built-in Qwen3 ChatML template"


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Same signature and behaviour as transformers' filter: no HTML escaping, unlike jinja2's tojson.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


class GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def make_environment() -> ImmutableSandboxedEnvironment:
    """The jinja2 environment transformers uses for chat templates."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=1)
def qwen3_template_source() -> str:
    """The Qwen3 ChatML template (the one Qwen3 and Qwen3-Next files ship), used as a fallback."""
    return resources.files("deltarun.model_files").joinpath("data/qwen3-chat-template.jinja").read_text(encoding="utf-8")


class ChatTemplate:
    """A compiled chat template plus the special-token texts it may refer to."""

    def __init__(self, source: str, *, bos_token: str | None = None, eos_token: str | None = None,
                 name: str = "chat template"):
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.name = name
        try:
            self._template = make_environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise TokenizerError(f"the {name} does not parse: line {e.lineno}: {e.message}") from e
        except jinja2.TemplateError as e:
            raise TokenizerError(f"the {name} does not parse: {e}") from e

    @classmethod
    def builtin(cls, bos_token: str | None = None, eos_token: str | None = None) -> "ChatTemplate":
        return cls(qwen3_template_source(), bos_token=bos_token, eos_token=eos_token, name=BUILTIN_NAME)

    @classmethod
    def from_model(cls, model: Any) -> "ChatTemplate":
        """The template stored in the model's GGUF (`tokenizer.chat_template`), else the built-in one.

        `is_builtin` tells which one it is, so a command can mention the fallback.
        """
        tok = model.tokenizer
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else None
        eos = tok.token_text(tok.eos_id) if tok.eos_id is not None else None
        source = model.file.get(TEMPLATE_KEY)
        if source is None or (isinstance(source, str) and not source.strip()):
            return cls.builtin(bos, eos)
        if not isinstance(source, str):
            raise TokenizerError(f"{TEMPLATE_KEY} in {model.path} is not a string")
        return cls(source, bos_token=bos, eos_token=eos, name=f"chat template of {model.path.name}")

    @property
    def is_builtin(self) -> bool:
        return self.name == BUILTIN_NAME

    def reasoning_separator(self) -> str | None:
        """What the template writes between an answer's reasoning and its content (Qwen3 and
        Qwen3.5: "\n</think>\n\n"), found by rendering one; None when it renders no reasoning."""
        reasoning, content = "\u0001", "\u0002"
        try:
            text = self.render([{"role": "user", "content": "?"},
                                {"role": "assistant", "content": content, "reasoning_content": reasoning}],
                               add_generation_prompt=False)
        except TokenizerError:
            return None
        start, end = text.find(reasoning), text.find(content)
        return text[start + 1:end] if 0 <= start < end else None

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               enable_thinking: bool | None = None, tools: Sequence[Any] | None = None, images: bool = False,
               **extra: Any) -> str:
        """The prompt text of a conversation.

        `enable_thinking=None` leaves the variable undefined (the template's default); extra keyword
        arguments become template variables, as `apply_chat_template(**kwargs)` does. `images`: image
        parts ({"type": "image"}) are rendered (the caller puts the image's rows where the template
        writes its pad token) instead of refused.
        """
        _refuse_media_parts(messages, allowed=frozenset({"image"}) if images else frozenset())
        variables: dict[str, Any] = {
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
        }
        if tools is not None:
            variables["tools"] = list(tools)
        if enable_thinking is not None:
            variables["enable_thinking"] = bool(enable_thinking)
        variables.update(extra)
        try:
            return self._template.render(**variables)
        except jinja2.TemplateError as e:  # raise_exception(...), undefined names, sandbox refusals
            raise TokenizerError(f"the {self.name} failed: {e}") from e
        except (TypeError, ValueError, AttributeError, IndexError, KeyError) as e:
            raise TokenizerError(f"the {self.name} failed on this conversation: {type(e).__name__}: {e}") from e


#: Content-part kinds that need a vision/audio encoder (OpenAI and Hugging Face spellings).
MEDIA_PART_TYPES = frozenset({"image", "image_url", "input_image", "video", "video_url", "input_audio", "audio"})


def _refuse_media_parts(messages: Sequence[Mapping[str, Any]], allowed: frozenset[str] = frozenset()) -> None:
    """Content given as a list of parts may hold text parts only: deltarun runs the text model, so an
    image or video part (which Qwen3.5's template would turn into placeholder tokens with nothing to
    fill them) is refused up front with one line naming the message."""
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, (list, tuple)):
            continue
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            keys = set(part) if isinstance(part, Mapping) else set()
            media = ({kind} | keys) & MEDIA_PART_TYPES
            if media and not (kind in allowed and media <= allowed):
                raise TokenizerError(f"message {index} ({message.get('role', '?')}) has a {sorted(media)[0]} "
                                     "part: only text parts are supported (deltarun runs text models)")
