"""Chat templates: the checkpoint's own (`chat_template.jinja`, or `chat_template` in
tokenizer_config.json), or one given with `--chat-template`, rendered the way transformers'
`apply_chat_template` renders it: a sandboxed jinja2 environment with trim_blocks and lstrip_blocks,
loop controls, its `tojson` filter and its globals (`raise_exception`, `strftime_now`, `dict`,
`namespace`), the tokenizer's named special tokens as variables, messages without None values,
reasoning under each of its names, and its way of continuing a final message. The rendered text is
then tokenized without adding special tokens, as transformers does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

# the tokenizer's named special tokens, which templates read as variables (transformers' special_tokens_map)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplate:
    """One template and the special tokens it may name; `render` is a chat's prompt text."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None):
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._compiled = _compile(source)

    @classmethod
    def for_model(cls, model_dir: str | Path | None, override: str | None = None) -> ChatTemplate | None:
        """The model's template (or `override`: a file or the template text); None when it has none."""
        config = _tokenizer_config(model_dir)
        specials = {name: _token_text(config[name]) for name in SPECIAL_TOKEN_NAMES if config.get(name) is not None}
        source = load_override(override) if override is not None else _model_template(model_dir, config)
        return None if source is None else cls(source, specials)

    def render(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text of one chat (messages as `validation.chat_messages` leaves them); the template
        also sees the special tokens and `template_kwargs` (e.g. enable_thinking). Anything the template
        fails on (its own raise_exception included) is a ValueError naming `messages`."""
        kwargs = dict(template_kwargs or {})
        reserved = sorted(set(kwargs) & {"messages", "tools", "documents", "add_generation_prompt"})
        if reserved:
            raise ValueError(f"chat_template_kwargs: {reserved[0]!r} is set by the request itself")
        if continue_final_message and add_generation_prompt:
            raise ValueError("add_generation_prompt: cannot be set together with continue_final_message")
        chat = _with_reasoning_aliases([{k: v for k, v in m.items() if v is not None} for m in messages])
        final = None
        if continue_final_message:
            final = chat[-1].get("content")
            if not isinstance(final, str):
                raise ValueError("continue_final_message: the final message has no text content to continue")
            chat[-1] = {**chat[-1], "content": final + _CONTINUE_TAG}
        import jinja2

        try:
            text = self._compiled.render(
                messages=chat,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **kwargs},
            )
        except jinja2.TemplateError as e:  # the template's own raise_exception, or the sandbox
            raise ValueError(f"messages: the chat template refused them: {str(e)[:300]}") from None
        except Exception as e:  # e.g. a TypeError on data the template did not expect: the request's doing
            raise ValueError(
                f"messages: the chat template cannot render them: {type(e).__name__}: {str(e)[:300]}"
            ) from None
        if final is not None:
            if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
                raise ValueError("continue_final_message: the chat template drops the final message")
            at = text.rindex(_CONTINUE_TAG.strip())
            text = text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
        return text


def load_override(value: str) -> str:
    """`--chat-template`: a file holding the template, or the template text itself."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{" in value:
        return value
    raise ValueError(f"chat_template: no such file: {value[:200]}")


def _tokenizer_config(model_dir: str | Path | None) -> dict:
    path = Path(model_dir) / "tokenizer_config.json" if model_dir is not None else None
    return json.loads(path.read_text()) if path is not None and path.is_file() else {}


def _model_template(model_dir: str | Path | None, config: dict) -> str | None:
    """chat_template.jinja first (where transformers saves it), else tokenizer_config's (a string, or
    a list of named templates whose "default" is taken)."""
    if model_dir is not None and (Path(model_dir) / "chat_template.jinja").is_file():
        return (Path(model_dir) / "chat_template.jinja").read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _token_text(value: Any) -> str:
    return value.get("content", "") if isinstance(value, dict) else str(value)  # an AddedToken is a dict


def _with_reasoning_aliases(chat: list[dict]) -> list[dict]:
    """A message's reasoning under each name templates read it by (as transformers fills them)."""
    out = []
    for message in chat:
        reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


@cache
def _compile(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        # transformers' `{% generation %}` marks assistant text for training masks; rendering keeps the body
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        # namespaces reject underscore attributes, as transformers' do (no reach into CPython internals)
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attributes cannot start with '_': {name[:40]!r}")

    class Dict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters; templates expect plain JSON
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = Dict()
    env.globals["namespace"] = Namespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template: not a valid jinja template: {e.message} (line {e.lineno})") from None
