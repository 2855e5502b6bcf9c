"""Shared by the tool tests: a tool module's source, and a chat tokenizer with a
Qwen3-style template (tools in the system turn, results as <tool_response> blocks)."""

from __future__ import annotations

import textwrap
from typing import Any

TOOLS_PY = textwrap.dedent(
    '''
    import asyncio
    import time
    from typing import Literal


    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first addend.
            b: The second addend.
        """
        return a + b


    async def lookup(key: Literal["pi", "e"]) -> str:
        """Look up a constant.

        Args:
            key: Which constant.
        """
        await asyncio.sleep(0)
        return {"pi": "3.14159", "e": "2.71828"}[key]


    def nap(seconds: float) -> dict:
        """Sleep, then say how long.

        Args:
            seconds: How long to sleep.
        """
        time.sleep(seconds)
        return {"slept": seconds}


    async def anap(seconds: float) -> list:
        """Sleep without a thread.

        Args:
            seconds: How long to sleep.
        """
        await asyncio.sleep(seconds)
        return [seconds]


    def loop(n: int) -> list:
        """Return a list that holds itself.

        Args:
            n: Ignored.
        """
        out = [n]
        out.append(out)
        return out


    def fail(message: str) -> str:
        """Raise with a message.

        Args:
            message: What to raise.
        """
        raise RuntimeError(message)


    TOOLS = [add, lookup, nap, anap, fail, loop]
    NOT_A_LIST = add
    EMPTY = []
    '''
)


SPECIALS = [
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|endoftext|>",  # a stop token besides the end of turn (Qwen's generation config has both)
]

# Written for these tests in the format of Qwen3's template: tools as JSON lines
# inside <tools> in the system turn; tool results as <tool_response> blocks in
# one user turn; an assistant turn after the last user message keeps its
# reasoning, and the last one gets an (empty) think block even with none.
TEMPLATE = "".join(
    [
        "{%- set ns = namespace(last_user=-1) %}",
        "{%- for m in messages %}{%- if m.role == 'user' %}",
        "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}",
        "{%- if tools %}",
        "{{- '<|im_start|>system\\n' }}",
        "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}",
        "{{- '# Tools\\n\\nFunctions you may call, one JSON signature per line:\\n<tools>' }}",
        "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}",
        "{{- '\\n</tools>\\n\\nTo call one, write a JSON object inside tags:\\n<tool_call>\\n'",
        ' + \'{"name": <function-name>, "arguments": <args-json-object>}\\n\'',
        " + '</tool_call><|im_end|>\\n' }}",
        "{%- elif messages[0].role == 'system' %}",
        "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}",
        "{%- endif %}",
        "{%- for m in messages %}",
        "{%- if m.role == 'user' %}",
        "{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}",
        "{%- elif m.role == 'assistant' %}",
        "{%- set content = m.content %}{%- set reasoning = '' %}",
        "{%- if '</think>' in content %}",
        "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}",
        "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}",
        "{%- endif %}",
        "{{- '<|im_start|>assistant\\n' }}",
        "{%- if loop.index0 > ns.last_user and (loop.last or reasoning) %}",
        "{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' }}",
        "{%- endif %}",
        "{{- content + '<|im_end|>\\n' }}",
        "{%- elif m.role == 'tool' %}",
        "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}",
        "{{- '<|im_start|>user' }}{%- endif %}",
        "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}",
        "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}",
        "{{- '<|im_end|>\\n' }}{%- endif %}",
        "{%- endif %}",
        "{%- endfor %}",
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}",
        "{%- if enable_thinking is defined and not enable_thinking %}",
        "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}",
    ]
)

CORPUS = [
    "# Tools\n\nFunctions you may call, one JSON signature per line:\n<tools>",
    '{"type": "function", "function": {"name": "add", "description": "Add two integers.",',
    '"parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}',
    "What is 2 + 3, and what is pi? Be exact. The answer is 5 and 3.14159.",
    "I need two tools. Let me compute the sum and look up the constant.",
    "error: unknown tool; bad arguments for add: missing a required argument",
] * 3


def chat_tokenizer() -> Any:
    """A byte-level BPE tokenizer (Qwen's kind) trained here, with the chat's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(CORPUS, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", additional_special_tokens=SPECIALS
    )
    tok.chat_template = TEMPLATE
    return tok
