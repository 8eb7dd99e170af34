"""chat_template_kwargs reach the chat template (Qwen3's thinking switch is one such variable)."""

from __future__ import annotations

import json

import httpx
import pytest
from reference.tiny import build_qwen3
from server_harness import LiveServer

from runlm import load
from runlm.server import create_app

THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3-thinking")
    build_qwen3(directory)
    config_path = directory / "hf" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = THINKING_TEMPLATE
    config_path.write_text(json.dumps(config))
    live = LiveServer(create_app(load(directory / "hf"), model_name="tiny-qwen3", api_key=""))
    yield live
    live.stop()


def ask(server, **extra):
    body = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **extra}
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)


def test_enable_thinking_false_adds_the_empty_think_block(server):
    default = ask(server).json()["usage"]["prompt_tokens"]
    off = ask(server, chat_template_kwargs={"enable_thinking": False}).json()["usage"]["prompt_tokens"]
    assert off > default


def test_reserved_names_are_refused(server):
    response = ask(server, chat_template_kwargs={"messages": []})
    assert response.status_code == 400 and "chat_template_kwargs" in response.json()["error"]["message"]
