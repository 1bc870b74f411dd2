"""The official `openai` client against `pdserve serve` on the default model."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
PROMPT = "The three primary colors are"


def model_name(server) -> str:
    return server.client().models.list().data[0].id


def stream_text(chunks, *, chat: bool):
    """Concatenate streamed text; return (text, finish_reason, usage, number of chunks)."""
    text, finish_reason, usage, num_chunks = "", None, None, 0
    for chunk in chunks:
        num_chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = choice.delta.content if chat else choice.text
            text += piece or ""
            finish_reason = choice.finish_reason or finish_reason
    return text, finish_reason, usage, num_chunks


def test_models_lists_the_served_model(smol_server):
    models = smol_server.client().models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]


def test_chat_stream_equals_non_stream_at_temperature_0(smol_server):
    client, model = smol_server.client(), model_name(smol_server)
    full = client.chat.completions.create(model=model, messages=CHAT, max_tokens=40, temperature=0)
    chunks = client.chat.completions.create(
        model=model,
        messages=CHAT,
        max_tokens=40,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish_reason, usage, num_chunks = stream_text(chunks, chat=True)
    message = full.choices[0].message
    assert message.role == "assistant" and message.content
    assert "Paris" in message.content  # real weights: a meaningful answer
    assert text == message.content
    assert finish_reason == full.choices[0].finish_reason
    for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert getattr(usage, field) == getattr(full.usage, field)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # One chunk per text piece: about one per token, plus the role and usage chunks.
    assert num_chunks >= usage.completion_tokens // 2 + 2


def test_completion_stream_equals_non_stream_and_usage_is_exact(smol_server):
    client, model = smol_server.client(), model_name(smol_server)
    tokenized = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0)
    num_prompt_tokens = tokenized.usage.prompt_tokens
    full = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    chunks = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, finish_reason, usage, _ = stream_text(chunks, chat=False)
    choice = full.choices[0]
    assert text == choice.text
    assert choice.finish_reason == finish_reason == "length"
    assert full.usage.completion_tokens == usage.completion_tokens == 24
    assert len(choice.logprobs.tokens) == 24  # one entry per generated token
    assert full.usage.prompt_tokens == usage.prompt_tokens == num_prompt_tokens
    assert "".join(choice.logprobs.tokens) == choice.text


def test_token_id_prompt_counts_exactly(smol_server):
    client, model = smol_server.client(), model_name(smol_server)
    prompt_ids = [504, 3458, 1429, 314, 3096, 314]
    out = client.completions.create(
        model=model, prompt=prompt_ids, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == 3


def test_stop_string_ends_output_with_finish_reason_stop(smol_server):
    client, model = smol_server.client(), model_name(smol_server)
    full = client.chat.completions.create(model=model, messages=CHAT, max_tokens=40, temperature=0)
    content = full.choices[0].message.content
    stop = content.split()[2]  # a word in the middle of the greedy answer
    stopped = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=40, temperature=0, stop=[stop]
    )
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == content[: content.index(stop)]
    assert stopped.usage.completion_tokens < full.usage.completion_tokens


def test_chat_logprobs(smol_server):
    client, model = smol_server.client(), model_name(smol_server)
    out = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    entries = out.choices[0].logprobs.content
    assert len(entries) == out.usage.completion_tokens
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # Greedy: the sampled token is the most likely one.
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
    assert "".join(e.token for e in entries) == out.choices[0].message.content


def test_max_tokens_and_min_tokens(smol_server):
    client, model = smol_server.client(), model_name(smol_server)
    out = client.chat.completions.create(
        model=model, messages=CHAT, max_completion_tokens=2, temperature=0
    )
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 2
    short = [{"role": "user", "content": "Reply with the single word: hello"}]
    free = client.chat.completions.create(model=model, messages=short, max_tokens=64, temperature=0)
    forced = client.chat.completions.create(
        model=model,
        messages=short,
        max_tokens=64,
        temperature=0,
        extra_body={"min_tokens": free.usage.completion_tokens + 5},
    )
    assert free.choices[0].finish_reason == "stop"
    assert forced.usage.completion_tokens >= free.usage.completion_tokens + 5


def test_seeded_sampling_is_reproducible(smol_server):
    client, model = smol_server.client(), model_name(smol_server)

    def sample():
        return (
            client.chat.completions.create(
                model=model,
                messages=CHAT,
                max_tokens=12,
                temperature=1.0,
                top_p=0.9,
                seed=1234,
                extra_body={"top_k": 40},
            )
            .choices[0]
            .message.content
        )

    assert sample() == sample()


def test_sixteen_concurrent_clients(smol_server):
    client, model = smol_server.client(), model_name(smol_server)
    questions = ["Name a fruit.", "Name a color.", "What is 2+2?", "Name a planet."]
    expected = [
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": q}], max_tokens=16, temperature=0
        )
        .choices[0]
        .message.content
        for q in questions
    ]

    async def one(async_client, i):
        messages = [{"role": "user", "content": questions[i % 4]}]
        if i % 2:
            chunks = await async_client.chat.completions.create(
                model=model, messages=messages, max_tokens=16, temperature=0, stream=True
            )
            return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
        out = await async_client.chat.completions.create(
            model=model, messages=messages, max_tokens=16, temperature=0
        )
        return out.choices[0].message.content

    async def main():
        async with smol_server.async_client() as async_client:
            return await asyncio.gather(*(one(async_client, i) for i in range(16)))

    results = asyncio.run(main())
    assert results == [expected[i % 4] for i in range(16)]


def test_api_key_is_enforced(smol_server):
    bad = openai.OpenAI(base_url=f"{smol_server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    response = smol_server.post(
        "/v1/chat/completions", {"messages": CHAT}, headers={"Authorization": ""}
    )
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"
    # Health and metrics stay open for probes and scrapers.
    assert smol_server.post("/v1/models").status_code == 405  # authenticated, wrong method
    assert httpx.get(f"{smol_server.url}/health").status_code == 200
    assert httpx.get(f"{smol_server.url}/metrics").status_code == 200
