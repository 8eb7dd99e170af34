"""Chat templates: same text as transformers' apply_chat_template, Gemma's format, sandboxing."""

from __future__ import annotations

import json

import pytest
from reference.hf_gguf import hf_tokenizer

from runlm.errors import TokenizerError
from runlm.formats.gguf import GGUFFile
from runlm.text import BUILTIN_TEMPLATES, ChatTemplate, chat

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
    [
        {"role": "user", "content": "Bonjour, ça va ? 日本語 😀"},
        {"role": "assistant", "content": "Oui !\n\n  Indented\tline"},
        {"role": "user", "content": "<|im_start|> in text"},
    ],
]


@pytest.fixture(scope="module")
def smollm_metadata(smollm2_gguf) -> dict:
    return GGUFFile(smollm2_gguf).metadata


@pytest.fixture(scope="module")
def smollm_reference(smollm2_gguf):
    pytest.importorskip("transformers")
    return hf_tokenizer(smollm2_gguf)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gguf_template_matches_transformers(smollm_metadata, smollm_reference, messages, add_generation_prompt):
    template = ChatTemplate.from_gguf(smollm_metadata)
    assert template is not None
    expected = smollm_reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert template.render(messages, add_generation_prompt=add_generation_prompt) == expected


def test_hf_dir_template_matches_transformers(smollm_reference, tmp_path):
    smollm_reference.save_pretrained(tmp_path)
    template = ChatTemplate.from_hf_dir(tmp_path)
    assert template is not None
    assert template.bos_token == smollm_reference.bos_token
    for messages in CONVERSATIONS:
        expected = smollm_reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert template.render(messages) == expected


def test_hf_dir_config_forms(tmp_path):
    source = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": source, "bos_token": {"content": "<s>"}, "eos_token": "</s>"})
    )
    template = ChatTemplate.from_hf_dir(tmp_path)
    assert template.render([{"role": "user", "content": "x"}]) == "<s>[user]x"

    named = [{"name": "default", "template": "D{{ messages | length }}"}, {"name": "tool_use", "template": "T"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert ChatTemplate.from_hf_dir(tmp_path).render([{"role": "user", "content": "x"}]) == "D1"
    assert ChatTemplate.from_hf_dir(tmp_path, name="tool_use").render([]) == "T"

    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert ChatTemplate.from_hf_dir(tmp_path) is None
    (tmp_path / "chat_template.jinja").write_text("J")
    assert ChatTemplate.from_hf_dir(tmp_path).render([]) == "J"


def test_from_gguf_without_template_is_none():
    assert ChatTemplate.from_gguf({"tokenizer.ggml.tokens": ["<bos>"], "tokenizer.ggml.bos_token_id": 0}) is None


def test_gguf_template_gets_bos_and_eos(smollm_metadata):
    template = ChatTemplate.from_gguf(smollm_metadata)
    assert (template.bos_token, template.eos_token) == ("<|im_start|>", "<|im_end|>")


def test_gemma_builtin_format():
    template = ChatTemplate.builtin("gemma", bos_token="<bos>", eos_token="<eos>")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi "},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": [{"type": "text", "text": "How are you?"}]},
    ]
    assert template.render(messages) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nHow are you?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    assert template.render(messages[1:2], add_generation_prompt=False) == "<bos><start_of_turn>user\nHi<end_of_turn>\n"
    # A system prompt with no user turn still reaches the model, as a user turn.
    expected = "<bos><start_of_turn>user\nBe brief.<end_of_turn>\n<start_of_turn>model\n"
    assert template.render(messages[:1]) == expected
    assert "gemma" in BUILTIN_TEMPLATES


def test_gemma_builtin_rejects_unknown_roles():
    template = ChatTemplate.builtin("gemma", bos_token="<bos>")
    with pytest.raises(TokenizerError, match="tool"):
        template.render([{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}])


def test_unknown_builtin():
    with pytest.raises(TokenizerError):
        ChatTemplate.builtin("nope")


