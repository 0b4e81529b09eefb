"""HTTP to the rollout servers (:mod:`megatron_ngrpo.rollout.remote.client`'s transport).

One ``requests`` session per server, authenticated both ways with the job's shared secret (the
server proves it first, then every request carries a MAC: :mod:`~megatron_ngrpo.rollout.remote.auth`), a connect and a request timeout on every call (a
dead or hung server never hangs the trainer), and one-line reasons: a failed call raises
:class:`CallFailed` (``retry``: worth another try), a server that cannot be used
:class:`RolloutServerError`.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from megatron_ngrpo.rollout.config import RemoteConfig
from megatron_ngrpo.rollout.remote.auth import ClientAuth, ServerProofError


class RolloutServerError(RuntimeError):
    """A rollout server that cannot be used; the message is one line naming it."""


class CallFailed(Exception):
    """One failed HTTP call (``retry``: worth another try)."""

    def __init__(self, message: str, retry: bool = True):
        super().__init__(message)
        self.retry = retry


class ServerHTTP:
    """The calls of one client to the servers of ``cfg``; ``secret`` is set (rank 0, at
    start-up) before the first call."""

    def __init__(self, cfg: RemoteConfig):
        self.cfg = cfg
        self.secret = ""
        self._sessions: dict = {}

    def timeouts(self) -> tuple[float, float]:
        return self.cfg.connect_timeout_s, self.cfg.request_timeout_s

    def session(self, url: str):
        # lazy: HTTP client of the remote engine only
        import requests

        if url not in self._sessions:
            self._sessions[url] = requests.Session()
            self._sessions[url].auth = ClientAuth(url, self.secret, self.timeouts())
        return self._sessions[url]

    def post(self, url: str, route: str, **kwargs) -> dict:
        """One POST; raises :class:`CallFailed` with a short reason."""
        return self.call("post", url, route, **kwargs)

    def get(self, url: str, route: str) -> dict:
        return self.call("get", url, route)

    def call(self, method: str, url: str, route: str, **kwargs) -> dict:
        # lazy: HTTP client of the remote engine only
        import requests

        try:
            r = getattr(self.session(url), method)(
                f"{url}{route}", timeout=self.timeouts(), **kwargs
            )
        except requests.Timeout:
            raise CallFailed(
                f"no answer within {self.cfg.request_timeout_s:g} s "
                f"(rollout.remote.request_timeout_s)"
            ) from None
        except OSError as e:
            raise CallFailed(short(e)) from None
        except ServerProofError as e:
            raise CallFailed(
                f"did not prove the job's secret, nothing sent: {e}", retry=False
            ) from None
        if r.status_code != 200:
            body = json_object(r)
            reason = body.get("error", body.get("detail", r.text))
            if isinstance(reason, dict):  # vLLM's ErrorResponse
                reason = reason.get("message", reason)
            # A bad request fails the same way everywhere; a server error may pass on another try.
            raise CallFailed(f"HTTP {r.status_code}: {short(reason)}", retry=r.status_code >= 500)
        return json_object(r)

    def rpc(self, url: str, method: str, *args) -> object:
        """``collective_rpc(method, *args)`` on the server's workers (string arguments); the
        first worker's result (every worker of a TP group runs it)."""
        answer = self.post(
            url, "/collective_rpc", json={"method": method, "args": [str(a) for a in args]}
        )
        return answer["results"][0]

    def close(self) -> None:
        for s in self._sessions.values():
            s.close()
        self._sessions = {}


def on_all(servers: list[str], what: str, fn) -> list:
    """``fn(url)`` for every server of ``servers`` concurrently, each retried once; one-line error
    (naming the server and ``what``, and the first failure when the retry's differs: a weight
    bucket after the first one fails its retry for the first failure's sake) otherwise."""

    def call(url):
        try:
            return fn(url)
        except CallFailed as first:
            if not first.retry:
                raise RolloutServerError(f"rollout server {url}: {what} failed: {first}") from None
            try:
                return fn(url)
            except CallFailed as e:
                before = f" (the first time: {first})" if str(first) != str(e) else ""
                raise RolloutServerError(
                    f"rollout server {url}: {what} failed twice: {e}{before}"
                ) from None

    with ThreadPoolExecutor(len(servers)) as pool:
        return list(pool.map(call, servers))


def json_object(r) -> dict:
    """A response's JSON object, or {} (not JSON, not an object)."""
    try:
        body = r.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def short(e) -> str:
    """One line of an exception or response text, without urllib3's nested reprs."""
    text = " ".join(str(e).split())
    return text if len(text) <= 200 else text[:200] + "..."
