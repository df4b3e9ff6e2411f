"""Chat templates render exactly as transformers' `apply_chat_template` renders them (the reference
no one here wrote): the demo model's template and one that uses the environment's extras, over
system prompts, multi-turn chats with reasoning, tool calls and tool responses, tools, the
generation prompt on and off, template kwargs and a continued final message. Where the template
comes from, and a bad one, are errors naming the setting."""

from __future__ import annotations

import json
import re

import pytest
from transformers import PreTrainedTokenizerFast

from deltaserve.cluster.entrypoints.chat_template import ChatTemplate
from deltaserve.cluster.entrypoints.demo_model import qwen3_5_chat_template
from deltaserve.cluster.entrypoints.validation import chat_messages

SPECIALS = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}

# the jinja environment's extras: namespace, loop controls, tojson's options, dict(), the generation
# tag, raise_exception, and the special tokens as variables
EXTRAS = (
    "{{ bos_token }}{% set ns = namespace(n=0) %}"
    "{% for m in messages %}{% if m.role == 'tool' %}{% continue %}{% endif %}\n"
    "{% set ns.n = ns.n + 1 %}[{{ ns.n }}:{{ m.role }}]"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{{ eos_token }}"
    "{% else %}{{ m.content }}{% endif %}\n"
    "{% if m.tool_calls is defined %}{{ m.tool_calls | tojson(indent=2, sort_keys=True) }}{% endif %}\n"
    "{% if m.reasoning_content is defined %}<r>{{ m.thinking }}</r>{% endif %}{% endfor %}\n"
    "{% if tools %}{{ dict(n=tools | length) | tojson }}{% endif %}\n"
    "{% if messages[-1].role == 'system' %}{{ raise_exception('a chat cannot end with a system message') }}"
    "{% endif %}\n"
    "{% if add_generation_prompt %}[assistant]{% endif %}{% if flavour is defined %}({{ flavour }}){% endif %}"
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CHATS = {
    "system-user": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi, café?"}],
    "user-only": [{"role": "user", "content": "Hello"}],
    "multi-turn-reasoning": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "add them"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "<think>\nadd again\n</think>\n\n6"},
    ],
    "tool-calls": [
        {"role": "system", "content": "You help."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"},
        {"role": "tool", "content": '{"wind": 3}', "tool_call_id": "call_1"},
        {"role": "assistant", "content": "21 degrees.", "reasoning_content": "from the tool"},
    ],
}
TEMPLATES = {"qwen3_5-format": qwen3_5_chat_template(), "environment-extras": EXTRAS}


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_checkpoints) -> PreTrainedTokenizerFast:
    path = tiny_checkpoints["qwen3_5_moe"][0]
    return PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), **SPECIALS)


@pytest.mark.parametrize("template_name", TEMPLATES)
@pytest.mark.parametrize("chat_name", CHATS)
@pytest.mark.parametrize(
    "options",
    [
        dict(add_generation_prompt=True),
        dict(add_generation_prompt=False),
        dict(add_generation_prompt=True, tools=[WEATHER]),
        dict(add_generation_prompt=True, enable_thinking=False, flavour="salty"),
    ],
    ids=["generation-prompt", "no-generation-prompt", "tools", "kwargs"],
)
def test_renders_as_transformers(hf_tokenizer, template_name, chat_name, options):
    template, messages = TEMPLATES[template_name], CHATS[chat_name]
    want = hf_tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, **options)
    named = ("add_generation_prompt", "tools")
    extra = {k: v for k, v in options.items() if k not in named}  # what a request's chat_template_kwargs carry
    ours = ChatTemplate(template, SPECIALS).render(
        chat_messages(messages), **{k: v for k, v in options.items() if k in named}, template_kwargs=extra
    )
    assert ours == want


@pytest.mark.parametrize("template_name", TEMPLATES)
def test_continue_final_message_as_transformers(hf_tokenizer, template_name):
    messages = [{"role": "user", "content": "Say a word."}, {"role": "assistant", "content": "The word is "}]
    template = TEMPLATES[template_name]
    options = dict(add_generation_prompt=False, continue_final_message=True)
    want = hf_tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, **options)
    assert ChatTemplate(template, SPECIALS).render(chat_messages(messages), **options) == want
    assert want.rstrip().endswith("The word is")  # nothing after the message: the model goes on from there


def test_the_prompt_tokens_equal_transformers(hf_tokenizer, tiny_checkpoints):
    """Rendered, then tokenized without special tokens added: transformers' tokenize=True."""
    from deltaserve.cluster.core.tokenizer import Tokenizer

    messages = CHATS["tool-calls"]
    template = qwen3_5_chat_template()
    want = hf_tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True, add_generation_prompt=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    text = ChatTemplate(template, SPECIALS).render(chat_messages(messages))  # a generation prompt by default
    assert Tokenizer(tiny_checkpoints["qwen3_5_moe"][0]).encode(text) == list(want)


def test_where_the_template_comes_from(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "<E>"}, "chat_template": "config:{{ eos_token }}"})
    )
    assert ChatTemplate.for_model(tmp_path).render([{"role": "user", "content": "x"}]) == "config:<E>"
    (tmp_path / "chat_template.jinja").write_text("file:{{ messages | length }}")
    assert ChatTemplate.for_model(tmp_path).render([{"role": "user", "content": "x"}]) == "file:1"
    override = tmp_path / "mine.jinja"
    override.write_text("override:{{ add_generation_prompt }}")
    assert ChatTemplate.for_model(tmp_path, str(override)).render([{"role": "user", "content": "x"}]) == (
        "override:True"
    )
    inline = ChatTemplate.for_model(tmp_path, "inline:{{ messages[0].content }}")
    assert inline.render([{"role": "user", "content": "x"}]) == "inline:x"
    named = tmp_path / "named"
    named.mkdir()
    (named / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "tool_use", "template": "t"}, {"name": "default", "template": "d"}]})
    )
    assert ChatTemplate.for_model(named).render([{"role": "user", "content": "x"}]) == "d"
    assert ChatTemplate.for_model(tmp_path / "nothing-here") is None


def test_bad_templates_and_chats_name_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"^chat_template: no such file"):
        ChatTemplate.for_model(tmp_path, "/no/such/template.jinja")
    with pytest.raises(ValueError, match=r"^chat_template: not a valid jinja template"):
        ChatTemplate("{% for %}")
    refusing = ChatTemplate(EXTRAS, SPECIALS)
    with pytest.raises(ValueError, match=r"^messages: the chat template refused them: a chat cannot end"):
        refusing.render([{"role": "system", "content": "x"}])
    with pytest.raises(ValueError, match=r"^add_generation_prompt: "):
        refusing.render([{"role": "user", "content": "x"}], continue_final_message=True)
    with pytest.raises(ValueError, match=r"^chat_template_kwargs: 'messages' is set by the request"):
        refusing.render([{"role": "user", "content": "x"}], template_kwargs={"messages": []})
    with pytest.raises(ValueError, match=r"^messages: the chat template cannot render them: TypeError"):
        ChatTemplate("{{ messages[0].content + 1 }}").render([{"role": "user", "content": "x"}])
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(Exception, match="unsafe|access"):  # the sandbox refuses, as transformers' does
        sandboxed.render([{"role": "user", "content": "x"}])
    for bad, field in [
        ([], "messages"),
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": "x", "colour": "red"}], "messages[0].colour"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "messages[0].content[0]"),
    ]:
        with pytest.raises(ValueError, match=rf"^{re.escape(field)}: "):
            chat_messages(bad)
    parts = chat_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert parts == [{"role": "user", "content": "a\nb"}]
