"""The rollout server's side of the control route's mutual authentication (``vllm serve
--middleware megatron_ngrpo.rollout.remote.guard.SecretGuard``; the protocol:
:mod:`megatron_ngrpo.rollout.remote.auth`).

Every request but ``GET /health`` and the handshake must carry a MAC under a session the handshake
opened, with a counter the session has not seen (a window of :data:`WINDOW` counters: the client
sends concurrently, so they may arrive out of order), else HTTP 401. The static secret itself is
never accepted. The guard keeps its sessions in this process (vLLM's single API-server process).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections import OrderedDict

from megatron_ngrpo.rollout.remote.auth import (
    HANDSHAKE_PATH,
    NONCE_BYTES,
    OPEN_PATHS,
    SCHEME,
    mac,
    read_secret,
    server_proof,
    session_key,
)

WINDOW = 4096  # counters a session accepts below its highest one (concurrent requests)
MAX_SESSIONS = 64  # established ones (each client: one per server); the oldest is dropped
MAX_PENDING = 256  # handshakes not yet used (anyone can open one); the oldest is dropped
MAX_UNPROVEN_BODY = 2**20  # body bytes read before a session's first valid MAC


class _Session:
    """One client session: its key and the counters it has accepted."""

    def __init__(self, key: bytes):
        self.key, self.top, self.seen = key, 0, set()

    def fresh(self, counter: int) -> bool:
        return counter > self.top - WINDOW and counter not in self.seen

    def accept(self, counter: int) -> None:
        self.seen.add(counter)
        if counter > self.top:
            self.top = counter
            self.seen = {c for c in self.seen if c > self.top - WINDOW}


class SecretGuard:
    """ASGI middleware: HTTP 401 for any request (but ``GET /health``) without a valid MAC of an
    open session; ``POST /ngrpo/handshake`` opens one (the server's proof of the job's secret)."""

    def __init__(self, app, secret: str | None = None):
        self.app = app
        self.secret = read_secret() if secret is None else secret
        self.pending: OrderedDict[str, bytes] = OrderedDict()  # server nonce → session key
        self.sessions: OrderedDict[str, _Session] = OrderedDict()

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope.get("path") in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if scope["type"] == "http" and scope.get("path") == HANDSHAKE_PATH:
            return await self._handshake(scope, receive, send)
        nonce, counter, tag = _parse(scope)
        session = self.sessions.get(nonce)
        key = session.key if session is not None else self.pending.get(nonce)
        if key is None or (session is not None and not session.fresh(counter)):
            return await _refuse(scope, send, "no open session or a replayed request")
        limit = None if session is not None else MAX_UNPROVEN_BODY
        body = await _read_body(receive, limit) if scope["type"] == "http" else [b""]
        if body is None:
            return await _refuse(scope, send, "body too large before the session is proven")
        digest = hashlib.sha256(b"".join(body)).digest()
        path, query = scope.get("path", ""), scope.get("query_string", b"").decode("latin-1")
        want = mac(key, b"request", str(counter), scope.get("method", "GET"), path, query, digest)
        if not hmac.compare_digest(tag, want):
            return await _refuse(scope, send, "wrong request MAC")
        if session is None:
            session = self.sessions[nonce] = _Session(self.pending.pop(nonce))
            while len(self.sessions) > MAX_SESSIONS:
                self.sessions.popitem(last=False)
        if not session.fresh(counter):  # a concurrent twin passed the first check
            return await _refuse(scope, send, "a replayed request")
        session.accept(counter)
        await self.app(scope, _replay(body, receive) if scope["type"] == "http" else receive, send)

    async def _handshake(self, scope, receive, send):
        body = await _read_body(receive, 4096)
        try:
            theirs = bytes.fromhex(json.loads(b"".join(body or []))["nonce"])
        except (ValueError, KeyError, TypeError):
            theirs = b""
        if scope.get("method") != "POST" or len(theirs) != NONCE_BYTES:
            return await _refuse(scope, send, f"POST {HANDSHAKE_PATH} takes {{'nonce': 64 hex}}")
        mine = secrets.token_bytes(NONCE_BYTES)
        self.pending[mine.hex()] = session_key(self.secret, theirs, mine)
        while len(self.pending) > MAX_PENDING:
            self.pending.popitem(last=False)
        proof = server_proof(self.secret, theirs, mine)
        await _respond(send, 200, {"nonce": mine.hex(), "proof": proof.hex()})


def _parse(scope) -> tuple[str, int, bytes]:
    """(server nonce, counter, MAC) of the request's ``Authorization`` header; ("", 0, b"") when
    it has none of the scheme."""
    given = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
    scheme, _, value = given.partition(" ")
    try:
        nonce, counter, tag = value.split(".")
        if scheme == SCHEME:
            return nonce, int(counter), bytes.fromhex(tag)
    except ValueError:
        pass
    return "", 0, b""


async def _read_body(receive, limit: int | None) -> list[bytes] | None:
    """The request body's chunks; None once it exceeds ``limit`` bytes."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return chunks
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if limit is not None and size > limit:
            return None
        if not message.get("more_body", False):
            return chunks


def _replay(chunks: list[bytes], receive):
    """An ASGI ``receive`` that hands the app the body read already, then the real one's messages
    (a disconnect)."""
    pending = list(chunks)

    async def replayed():
        if pending:
            body = pending.pop(0)
            return {"type": "http.request", "body": body, "more_body": bool(pending)}
        return await receive()

    return replayed


async def _refuse(scope, send, reason: str):
    if scope["type"] == "websocket":
        return await send({"type": "websocket.close", "code": 1008})
    await _respond(send, 401, {"error": f"rollout server: {reason} (job secret required)"})


async def _respond(send, status: int, answer: dict):
    body = json.dumps(answer).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
