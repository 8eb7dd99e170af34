"""The engine: host-driven decode loop, prompt cache, request scheduler."""

from runlm.engine.core import Completion, Engine, Generation, GenerationRequest, StreamRecord, Usage
from runlm.engine.prompt_cache import PromptCache
from runlm.engine.scheduler import QueueFullError, RequestGroup, RequestHandle, Scheduler
from runlm.engine.stops import StopStringFilter
from runlm.engine.tools import ToolCall, parse_tool_calls
from runlm.runner import ImageInput

__all__ = [
    "Completion",
    "Engine",
    "Generation",
    "GenerationRequest",
    "ImageInput",
    "PromptCache",
    "QueueFullError",
    "RequestGroup",
    "RequestHandle",
    "Scheduler",
    "StopStringFilter",
    "StreamRecord",
    "ToolCall",
    "Usage",
    "parse_tool_calls",
]
