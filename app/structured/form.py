"""How a model writes a tool call, and whether its chat template shows the tools itself.

A call is always `open` + {"name": ..., "arguments": {...}} + `close`, several separated by a
newline. What differs is the wrapping and who lists the tools:

    GENERIC   no wrapping; the tools are listed in a system message (prompt.py). SmolLM2's and
              TinyLlama's templates know no tools (they read only messages, add_generation_prompt
              and eos_token), so this is the form both get.
    TAGGED    <tool_call>\\n{...}\\n</tool_call>: the Hermes format that Qwen2.5's and other
              templates teach, taken when the template reads `tools` and writes those tags.
    a template that reads `tools` without those tags shows the tools itself, and its calls
    are written in the generic form.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.tokenizer.chat_template import template_variables


@dataclass(frozen=True)
class ToolForm:
    name: str
    open: str = ""                  # written before a call's JSON object
    close: str = ""                 # and after it
    template_shows_tools: bool = False
    separator: str = "\n"           # between two calls

    @property
    def first(self) -> str:
        """What a call begins with: the text of a reply must not."""
        return self.open or "{"


GENERIC = ToolForm("generic")
TAGGED = ToolForm("tagged", "<tool_call>\n", "\n</tool_call>", True)


def tool_form(tokenizer) -> ToolForm:
    """The form for a model, read from its chat template (the module docstring)."""
    template = tokenizer.chat_template or ""
    if "tools" not in template_variables(template):
        return GENERIC
    if "<tool_call>" in template:
        return TAGGED
    return ToolForm("generic, tools shown by the template", template_shows_tools=True)