def test_raise_exception_is_tokenizer_error():
    template = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok")
    assert template.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(TokenizerError, match="user first"):
        template.render([{"role": "assistant", "content": "x"}])


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{{ raise_exception.__globals__ }}",
        "{{ messages.append(1) }}",
        "{% set ns = namespace(__init__=1) %}",
    ],
)
def test_sandbox_blocks_escapes(source):
    with pytest.raises(TokenizerError):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("source", ["{% if %}", "{% for m in messages %}", "{{ messages[ }}", ""])
def test_malformed_template(source):
    with pytest.raises(TokenizerError):
        ChatTemplate(source)


def test_runtime_errors_become_tokenizer_errors():
    with pytest.raises(TokenizerError):
        ChatTemplate("{{ 'a' + 1 }}").render([])
    with pytest.raises(TokenizerError):
        ChatTemplate("x").render([{"content": "no role"}])


def test_helpers_tojson_tools_extra_and_generation_tag():
    source = (
        "{{ tools | tojson }}|{{ {'k': 'é<>'} | tojson(indent=2) }}|{{ enable_thinking }}|"
        "{% generation %}{{ messages[-1]['content'] }}{% endgeneration %}|{{ strftime_now('%Y') | length }}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}"
    )
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    out = ChatTemplate(source).render([{"role": "user", "content": "c"}], tools=tools, enable_thinking=False)
    assert out == json.dumps(tools, ensure_ascii=False) + '|{\n  "k": "é<>"\n}|False|c|4'


def test_render_does_not_mutate_messages():
    messages = [{"role": "user", "content": "x"}]
    ChatTemplate("{% set m = messages[0] %}{{ m.content }}").render(messages)
    assert messages == [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("source, message", [
    ("{{ 'x' * 10**9 }}", "past the output bound"),
    ("{{ 2 ** 100000000 }}", "to the power"),
    ("{% for a in range(100000) %}{% for b in range(1000) %}{{ 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx' }}"
     "{% endfor %}{% endfor %}", "output passed"),
])
def test_templates_are_bounded_in_output(source, message):
    with pytest.raises(TokenizerError, match=message):
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("source", [
    "{% set r = range(100000) %}{% for a in r %}{% for b in r %}{% endfor %}{% endfor %}",
    "{% set r = range(100000) %}{% for a in r %}{% for b in r if b < 0 %}{% endfor %}{% endfor %}",
    "{% for m in messages %}{% set r = range(100000) %}{% for a in r %}{% for b in r %}{% if b < 0 %}"
    "{% endif %}{% endfor %}{% endfor %}{% endfor %}",
])
def test_loops_that_touch_nothing_meet_the_deadline(source, monkeypatch):
    monkeypatch.setattr(chat, "MAX_RENDER_S", 0.2)  # the 2 s bound, shortened so the test is quick
    with pytest.raises(TokenizerError, match="ran longer than"):
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])


def test_counted_loops_keep_loop_semantics_and_recursion_is_plain():
    source = ("{% for m in messages %}{{ loop.index }}/{{ loop.length }}{% if loop.last %}L{% endif %}{% endfor %}"
              "{% for k, v in {'a': 1}.items() %}{{ k }}{{ v }}{% endfor %}"
              "{% for x in nothing %}y{% else %}E{% endfor %}")
    assert ChatTemplate(source).render([{"role": "user"}] * 3) == "1/32/33/3La1E"
    with pytest.raises(TokenizerError, match="recursed too deeply") as caught:
        ChatTemplate("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}").render([])
    assert "RecursionError" not in str(caught.value)


@pytest.mark.parametrize("source", ["{{ messages[0]['content'] + '!' }}", "{{ messages[0]['content'] | int + 1 }}x"
                                    "{{ messages[5]['role'] }}{{ messages[0]['missing']['deeper'] }}"])
def test_template_failures_are_told_without_python_internals(source):
    with pytest.raises(TokenizerError, match="chat template failed") as caught:
        ChatTemplate(source).render([{"role": "user", "content": [{"type": "text", "text": "x"}]}])
    assert "concatenate" not in str(caught.value) and "Error" not in str(caught.value)
