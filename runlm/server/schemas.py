"""OpenAI request bodies as strict pydantic models: a wrong type is a 400, never a silent coercion.

Unknown fields are ignored (clients send vendor extras); llama.cpp's sampling extensions (top_k,
min_p, typical_p, repeat_penalty, repeat_last_n, ignore_eos, cache_prompt) are accepted too.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1
MAX_CHOICES = 16  # `n`: the choices of one request decode side by side, each holding a session

Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
Unit = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
Seed = Annotated[int, Field(ge=INT64_MIN, le=UINT64_MAX)]
StopString = Annotated[str, Field(max_length=1000)]  # held-back text is matched against every prefix


def _valid_unicode(value: Any) -> Any:
    """JSON may carry lone UTF-16 surrogates ("\\ud800"); no tokenizer can encode them, so they are bad input."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("text contains an invalid Unicode code point (a lone UTF-16 surrogate)") from None
    elif isinstance(value, list | tuple):
        for item in value:
            _valid_unicode(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _valid_unicode(key)
            _valid_unicode(item)
    return value


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _check_unicode(cls, value: Any) -> Any:
        return _valid_unicode(value)


class ImageURL(Strict):
    url: str
    detail: str | None = None


class ContentPart(Strict):
    type: str
    text: str | None = None
    image_url: ImageURL | None = None


class FunctionCall(Strict):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class FunctionDef(Strict):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: str


class ToolChoiceFunction(Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaSpec(Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # llama.cpp's shorthand


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(Strict):
    """What chat and text completions share."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Temperature | None = None
    top_p: Unit | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=16)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Bias] | None = None
    seed: Seed | None = None
    user: str | None = None
    # llama.cpp extensions
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Unit | None = None
    typical_p: Unit | None = None
    repeat_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    repeat_last_n: Annotated[int, Field(ge=-1)] | None = None
    ignore_eos: bool = False
    cache_prompt: bool = True
    # llama-server's: the most tokens speculation drafts a step for this request (0: none)
    speculative_n_max: Annotated[int, Field(ge=0, le=64)] | None = Field(default=None, alias="speculative.n_max")


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # Extra variables for the chat template, as vLLM and llama-server take them (Qwen3's enable_thinking...).
    chat_template_kwargs: dict[str, Any] | None = None
    # "none" turns a template's thinking off (enable_thinking false); the others on; the template sees it too
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    reasoning_format: Literal["auto", "none", "think", "deepseek"] | None = None  # the server's --reasoning-format
    reasoning_budget: Annotated[int, Field(ge=-1)] | None = None  # the server's --reasoning-budget


class CompletionRequest(SamplingFields):
    prompt: (str | Annotated[list[str], Field(min_length=1, max_length=1)]
             | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
             | Annotated[list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]],
                         Field(min_length=1, max_length=1)])
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    response_format: ResponseFormat | None = None


MAX_TOKENIZE_CHARS = 1_000_000  # ~250k tokens: more than any context, and its pieces list stays a few MB


class TokenizeRequest(Strict):
    content: Annotated[str, Field(max_length=MAX_TOKENIZE_CHARS)]
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(Strict):
    tokens: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_TOKENIZE_CHARS)]


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on inputs per request


class EmbeddingRequest(Strict):
    model: str
    input: (Annotated[str, Field(min_length=1)]
            | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
            | TokenIds
            | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)])
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None


MAX_INFILL_EXTRA = 256  # input_extra chunks of one /infill request


class InfillExtra(Strict):
    """A chunk of context from another file (llama-server's input_extra item)."""

    filename: Annotated[str, Field(max_length=1000)] = "tmp"
    text: str = ""


class InfillRequest(SamplingFields):
    """llama-server's /infill: the code before and after the cursor, and its /completion sampling fields."""

    model: str | None = None  # llama-server's requests name no model
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: Annotated[list[InfillExtra], Field(max_length=MAX_INFILL_EXTRA)] | None = None
    prompt: str = ""
    n_predict: Annotated[int, Field(ge=-1)] | None = None  # -1: no limit but the context (and --max-tokens)
    return_tokens: bool = False


MAX_RERANK_DOCUMENTS = 1000  # documents of one rerank request (Cohere's own limit)


class RerankDocument(Strict):
    text: Annotated[str, Field(min_length=1)]


class RerankRequest(Strict):
    """Jina's and Cohere's rerank body (llama-server's too); `instruction` is Qwen3-Reranker's <Instruct>."""

    model: str | None = None
    query: Annotated[str, Field(min_length=1)]
    documents: Annotated[list[Annotated[str, Field(min_length=1)] | RerankDocument],
                         Field(min_length=1, max_length=MAX_RERANK_DOCUMENTS)]
    top_n: Annotated[int, Field(ge=1)] | None = None
    return_documents: bool = False
    instruction: Annotated[str, Field(min_length=1, max_length=10_000)] | None = None
