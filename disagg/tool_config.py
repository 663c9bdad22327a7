"""Tool calling's server flags, as vLLM spells them: `--enable-auto-tool-choice`, `--tool-call-parser`,
`--exclude-tools-when-tool-choice-none`. Pure; composed into ServerConfig."""

from __future__ import annotations

from dataclasses import dataclass, field

TOOL_CALL_PARSERS = ("hermes",)


@dataclass(frozen=True)
class ToolConfig:
    enable_auto_tool_choice: bool = field(
        default=False, metadata={"help": "let the model choose tool calls (tool_choice 'auto'); needs --tool-call-parser",
                                 "negatable": False})
    tool_call_parser: str | None = field(
        default=None, metadata={"help": "how tool calls are read from the model's text: hermes "
                                        "(<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>)",
                                "choices": TOOL_CALL_PARSERS})
    exclude_tools_when_tool_choice_none: bool = field(
        default=False, metadata={"help": "with tool_choice 'none', leave the tools out of the chat template",
                                 "negatable": False})

    def problem(self) -> str | None:
        """Why these flags cannot work together (ServerConfig raises it as a ConfigError), or None."""
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            return f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {self.tool_call_parser!r}"
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            return "--enable-auto-tool-choice requires --tool-call-parser"
        return None
