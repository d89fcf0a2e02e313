"""OpenAI's structured outputs and tool calls, below the server: a request's `response_format`,
`tools`, `tool_choice` and `parallel_tool_calls` become one grammar (common/constrain/), the
tools and the calls so far go into the prompt, and the generated text comes back as
`message.tool_calls`, whole or as stream deltas.

    form.py      ToolForm: how a call is written. The model's chat template decides: one that
                 reads `tools` shows them itself (its calls in <tool_call> tags when it writes
                 those); else the generic form, the tools listed in a system message and a call
                 the JSON object {"name": ..., "arguments": {...}}, several one per line
    request.py   structured(data, ll, form) -> Structured: the request's fields checked
                 (StructuredError names the field, as a 400 would) and compiled into one grammar
    prompt.py    render_prompt(tokenizer, messages, ...): OpenAI's messages (assistant turns
                 with tool_calls, `tool` results) through the template or the generic form
    calls.py     ToolCallStream: generated text in, OpenAI's deltas out (index, id and name
                 first, the arguments in pieces); parse_reply: the whole text at once

The grammar, by tool_choice (calls in the form above; `answer` is text that does not begin like a
call, or the response_format's JSON when there is one):

    none       the response_format's grammar; else, where the request has tools, start: answer
               (text that does not begin like a call: a small model copies the calls in its
               history as text, and `none` promises a message); else none at all
    auto       start: answer | calls          the model chooses, and either way is constrained
    required   start: calls
    {"type": "function", "function": {"name": F}}    start: one call of F
    calls      call ("\\n" call)*  (parallel_tool_calls, the default)  or  call
    call       {"name": one of the tools, "arguments": that tool's `parameters`}

A server uses it so (ll: common.constrain.ll_tokenizer(engine.tokenizer, n_vocab), built once):

    request = structured(body, ll, tool_form(tokenizer), chat)   # StructuredError: 400, e.param
    prompt  = render_prompt(tokenizer, body["messages"], request)   # chat; parse_special=True
    sampler = Sampler(params, constraint=Constraint(request.grammar, ll))   # if request.grammar
              (n > 1: each other choice's constraint a fork() of the first's; a preempted
              request keeps its sampler, so its constraint keeps its place)
    before each step: fill_masks(the running rows' constraints)   # optional: all masks at once
    the reply's text: its tokens' pieces as they are (a StreamDecoder's text, not decode()'s)
    content, tool_calls = request.parse(text)    # finish_reason "tool_calls" when there are calls
    streaming: calls = request.stream(); calls.push(piece) -> deltas; calls.finish() at the end
"""

from app.structured.calls import ToolCallStream, parse_reply
from app.structured.form import GENERIC, TAGGED, ToolForm, tool_form
from app.structured.prompt import render_prompt
from app.structured.request import Structured, StructuredError, structured

__all__ = ["GENERIC", "TAGGED", "Structured", "StructuredError", "ToolCallStream", "ToolForm", "parse_reply",
           "render_prompt", "structured", "tool_form"]
