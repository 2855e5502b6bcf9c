"""The OpenAI-compatible HTTP endpoint on the run's engines: ``/v1/chat/completions``,
``/v1/completions`` and ``/v1/models``; ``stream=true`` is answered as one SSE stream
of the whole completion once it is generated (agent loops that stream, as verifiers'
chat program does, work unchanged).

Where it fits: ``--agent-function-path`` (``vime.rollout.endpoint.agent``) starts one
:class:`EndpointServer` per run, on 127.0.0.1 and a free port unless told otherwise,
behind a random bearer token made for the run; it stops with the run. Each agent's
client names its trajectory in the ``X-Vime-Trajectory`` header (:data:`HEADER`),
which routes the request to that sample's ``Conversation``
(``vime.rollout.endpoint.capture``); the conversation runs in the rollout's event loop,
the server in a thread of its own. The client the agent is given skips the socket: its
requests reach the same routes in the rollout's loop (:meth:`EndpointServer.transport`).
Every refusal is OpenAI's error shape, ``{"error": {"message", "type", "code"}}``, with
the HTTP status OpenAI uses.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import socket
import threading
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from vime.rollout.endpoint.capture import Conversation, Refusal

HEADER = "X-Vime-Trajectory"
MODEL = "vime"  # the model name requests give; /v1/models lists it


class EndpointServer:
    """A uvicorn server in a daemon thread; :meth:`open` routes a trajectory's requests
    to its conversation until :meth:`release`."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.token = secrets.token_urlsafe(24)
        self._conversations: dict[str, tuple[Conversation, asyncio.AbstractEventLoop]] = {}
        self._lock = threading.Lock()
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.port = self._socket.getsockname()[1]
        self._server: Any = None
        self._thread: threading.Thread | None = None
        # The routes, for uvicorn and for an in-process client (``transport``).
        self.app = _app(self)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> EndpointServer:
        import uvicorn

        config = uvicorn.Config(self.app, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the agent endpoint did not start on {self.base_url}")
            time.sleep(0.01)
        return self

    def transport(self) -> Any:
        """An ``httpx`` transport that hands requests to the routes in the caller's event
        loop: the same answers as over HTTP, without a socket, a connection pool or the
        server's thread (a client on it costs a fraction of one on ``base_url``)."""
        import httpx

        return httpx.ASGITransport(app=self.app)

    def close(self) -> None:
        """Stop serving (requests in flight are answered first) and free the port."""
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
        self._socket.close()

    def open(self, conversation: Conversation) -> str:
        """Route requests naming the returned key to ``conversation``, run in the
        calling event loop."""
        key = f"{conversation.sample.index}-{secrets.token_hex(6)}"
        with self._lock:
            self._conversations[key] = (conversation, asyncio.get_running_loop())
        return key

    def release(self, key: str) -> None:
        with self._lock:
            self._conversations.pop(key, None)

    def authorized(self, header: str | None) -> bool:
        return hmac.compare_digest((header or "").encode(), f"Bearer {self.token}".encode())

    def conversation(self, key: str | None) -> tuple[Conversation, asyncio.AbstractEventLoop]:
        with self._lock:
            found = self._conversations.get(key or "")
        if found is None:
            raise Refusal(
                400,
                f"no open trajectory {key!r}: send the {HEADER} header the agent's client "
                "was given",
                "unknown_trajectory",
            )
        return found


def _stopped() -> Refusal:
    """The request's trajectory was cancelled while it waited (its rollout is over: the
    run stopped or failed): an answer, not a traceback per request in flight."""
    return Refusal(
        503,
        "this trajectory was stopped before its completion: the run is stopping",
        "trajectory_stopped",
        "server_error",
    )


def _app(server: EndpointServer) -> FastAPI:
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    def error(refusal: Refusal) -> JSONResponse:
        return JSONResponse(refusal.body(), status_code=refusal.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return error(Refusal(exc.status_code, str(exc.detail), None))

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        if not server.authorized(request.headers.get("authorization")):
            return error(_bad_key())
        card = {"id": MODEL, "object": "model", "created": 0, "owned_by": "vime"}
        return JSONResponse({"object": "list", "data": [card]})

    async def serve(request: Request, kind: str) -> Response:
        try:
            if not server.authorized(request.headers.get("authorization")):
                raise _bad_key()
            body = _request_body(await request.body(), kind)
            conversation, loop = server.conversation(request.headers.get(HEADER))
            run = _chat if kind == "chat" else _complete
            if loop is asyncio.get_running_loop():  # an in-process client (``transport``)
                try:
                    out = await run(conversation, body)
                finally:
                    # The one suspension such a request is sure of: a refused request does
                    # not wait, so the cancel of a cut (the agent's own task) lands here.
                    await asyncio.sleep(0)
            else:
                future = asyncio.run_coroutine_threadsafe(run(conversation, body), loop)
                try:
                    out = await asyncio.wrap_future(future)
                except asyncio.CancelledError:
                    current = asyncio.current_task()
                    if current is not None and current.cancelling():
                        raise  # this request itself was cancelled (the server is stopping)
                    raise _stopped() from None
            if body.get("stream"):
                return StreamingResponse(_events(out, body), media_type="text/event-stream")
            return JSONResponse(out)
        except Refusal as refusal:
            return error(refusal)
        except Exception as err:  # the engines failed: the rollout raises it too
            return error(Refusal(500, f"{type(err).__name__}: {err}", None, "server_error"))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await serve(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, "completions")

    return app


def _bad_key() -> Refusal:
    return Refusal(401, "invalid API key: use the run's token", "invalid_api_key")


def _request_body(raw: bytes, kind: str) -> dict[str, Any]:
    """The request's JSON, checked for what this endpoint serves."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise Refusal(400, f"the body is not valid JSON ({err})", "invalid_json") from None
    if not isinstance(body, dict):
        raise Refusal(400, "the body must be a JSON object", "invalid_json")
    model = body.get("model")
    if model != MODEL:
        raise Refusal(404, f"the model {model!r} does not exist; use {MODEL!r}", "model_not_found")
    if body.get("n", 1) != 1:
        raise Refusal(400, "only n=1 is supported: one completion per request", "unsupported_value")
    field = "messages" if kind == "chat" else "prompt"
    value = body.get(field)
    if kind == "chat":
        ok = isinstance(value, list) and len(value) > 0
    else:
        ok = isinstance(value, str) or (
            isinstance(value, list) and all(isinstance(t, int) for t in value) and value
        )
    if not ok:
        want = "a non-empty list of messages" if kind == "chat" else "a string or token ids"
        raise Refusal(400, f"'{field}' is required: {want}", "missing_required_parameter")
    return body


async def _chat(conversation: Conversation, body: dict[str, Any]) -> dict[str, Any]:
    turn, _, calls, content = await conversation.chat(body)
    n = conversation.requests
    tool_calls = [
        {
            "id": f"call_{conversation.sample.index}_{n}_{k}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
        }
        for k, c in enumerate(calls)
    ]
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    finish = "length" if turn.finish_reason == "length" else "tool_calls" if calls else "stop"
    choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
    return _response(conversation, "chat.completion", choice, turn)


async def _complete(conversation: Conversation, body: dict[str, Any]) -> dict[str, Any]:
    turn, text = await conversation.complete(body)
    choice = {"index": 0, "text": text, "finish_reason": turn.finish_reason, "logprobs": None}
    return _response(conversation, "text_completion", choice, turn)


def _response(conversation: Conversation, kind: str, choice: dict, turn: Any) -> dict[str, Any]:
    generated = len(turn.token_ids)
    prompt = conversation.last_prompt_len
    return {
        "id": f"vime-{conversation.sample.index}-{conversation.requests}",
        "object": kind,
        "created": int(time.time()),
        "model": MODEL,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": generated,
            "total_tokens": prompt + generated,
        },
    }


def _events(out: dict[str, Any], body: dict[str, Any]) -> Any:
    """A finished completion as OpenAI's server-sent events: one chunk holding the whole
    message (or text), one with the finish reason, the usage when the request's
    ``stream_options`` ask for it, then ``[DONE]``."""
    choice = out["choices"][0]
    kind = "chat.completion.chunk" if out["object"] == "chat.completion" else out["object"]
    head = {k: out[k] for k in ("id", "created", "model")} | {"object": kind}
    if kind == "chat.completion.chunk":
        delta = dict(choice["message"])
        calls = delta.pop("tool_calls", None)
        if calls:  # a streamed call carries its index in the message's list
            delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(calls)]
        first = {"index": 0, "delta": delta, "finish_reason": None}
        last = {"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}
    else:
        first = {"index": 0, "text": choice["text"], "finish_reason": None}
        last = {"index": 0, "text": "", "finish_reason": choice["finish_reason"]}
    chunks = [head | {"choices": [first]}, head | {"choices": [last]}]
    if (body.get("stream_options") or {}).get("include_usage"):
        chunks.append(head | {"choices": [], "usage": out["usage"]})
    for chunk in chunks:
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"
