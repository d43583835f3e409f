"""OpenAI tool calls from the CPU inference server: a model taught to call a calculator calls it
through ``/v1/chat/completions``, and the call and its result go back into the next turn."""

from __future__ import annotations

import asyncio
import json

import pytest
from helpers import taught_model
from openai import AsyncOpenAI, BadRequestError

from rllm_skyrl.inference import InferenceServer
from rllm_skyrl.inference.errors import ApiError
from rllm_skyrl.inference.tool_calls import find_calls, openai_message, wants_calls

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
QUESTION = [{"role": "user", "content": "what is 2 plus 3?"}]
CALL = '<tool_call>{"name": "calculate", "arguments": {"expression": "2+3"}}</tool_call>'


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    model = taught_model(tiny_model_dir, [(QUESTION, TOOLS, f"Let me check.{CALL}")])
    with InferenceServer(str(model)) as srv:
        yield srv


def chat(server: InferenceServer, **request):
    async def main():
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0)
        try:
            return await client.chat.completions.create(
                model="default", temperature=0, max_tokens=96, **request
            )
        finally:
            await client.close()

    return asyncio.run(main())


def test_a_reply_that_calls_a_tool_comes_back_as_openai_tool_calls(server):
    response = chat(server, messages=QUESTION, tools=TOOLS)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "calculate"
    assert json.loads(call.function.arguments) == {"expression": "2+3"}


def test_without_tools_or_with_tool_choice_none_the_text_is_the_content(server):
    plain = chat(server, messages=QUESTION, tools=TOOLS, tool_choice="none").choices[0]
    assert plain.message.tool_calls in (None, []) and CALL in plain.message.content
    assert plain.finish_reason == "stop"


def test_the_call_and_its_result_render_into_the_next_turn(server):
    first = chat(server, messages=QUESTION, tools=TOOLS).choices[0].message
    call = first.tool_calls[0]
    history = [
        *QUESTION,
        first.model_dump(exclude_none=True),  # as agents send it back: arguments as JSON text
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    response = chat(server, messages=history, tools=TOOLS, extra_body={"return_token_ids": True})
    prompt = response.model_extra["prompt_token_ids"]
    rendered = server.service.tokenizer.decode(prompt)
    turns = (
        f"assistant\nLet me check.{CALL}<|im_end|>\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    )
    assert rendered.endswith(turns)


def test_tool_choice_the_server_cannot_honour_is_refused_by_name(server):
    with pytest.raises(BadRequestError, match='tool_choice="required" needs constrained decoding'):
        chat(server, messages=QUESTION, tools=TOOLS, tool_choice="required")


def test_a_template_without_a_tool_convention_refuses_tools():
    with pytest.raises(ApiError, match="no tool-call convention"):
        wants_calls({"tools": TOOLS}, None)
    assert wants_calls({"tools": TOOLS, "tool_choice": "none"}, None) is False
    assert wants_calls({}, None) is False


def test_parsing_keeps_the_text_around_calls_and_skips_malformed_ones():
    text = f'before {CALL} middle <tool_call>{{"name": broken}}</tool_call>{CALL.replace("2+3", "7*6")} after'
    assert [(c.name, c.arguments) for c in find_calls(text)] == [
        ("calculate", {"expression": "2+3"}),
        ("calculate", {"expression": "7*6"}),
    ]
    message = openai_message(text)
    assert message["content"] == 'before  middle <tool_call>{"name": broken}</tool_call> after'
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [
        {"expression": "2+3"},
        {"expression": "7*6"},
    ]
    assert openai_message(CALL)["content"] is None
    assert openai_message("no calls") == {"role": "assistant", "content": "no calls", "tool_calls": []}
