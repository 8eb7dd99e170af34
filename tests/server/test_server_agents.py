"""Agent frameworks against a live server: OpenAI's Agents SDK runs a tool loop (call, result, answer) over chat
completions and over the Responses API, and langchain-openai binds tools, plainly and streamed. A scripted model
(real SmolLM2 tokenizer) writes its calls in Hermes `<tool_call>` JSON under a Qwen-style template, or in harmony
under a gpt-oss-style one."""

from __future__ import annotations

import asyncio

import pytest
from server_harness import scripted_server
from test_server_harmony import HARMONY

from runlm.text.chat import ChatTemplate

QWEN_STYLE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{{ tools | tojson }}\nCall as <tool_call>{...}</tool_call><|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n{{ {'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{{ '<|im_start|>assistant\\n' }}"
)
ANSWER = "It is sunny in Paris."
CALLS = {
    "qwen": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "harmony": '<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant to=functions.get_weather'
               '<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris"}',
}
FINALS = {"qwen": ANSWER, "harmony": f"<|channel|>final<|message|>{ANSWER}"}


def script(style: str):
    """Calls get_weather until the conversation holds its result, then answers."""
    def reply(text: str, n: int) -> str:
        answered = "Sunny" in text
        whole = FINALS[style] if answered else CALLS[style]
        opening = "<|im_start|>assistant\n" if style == "qwen" else "<|start|>assistant"
        done = text.rsplit(opening, 1)[1] if not answered or style == "qwen" else ""
        return whole[len(done):] if done and whole.startswith(done) else whole
    return reply


@pytest.fixture(scope="module", params=["qwen", "harmony"])
def agent_server(request, smollm2_loaded):
    template = QWEN_STYLE if request.param == "qwen" else HARMONY
    live = scripted_server(smollm2_loaded, script(request.param), name="agent", api_key="",
                           chat_template=ChatTemplate(template))
    yield live
    live.stop()


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_the_agents_sdk_runs_a_tool_loop(agent_server, api):
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"Sunny in {city}"

    client = AsyncOpenAI(base_url=agent_server.base_url + "/v1", api_key="unused", max_retries=0)
    model = (OpenAIChatCompletionsModel(model="agent", openai_client=client) if api == "chat_completions"
             else OpenAIResponsesModel(model="agent", openai_client=client))
    agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather], model=model)

    async def both() -> tuple[str, str, list[str]]:  # one event loop: the client's connections live in it
        plain = await Runner.run(agent, "Weather in Paris?")
        run = Runner.run_streamed(agent, "Weather in Paris?")
        kinds = [event.item.type async for event in run.stream_events() if event.type == "run_item_stream_event"]
        return plain.final_output, run.final_output, kinds

    plain, streamed, kinds = asyncio.run(both())
    assert (plain, streamed) == (ANSWER, ANSWER) and asked == ["Paris", "Paris"]
    assert kinds.index("tool_call_item") < kinds.index("tool_call_output_item") < kinds.index("message_output_item")


def test_langchain_binds_tools_plainly_and_streamed(agent_server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"Sunny in {city}"

    llm = ChatOpenAI(base_url=agent_server.base_url + "/v1", api_key="unused", model="agent", max_retries=0)
    bound = llm.bind_tools([get_weather])
    message = bound.invoke("Weather in Paris?")
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [("get_weather", {"city": "Paris"})]
    chunks = list(bound.stream("Weather in Paris?"))
    gathered = chunks[0]
    for chunk in chunks[1:]:
        gathered = gathered + chunk
    assert [(c["name"], c["args"]) for c in gathered.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert len([c for c in chunks if c.tool_call_chunks]) > 2  # the arguments came in pieces
    result = get_weather.invoke(message.tool_calls[0])
    answer = bound.invoke(["Weather in Paris?", message, result])
    assert answer.content == ANSWER and not answer.tool_calls
