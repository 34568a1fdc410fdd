"""Tool-call parsers: model output -> OpenAI tool calls (vLLM: vllm/tool_parsers/)."""
from kiln.server.tool_parsers.tool_parser import TOOL_PARSERS, ParsedTools, ToolCallText, ToolParser, get_tool_parser
from kiln.server.tool_parsers import hermes, qwen3_coder  # noqa: F401  (register themselves)

__all__ = ["TOOL_PARSERS", "ParsedTools", "ToolCallText", "ToolParser", "get_tool_parser"]
