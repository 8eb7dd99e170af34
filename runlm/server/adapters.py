"""What the adapters for other APIs (Anthropic, Ollama) share: they translate a request into the OpenAI
request it means and plan that, so a translation must validate exactly as the OpenAI route would."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from runlm.server.errors import APIError

Body = TypeVar("Body", bound=BaseModel)


def openai_request(model: type[Body], data: dict[str, Any]) -> Body:
    """`data` (None values dropped) validated as an OpenAI request body; a failure is a 400 naming the field."""
    try:
        return model.model_validate({k: v for k, v in data.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise APIError(400, f"{where}: {first.get('msg', 'invalid value')}", param=where or None) from None
