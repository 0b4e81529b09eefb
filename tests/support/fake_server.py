"""A rollout server's HTTP surface in this process (tests only): the real guard
(:class:`~megatron_ngrpo.rollout.remote.guard.SecretGuard`) in front of a tiny ASGI app whose
routes are Python functions, served by uvicorn on a loopback port. Records every request that
reaches the port (``wire``: before the guard) and every one the app served (``served``)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import uvicorn

from megatron_ngrpo.parallel import free_port
from megatron_ngrpo.rollout.remote.guard import SecretGuard


class FakeServer:
    """``routes``: (method, path) → fn(body dict) → answer dict (an exception: HTTP 500 with its
    text; ``hang`` in the answer: never answers). ``secret``: the guard's (None: no guard)."""

    def __init__(self, routes: dict, secret: str | None):
        self.routes, self.wire, self.served = routes, [], []
        self.url = ""
        app = self._app if secret is None else SecretGuard(self._app, secret)

        async def recorded(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)
            chunks = []

            async def tap():
                message = await receive()
                chunks.append(message.get("body", b""))
                return message

            self.wire.append((scope["method"], scope["path"], dict(scope["headers"]), chunks))
            await app(scope, tap, send)

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(
            recorded,
            host="127.0.0.1",
            port=port,
            log_level="error",
            lifespan="off",
            timeout_graceful_shutdown=1,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "the fake server did not start"
            time.sleep(0.02)

    async def _app(self, scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        key = (scope["method"], scope["path"])
        self.served.append((key, body))
        fn = self.routes.get(key)
        status, answer = 404, {"detail": "Not Found"}
        if fn is not None:
            loop = asyncio.get_running_loop()
            try:
                # a thread: a route may block (a worker joining a group)
                answer = await loop.run_in_executor(None, fn, json.loads(body) if body else {})
                status = 200
            except Exception as e:  # noqa: BLE001 - the server's 500, as vLLM answers
                status, answer = 500, {"error": f"{type(e).__name__}: {e}"}
        if isinstance(answer, dict) and answer.get("hang"):
            await asyncio.sleep(3600)
        data = json.dumps(answer).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": data})

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
