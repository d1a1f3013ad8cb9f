"""An Ollama `Modelfile` for an exported GGUF, its chat template in Ollama's template language.

Ollama does not run a model's jinja chat template: its templates are Go's text/template. The
jinja template is not translated statement by statement; it is recognised by what it renders.
Probe conversations are rendered with it and compared with a family's known format; for a family
recognised, a Go template known to render the same is written. Written for ChatML
(`<|im_start|>role\\ncontent<|im_end|>\\n`: SmolLM2, Qwen2.5 and Qwen3 without tools), with the
template's default system prompt where it adds one. Tool definitions and tool calls are not carried
(Ollama's ChatML templates for tools differ by model); any other template is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


class TemplateNotConvertible(ValueError):
    """The model's chat template is not one this module writes in Ollama's language."""


# Contents the probes are rendered with: plain, distinct, no whitespace at either end
_SYSTEM, _USER, _ANSWER, _AGAIN = "Answer briefly.", "What is 2 + 2?", "It is 4.", "And 3 + 3?"
_SYSTEM_HEAD, _END = "<|im_start|>system\n", "<|im_end|>\n"


def _chatml(messages: list[dict[str, str]]) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"


def _render(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@dataclass(frozen=True)
class ChatTemplate:
    family: str
    default_system: str | None  # what the template puts first when a conversation has no system message

    def go_template(self) -> str:
        """The same rendering in Ollama's template language (one ChatML turn per message, then the
        assistant's header; the default system prompt first when no system message leads)."""
        default = ""
        if self.default_system is not None:
            system = self.default_system.replace("{{", '{{ "{{" }}')  # a literal {{ in Go's templates
            default = f'{{{{- if and (eq $i 0) (ne $m.Role "system") }}}}{_SYSTEM_HEAD}{system}{_END}{{{{ end }}}}'
        return ("{{- range $i, $m := .Messages }}" + default
                + "<|im_start|>{{ $m.Role }}\n{{ $m.Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n")


def recognise(tokenizer: Any) -> ChatTemplate:
    """The family of `tokenizer`'s chat template, from what it renders; TemplateNotConvertible if none."""
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateNotConvertible("the model has no chat template")
    with_system = [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": _USER},
                   {"role": "assistant", "content": _ANSWER}, {"role": "user", "content": _AGAIN}]
    without = with_system[1:]
    try:
        rendered, bare = _render(tokenizer, with_system), _render(tokenizer, without)
    except Exception as error:  # noqa: BLE001 - a template that fails on a plain conversation is reported as such
        raise TemplateNotConvertible(f"its chat template fails on a plain conversation ({error!r})") from error
    default = None
    if bare.startswith(_SYSTEM_HEAD) and _END in bare:
        default = bare[len(_SYSTEM_HEAD):bare.index(_END)]
    expected = _chatml(without if default is None else [{"role": "system", "content": default}, *without])
    if rendered != _chatml(with_system) or bare != expected:
        raise TemplateNotConvertible(
            f"its chat template is not ChatML, the format this export writes in Ollama's template language (it "
            f"renders a system, user, assistant, user conversation as {rendered[:300]!r})")
    if default is not None and '"""' in default:
        raise TemplateNotConvertible('its default system prompt holds """, which a Modelfile cannot quote')
    return ChatTemplate("ChatML", default)


def modelfile(gguf: Path, template: ChatTemplate, stop: list[str]) -> str:
    """The Modelfile text for `gguf` (named relative to the Modelfile beside it)."""
    lines = [f"# {template.family}, rewritten from the model's chat template (tool calls are not templated)",
             f"FROM ./{gguf.name}", f'TEMPLATE """{template.go_template()}"""']
    lines += [f'PARAMETER stop "{token}"' for token in stop]
    return "\n".join(lines) + "\n"
