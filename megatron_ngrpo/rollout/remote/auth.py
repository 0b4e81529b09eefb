"""The shared secret of a disaggregated job's rollout servers and its trainer.

vLLM's dev-mode routes (``/collective_rpc``, the weight-transfer routes) run code on the servers'
workers and replace their weights, and vLLM's own ``--api-key`` guards ``/v1`` paths only. So the
server adds :class:`SecretMiddleware` (``vllm serve --middleware``): every request but ``GET
/health`` must carry ``Authorization: Bearer <secret>``, else HTTP 401. The secret is generated
per job, written to a file only the job's user reads, and reaches both sides by environment
(``NGRPO_ROLLOUT_SECRET``, or ``NGRPO_ROLLOUT_SECRET_FILE`` naming the file; the client also takes
``rollout.remote.secret_file``), or, in a hetjob whose servers register in a URL folder of the
job, as ``<url-dir>/.rollout_secret``, made by whichever side starts first: never on a command
line, which lands in logs and ``ps``.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
from pathlib import Path

SECRET_ENV = "NGRPO_ROLLOUT_SECRET"
SECRET_FILE_ENV = "NGRPO_ROLLOUT_SECRET_FILE"
URL_DIR_SECRET = ".rollout_secret"
OPEN_PATHS = ("/health",)  # liveness only: no state, no code


def new_secret(path: str | Path) -> str:
    """The secret in file ``path``, made there (256 bits, mode 0600, atomically: a side that
    starts at the same moment reads the same one) unless it exists; returns it."""
    path = Path(path)
    if not path.exists():
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32))
        try:
            os.link(tmp, path)  # fails if another side made it first: theirs wins
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return path.read_text().strip()


def read_secret(path: str = "", url_dir: str = "") -> str:
    """The job's secret: ``$NGRPO_ROLLOUT_SECRET``, else the file ``path`` or
    ``$NGRPO_ROLLOUT_SECRET_FILE``, else the one of the job's URL folder ``url_dir``
    (:func:`new_secret`); ValueError (one line) when there is none."""
    if os.environ.get(SECRET_ENV):
        return os.environ[SECRET_ENV]
    path = path or os.environ.get(SECRET_FILE_ENV, "")
    if not path and url_dir:
        Path(url_dir).mkdir(parents=True, exist_ok=True)
        return new_secret(Path(url_dir) / URL_DIR_SECRET)
    if not path:
        raise ValueError(
            f"rollout servers need the job's shared secret: set {SECRET_ENV}, or {SECRET_FILE_ENV} "
            f"(client: rollout.remote.secret_file) to a file holding it, or register them in a url dir"
        )
    try:
        secret = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"rollout server secret file {path}: {e.strerror}") from None
    if not secret:
        raise ValueError(f"rollout server secret file {path} is empty")
    return secret


def bearer(secret: str) -> dict[str, str]:
    """The header that carries ``secret``."""
    return {"Authorization": f"Bearer {secret}"}


class SecretMiddleware:
    """ASGI middleware: HTTP 401 for any request (but ``GET /health``) without the job's secret."""

    def __init__(self, app):
        self.app = app
        self.expected = f"Bearer {read_secret()}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket") and scope.get("path") not in OPEN_PATHS:
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                body = json.dumps(
                    {"error": "missing or wrong rollout secret (Authorization: Bearer)"}
                ).encode()
                await send(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
