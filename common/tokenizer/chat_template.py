"""Chat templates: the model's own Jinja template (tokenizer.chat_template), rendered in a
sandbox with the settings and extras Hugging Face renders them with."""

from __future__ import annotations

import json
from datetime import datetime

import jinja2
import jinja2.meta
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from common.tokenizer.vocab import TokenizerError


class GenerationTag(Extension):
    """Hugging Face's {% generation %} ... {% endgeneration %}: renders its body."""
    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message):
    raise TokenizerError(f"chat template raised: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Hugging Face's tojson: no HTML escaping, non-ASCII kept
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_template(text: str, source: str) -> jinja2.Template:
    # trim_blocks/lstrip_blocks: the settings Hugging Face renders chat templates with
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(text)
    except jinja2.TemplateError as e:
        raise TokenizerError(f"{source}: tokenizer.chat_template does not parse: {e}") from e


def render(template: jinja2.Template, context: dict) -> str:
    try:
        return template.render(**context)
    except TokenizerError:
        raise
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
        raise TokenizerError(f"chat template failed: {type(e).__name__}: {e}") from e


def template_variables(text: str) -> set:
    """The variables a template reads from its context (messages, add_generation_prompt, tools,
    ...): a template that reads `tools` shows the tools to the model itself."""
    env = ImmutableSandboxedEnvironment(extensions=[GenerationTag, loopcontrols])
    try:
        return set(jinja2.meta.find_undeclared_variables(env.parse(text)))
    except jinja2.TemplateError:
        return set()
