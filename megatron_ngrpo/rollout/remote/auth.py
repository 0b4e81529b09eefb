"""The shared secret of a disaggregated job's rollout servers and its trainer, and the client's
side of the control route's mutual authentication.

vLLM's dev-mode routes (``/collective_rpc``, the weight-transfer routes) run code on the servers'
workers and replace their weights, and vLLM's own ``--api-key`` guards ``/v1`` paths only. So the
server adds :class:`~megatron_ngrpo.rollout.remote.guard.SecretGuard` (``vllm serve
--middleware``) and the client speaks to it through :class:`ClientAuth`:

1. the client sends a fresh nonce (nothing else) to ``POST /ngrpo/handshake``; the server answers
   with its own nonce and ``HMAC(secret, "server", client nonce, server nonce)``;
2. the client checks that proof before it sends anything else: a server without the job's secret
   (a stale registration, another job's server, a stranger at the port) is refused with one line
   and learns nothing;
3. every later request carries ``Authorization: NGRPO-HMAC <server nonce>.<counter>.<mac>``, the
   MAC under a session key derived from both nonces over (counter, method, path, query, SHA-256
   of the body): the secret itself never travels, and a replayed or altered request is refused.

The secret is generated per job, kept in a file only the job's user reads (an existing file with
another owner or a group/other-readable mode is refused), and reaches both sides by environment
(``NGRPO_ROLLOUT_SECRET``, or ``NGRPO_ROLLOUT_SECRET_FILE`` naming the file; the client also takes
``rollout.remote.secret_file``), or, in a hetjob whose servers register in a URL folder of the job,
as ``<url-dir>/.rollout_secret``, made by whichever side starts first: never on a command line,
which lands in logs and ``ps``. Registrations go to a subfolder of the URL folder named after the
run and the allocation (:func:`registration_dir`), so a requeued job never sees its previous
allocation's files.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import secrets
import stat
import threading
from pathlib import Path
from urllib.parse import unquote, urlsplit

SECRET_ENV = "NGRPO_ROLLOUT_SECRET"
SECRET_FILE_ENV = "NGRPO_ROLLOUT_SECRET_FILE"
RUN_ID_ENV = "NGRPO_RUN_ID"  # names the registration subfolder (default: the Slurm allocation)
URL_DIR_SECRET = ".rollout_secret"
OPEN_PATHS = ("/health",)  # liveness only: no state, no code
HANDSHAKE_PATH = "/ngrpo/handshake"
SCHEME = "NGRPO-HMAC"
NONCE_BYTES = 32


class ServerProofError(Exception):
    """A server that did not prove the job's secret (the client sent it nothing but a nonce)."""


def mac(key: bytes, *parts: bytes | str) -> bytes:
    """HMAC-SHA256 of ``parts`` under ``key``, each part length-prefixed (no two part lists
    collide)."""
    m = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        p = p.encode() if isinstance(p, str) else p
        m.update(len(p).to_bytes(8, "big") + p)
    return m.digest()


