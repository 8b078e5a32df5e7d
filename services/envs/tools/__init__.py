"""Toolsets the env service serves to tool-calling agents. Add one with a module that subclasses
`Toolset`, decorates it with `@TOOLSETS.register("<type>")`, and a `register_lazy` line here."""

from services.envs.tools.base import TOOLSETS, ToolContext, ToolError, ToolOptions, ToolOutput, Toolset, ToolSpec

TOOLSETS.register_lazy("calculator", "services.envs.tools.calculator")
TOOLSETS.register_lazy("python", "services.envs.tools.python")
TOOLSETS.register_lazy("search", "services.envs.tools.search")
TOOLSETS.register_lazy("editor", "services.envs.tools.editor")
TOOLSETS.register_lazy("mcp", "services.envs.tools.mcp")

__all__ = ["TOOLSETS", "ToolContext", "ToolError", "ToolOptions", "ToolOutput", "ToolSpec", "Toolset"]
