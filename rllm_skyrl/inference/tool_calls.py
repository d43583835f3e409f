"""Tool calls in generated text, read by the Hermes convention (``<tool_call>{json}</tool_call>``).

Qwen-family chat templates (and the tiny test model's) render an assistant's calls that way, so the
model writes them that way too. The chat endpoint returns them as OpenAI ``tool_calls``, and the
rollout engine as rLLM's ``ToolCall``s, both from ``find_calls``, so the two never read the same
text differently. A call whose JSON is malformed or lacks a name is left out (and stays in the text).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from rllm_skyrl.inference.errors import ApiError

HERMES_OPEN = "<tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class FoundCall:
    name: str
    arguments: dict[str, Any]
    span: tuple[int, int]  # where the whole <tool_call>...</tool_call> block sits in the text


def find_calls(text: str) -> list[FoundCall]:
    calls = []
    for match in _HERMES_CALL.finditer(text):
        try:
            payload = json.loads(match.group(1))
            arguments = payload.get("arguments", {})
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            calls.append(FoundCall(str(payload["name"]), dict(arguments), match.span()))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            continue
    return calls


def template_convention(chat_template: Any) -> str | None:
    """``"hermes"`` when the model's chat template renders calls as ``<tool_call>``, else None."""
    return "hermes" if isinstance(chat_template, str) and HERMES_OPEN in chat_template else None


def wants_calls(body: dict[str, Any], convention: str | None) -> bool:
    """Whether a chat request's reply should be read for tool calls; refuses what cannot be served.

    ``tool_choice`` "auto" (the default with tools) and "none" are served; "required" or a named
    function would need constrained decoding, which this server does not do.
    """
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools or choice == "none":
        return False
    if choice not in (None, "auto"):
        raise ApiError(
            400,
            f"tool_choice={json.dumps(choice)} needs constrained decoding, which the CPU inference server "
            "does not do; send tool_choice 'auto' or 'none'",
        )
    if convention is None:
        raise ApiError(
            400,
            "the model's chat template has no tool-call convention this server reads (<tool_call>...); "
            "send the request without tools, or serve a model whose template renders tool calls",
        )
    return True


def openai_message(text: str) -> dict[str, Any]:
    """An assistant message with the text's calls as OpenAI ``tool_calls`` (arguments as JSON text)
    and the rest of the text as ``content`` (None when nothing else was said)."""
    calls = find_calls(text)
    if not calls:
        return {"role": "assistant", "content": text, "tool_calls": []}
    kept, start = [], 0
    for call in calls:
        kept.append(text[start : call.span[0]])
        start = call.span[1]
    content = "".join([*kept, text[start:]]).strip()
    return {
        "role": "assistant",
        "content": content or None,
        "tool_calls": [
            {
                "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)},
            }
            for call in calls
        ],
    }