def server_proof(secret: str, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return mac(secret.encode(), b"server", client_nonce, server_nonce)


def session_key(secret: str, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return mac(secret.encode(), b"session", client_nonce, server_nonce)


def request_mac(key: bytes, counter: int, method: str, path: str, query: str, body: bytes) -> bytes:
    """The MAC of one request: ``path`` percent-decoded, ``query`` as sent."""
    return mac(
        key, b"request", str(counter), method.upper(), path, query, hashlib.sha256(body).digest()
    )


# ---------------------------------------------------------------- the secret and the URL folder


def private_dir(path: str | Path) -> Path:
    """``path`` made (mode 0700) unless it exists; ValueError (one line) when an existing one is
    another user's or group/other-writable."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(
            f"rollout url dir {path}: owned by uid {st.st_uid} with mode "
            f"{stat.S_IMODE(st.st_mode):o}; it must be this user's ({os.getuid()}) and not "
            f"writable by group or others (chmod 700)"
        )
    return path


def _check_private(path: Path) -> None:
    """ValueError (one line) unless the secret file ``path`` is this user's and only theirs."""
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ValueError(
            f"rollout server secret file {path}: owned by uid {st.st_uid} with mode "
            f"{stat.S_IMODE(st.st_mode):o}; it must be this user's ({os.getuid()}) and readable "
            f"by them only (chmod 600)"
        )


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
    _check_private(path)
    return path.read_text().strip()


def read_secret(path: str = "", url_dir: str = "") -> str:
    """The job's secret: ``$NGRPO_ROLLOUT_SECRET``, else the file ``path`` or
    ``$NGRPO_ROLLOUT_SECRET_FILE``, else the one of the job's URL folder ``url_dir``
    (:func:`new_secret`); ValueError (one line) when there is none or its file is not private."""
    if os.environ.get(SECRET_ENV):
        return os.environ[SECRET_ENV]
    path = path or os.environ.get(SECRET_FILE_ENV, "")
    if not path and url_dir:
        Path(url_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
        return new_secret(Path(url_dir) / URL_DIR_SECRET)
    if not path:
        raise ValueError(
            f"rollout servers need the job's shared secret: set {SECRET_ENV}, or {SECRET_FILE_ENV} "
            f"(client: rollout.remote.secret_file) to a file holding it, or register them in a url dir"
        )
    try:
        _check_private(Path(path))
        secret = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"rollout server secret file {path}: {e.strerror}") from None
    if not secret:
        raise ValueError(f"rollout server secret file {path} is empty")
    return secret


def run_scope() -> str:
    """The name of this run's registration subfolder: ``$NGRPO_RUN_ID``, else the Slurm
    allocation (the hetjob's leader id, else the job id, and the restart count: a requeued job
    is a new allocation), else ``local``. Both groups of a hetjob inherit the batch script's
    environment, so they agree."""
    if os.environ.get(RUN_ID_ENV):
        return "run-" + os.environ[RUN_ID_ENV]
    job = next(
        (
            os.environ[k]
            for k in ("SLURM_HET_JOB_ID", "SLURM_JOB_ID_HET_GROUP_0", "SLURM_JOB_ID")
            if os.environ.get(k)
        ),
        "",
    )
    if not job:
        return "local"
    return f"slurm-{job}-{os.environ.get('SLURM_RESTART_COUNT', '0')}"


def registration_dir(url_dir: str | Path) -> Path:
    """Where this run's servers register (``<url_dir>/<run scope>``, mode 0700, this user's:
    :func:`private_dir`)."""
    Path(url_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
    return private_dir(Path(url_dir) / run_scope())


# ---------------------------------------------------------------- the client's side


class ClientAuth:
    """``requests`` auth of one client session with the server at ``base`` (a callable taking a
    prepared request): the handshake on first use (the server proves the secret before anything
    else is sent; :class:`ServerProofError` otherwise), then a MAC and a fresh counter on every
    request. Thread-safe (the client sends concurrently)."""

    def __init__(self, base: str, secret: str, timeout):
        self.base, self.secret, self.timeout = base.rstrip("/"), secret, timeout
        self._lock = threading.Lock()
        self._session: tuple[str, bytes] | None = None  # (server nonce hex, session key)
        self._counter = itertools.count(1)

    def handshake(self) -> tuple[str, bytes]:
        # lazy: HTTP client of the remote engine only
        import requests

        with self._lock:
            if self._session is None:
                mine = secrets.token_bytes(NONCE_BYTES)
                r = requests.post(
                    f"{self.base}{HANDSHAKE_PATH}", json={"nonce": mine.hex()}, timeout=self.timeout
                )
                try:
                    answer = r.json() if r.status_code == 200 else {}
                    theirs = bytes.fromhex(answer["nonce"])
                    proof = bytes.fromhex(answer["proof"])
                except (ValueError, KeyError, TypeError):
                    raise ServerProofError(
                        f"POST {HANDSHAKE_PATH}: HTTP {r.status_code}, no proof of the job's secret"
                    ) from None
                if len(theirs) != NONCE_BYTES or not hmac.compare_digest(
                    proof, server_proof(self.secret, mine, theirs)
                ):
                    raise ServerProofError(
                        f"POST {HANDSHAKE_PATH}: the server's proof is wrong (another job's "
                        f"secret, or not this job's server)"
                    )
                self._session = (theirs.hex(), session_key(self.secret, mine, theirs))
            return self._session

    def __call__(self, r):
        nonce, key = self.handshake()
        with self._lock:
            counter = next(self._counter)
        parts = urlsplit(r.url)
        body = r.body or b""
        body = body.encode() if isinstance(body, str) else body
        tag = request_mac(key, counter, r.method, unquote(parts.path), parts.query, body)
        r.headers["Authorization"] = f"{SCHEME} {nonce}.{counter}.{tag.hex()}"
        return r
