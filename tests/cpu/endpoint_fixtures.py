"""A tiny chat model that calls a tool, and ``openai``-client agents, for the endpoint tests
(``vime-train --agent-function-path`` loads the agents from this file by its path).

The model is real (a Qwen3 the engines load) with weights set by hand so a tool call is
likely: every layer's output projections are zero, so the logits depend on the last
token alone, and the head makes the generation prompt's last token ("\\n") likely to
be followed by one added token spelling a whole ``add`` call, and that by the end of
turn. Everything else it samples is random text with real log-probs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
PROMPTS = ["What is 2 + 3?", "Add 2 and 3, please."]


def endpoint_tokenizer() -> Any:
    from chat_fixtures import chat_tokenizer  # here: vime-train loads the agents by path

    tok = chat_tokenizer()
    tok.add_tokens([CALL])
    return tok


def save_endpoint_model(path: Path, seed: int = 5) -> str:
    """The model and its tokenizer (with the chat template) as an HF folder at ``path``."""
    import torch
    from tiny_models import tiny_qwen3_config
    from transformers import AutoModelForCausalLM

    tok = endpoint_tokenizer()
    eot = tok.eos_token_id
    config = tiny_qwen3_config(vocab_size=len(tok))
    config.eos_token_id, config.pad_token_id = eot, 0
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False
    )
    newline = tok.encode(prompt, add_special_tokens=False)[-1]
    call = tok.convert_tokens_to_ids(CALL)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.normal_(0.0, 0.1)
        for x, y, bonus in ((newline, call, 1.0), (call, eot, 1.5)):
            head[y] += bonus * emb[x] / emb[x].norm()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def write_prompts(path: Path) -> str:
    path.write_text("".join(json.dumps({"prompt": p, "label": "5"}) + "\n" for p in PROMPTS))
    return str(path)


async def tool_agent(sample: Any, client: Any) -> float:
    """Three requests with the ``add`` tool: a call is answered by a tool message, an
    answer by a user's nudge; the reward is whether some answer said 5."""
    messages: list[Any] = [{"role": "user", "content": sample.prompt.text}]
    said = False
    for _ in range(3):
        out = await client.chat.completions.create(
            model="vime", messages=messages, tools=TOOLS, max_tokens=6
        )
        message = out.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            args = json.loads(call.function.arguments)
            result = str(args["a"] + args["b"])
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        if not message.tool_calls:
            said = said or "5" in (message.content or "")
            messages.append({"role": "user", "content": "Go on."})
    return 1.0 if said else 0.0


async def drifting_agent(sample: Any, client: Any) -> dict:
    """Two requests; the second rewrites the first user message (drift)."""
    first = [{"role": "user", "content": sample.prompt.text}]
    out = await client.chat.completions.create(model="vime", messages=first, max_tokens=4)
    reply = out.choices[0].message.model_dump(exclude_none=True)
    edited = [{"role": "user", "content": "Something else."}, reply]
    await client.chat.completions.create(
        model="vime", messages=[*edited, {"role": "user", "content": "Go on."}], max_tokens=4
    )
    return {"agent": "drifting"}


async def endless_agent(sample: Any, client: Any) -> float:
    """Never stops asking (its errors swallowed): the budget or --max-turns must end it."""
    prompt = sample.prompt.text
    while True:
        try:
            out = await client.completions.create(model="vime", prompt=prompt, max_tokens=5)
            prompt += out.choices[0].text + " more"
        except Exception:
            pass


async def two_ways_agent(sample: Any, client: Any) -> dict:
    """Two completions: the first through the client it was given, the second, which
    extends it, through a client of its own on the endpoint's URL (over HTTP)."""
    import openai

    from vime.rollout.endpoint.server import HEADER

    own = openai.AsyncOpenAI(
        base_url=str(client.base_url),
        api_key=client.api_key,
        default_headers={HEADER: client.default_headers[HEADER]},
        max_retries=0,
    )
    prompt = sample.prompt.text
    try:
        for each in (client, own):
            out = await each.completions.create(model="vime", prompt=prompt, max_tokens=4)
            prompt += out.choices[0].text + " more"
    finally:
        await own.close()
    return {"agent": "two ways"}


async def streaming_agent(sample: Any, client: Any) -> dict:
    """One chat request streamed (``stream=True`` with the usage chunk), read to its end."""
    stream = await client.chat.completions.create(
        model="vime",
        messages=[{"role": "user", "content": sample.prompt.text}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, tokens, finish = "", None, None
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return {"text": text, "tokens": tokens, "finish": finish}
