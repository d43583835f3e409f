"""``echo`` on ``/v1/completions``: prompt logprobs as vLLM reports them, checked token by token against
a plain HF forward of the same model, and read through rLLM's own ``OpenAIEngine.compute_logprobs``
(the call a distillation teacher answers)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from rllm_skyrl.inference import InferenceServer

TOKEN = "echo-test-token-0123456789abcdefghij"
# Server and HF run the same fp32 forward; only the left padding of a batched prefill differs.
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with InferenceServer(tiny_model_dir, token=TOKEN) as srv:
        yield srv
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def api(server):
    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60
    ) as client:
        yield client


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from helpers import hf_model

    return hf_model(tiny_model_dir)


@pytest.fixture(scope="module")
def chats(tiny_tokenizer) -> list[list[int]]:
    """Prompts of different lengths, so one prefill left-pads them."""
    out = []
    for question in ("what is 3?", "what is 7 plus 2? think step by step", "yes"):
        text = tiny_tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        out.append(tiny_tokenizer.encode(text, add_special_tokens=False) + tiny_tokenizer.encode("7"))
    return out


def reference(hf, ids: list[int]) -> torch.Tensor:
    """log_softmax of each token after the first, from an unpadded forward of ``ids`` alone."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def complete(api, **body) -> dict:
    response = api.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_token_prompts_echo_their_logprobs_as_a_forward_pass(api, hf, chats, tiny_tokenizer):
    out = complete(api, prompt=chats, echo=True, logprobs=1, max_tokens=1, temperature=1.0)
    assert out["usage"]["prompt_tokens"] == sum(len(ids) for ids in chats)
    for ids, choice in zip(chats, out["choices"], strict=True):
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(ids) + 1  # the prompt, then the one generated token
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        expected = reference(hf, ids).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
        echoed = torch.tensor(logprobs["token_logprobs"][1 : len(ids)])
        assert (echoed - expected).abs().max().item() <= TOLERANCE
        assert logprobs["tokens"][: len(ids)] == [tiny_tokenizer.decode([t]) for t in ids]
        assert choice["text"].startswith(tiny_tokenizer.decode(ids))
        assert logprobs["text_offset"][len(ids)] == len(tiny_tokenizer.decode(ids))


def test_top_logprobs_of_prompt_tokens_are_the_forward_pass_best(api, hf, chats, tiny_tokenizer):
    ids = chats[1]
    out = complete(api, prompt=ids, echo=True, logprobs=3, max_tokens=0)
    tops = out["choices"][0]["logprobs"]["top_logprobs"]
    assert len(tops) == len(ids) and tops[0] is None
    values, indices = reference(hf, ids).topk(3, dim=-1)
    for top, best_ids, best in zip(tops[1:], indices.tolist(), values.tolist(), strict=True):
        expected = {tiny_tokenizer.decode([t]): v for t, v in zip(best_ids, best, strict=True)}  # vLLM's keys
        assert list(top) == list(expected)
        assert max(abs(top[k] - v) for k, v in expected.items()) <= TOLERANCE


def test_a_text_prompt_with_max_tokens_zero_echoes_only_the_prompt(api, hf, tiny_tokenizer):
    text = "what is 4? the answer is 4"
    ids = tiny_tokenizer.encode(text)
    out = complete(api, prompt=text, echo=True, logprobs=0, max_tokens=0)
    choice = out["choices"][0]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    logprobs = choice["logprobs"]
    assert logprobs["top_logprobs"] is None  # logprobs=0: the tokens' own, no alternatives
    assert logprobs["token_logprobs"][0] is None and len(logprobs["token_logprobs"]) == len(ids)
    expected = reference(hf, ids).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    assert (torch.tensor(logprobs["token_logprobs"][1:]) - expected).abs().max().item() <= TOLERANCE


def test_echo_without_logprobs_prefixes_the_text_and_n_samples_share_the_prompt(api, chats, tiny_tokenizer):
    ids = chats[0]
    out = complete(api, prompt=ids, echo=True, max_tokens=2, n=3, seed=5, return_token_ids=True)
    prompt_text = tiny_tokenizer.decode(ids)
    for choice in out["choices"]:
        assert choice["logprobs"] is None
        generated = tiny_tokenizer.decode(choice["token_ids"])
        assert choice["text"] == prompt_text + generated and len(choice["token_ids"]) >= 1


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),  # nothing to return without echo
        ({"prompt": "hi", "echo": True, "max_tokens": -1}, "max_tokens"),
        ({"prompt": "hi", "echo": "yes"}, "echo must be true or false"),
        ({"prompt": "hi", "suffix": "!"}, "suffix is not supported"),
    ],
)
def test_bad_echo_requests_are_refused_by_name(api, body, message):
    response = api.post("/v1/completions", json=body)
    assert response.status_code == 400 and message in response.json()["error"]["message"]


def test_rllm_openai_engine_reads_the_teacher_logprobs(server, hf, chats, tiny_tokenizer):
    """rLLM's teacher call for distillation, with the server's token as its API key."""
    openai_engine = pytest.importorskip("rllm.engine.rollout.openai_engine")
    engine = openai_engine.OpenAIEngine(
        model=server.served_model_name,
        tokenizer=tiny_tokenizer,
        base_url=f"{server.url}/v1",
        api_key=TOKEN,
        max_prompt_length=128,
        max_response_length=8,
    )
    for ids in chats:
        logprobs = asyncio.run(engine.compute_logprobs(ids))
        assert len(logprobs) == len(ids) and logprobs[0] is None
        expected = reference(hf, ids).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
        assert (torch.tensor(logprobs[1:]) - expected).abs().max().item() <= TOLERANCE
