"""The engine: host-driven decode loop, prompt cache, request scheduler."""

from runlm.engine.core import Completion, Engine, GenerationRequest, ImageInput, Sequence, StreamRecord, Usage
from runlm.engine.prompt_cache import PromptCache
from runlm.engine.scheduler import QueueFullError, RequestHandle, Scheduler
from runlm.engine.stops import StopStringFilter
from runlm.engine.tools import ToolCall, parse_tool_calls

__all__ = [
    "Completion",
    "Engine",
    "GenerationRequest",
    "ImageInput",
    "PromptCache",
    "QueueFullError",
    "RequestHandle",
    "Scheduler",
    "Sequence",
    "StopStringFilter",
    "StreamRecord",
    "ToolCall",
    "Usage",
    "parse_tool_calls",
]
