"""The harness vime runs a verifiers environment's seat on (``--environment``).

Where it fits: ``vime.data.verifiers_env`` sets every seat's harness to
:data:`HARNESS_ID`, which verifiers resolves to :class:`LocalChatHarness` here. It is
verifiers' ``null`` harness -- its chat program, the tasks' MCP tools included -- run
by this interpreter (whose packages are the ``agents`` extra's) instead of in an
environment ``uv`` would download. verifiers resolves a harness id as a top-level
module exporting its class in ``__all__`` (a dotted id does not resolve), so this
module registers itself under that name when imported.
"""

from __future__ import annotations

import sys
from typing import Any

from verifiers.v1.harnesses.null import NullHarness
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE, launch_chat_program

HARNESS_ID = "vime_chat_harness"
PROGRAM = "vime_chat_program.py"
__all__ = ["LocalChatHarness"]


class _LocalScripts:
    """A runtime whose PEP 723 scripts run on this interpreter (its packages are the
    agents extra's); everything else is the runtime's."""

    def __init__(self, runtime: Any) -> None:
        self._runtime = runtime

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runtime, name)

    async def prepare_uv_script(self, script: str | bytes, env: Any = None, **_: Any) -> list[str]:
        data = script.encode() if isinstance(script, str) else script
        await self._runtime.write(PROGRAM, data)
        return [sys.executable, PROGRAM]


class LocalChatHarness(NullHarness):
    """verifiers' chat program (the ``null`` harness's) on this interpreter: nothing to
    set up, nothing downloaded."""

    async def setup(self, runtime: Any) -> None:
        return None

    async def launch(
        self,
        ctx: Any,
        trace: Any,
        runtime: Any,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: Any,
        tool_interception_url: str | None = None,
    ) -> Any:
        system_prompt, prompt = self.resolve_prompt(data)
        url = tool_interception_url
        extra = [f"--tool-interception-url={url}"] if url else []
        return await launch_chat_program(
            CHAT_PROGRAM_SOURCE,
            self.config,
            ctx,
            trace,
            _LocalScripts(runtime),
            endpoint,
            secret,
            mcp_urls,
            system_prompt,
            prompt,
            extra_args=extra,
        )


sys.modules.setdefault(HARNESS_ID, sys.modules[__name__])
