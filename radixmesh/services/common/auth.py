"""Authentication between the mesh's own services (tokenizer, workers, the prefill bootstrap port, the kvstore).

- A shared internal token: every internal gRPC server refuses a call whose metadata lacks it (UNAUTHENTICATED,
  compared in constant time), except the standard grpc.health.v1 Health service, which reveals nothing and which
  Kubernetes' gRPC probes must reach without metadata. Every internal client sends it as `radixmesh-internal-token`.
  Several tokens may be given (comma- or newline-separated): the first is sent, each is accepted, so a token can be
  rotated by rolling restarts without a window where two services disagree.
- Mutual TLS: servers listen with TLS and require a client certificate signed by --tls-ca; clients present the same
  service certificate and verify the server's against --tls-ca (and --tls-server-name, when the addresses dialled,
  such as pod IPs, are not in the certificates).

`setup(settings)` once at start-up, before channels and servers are made, makes this process's clients
(services.common.auth_channel) and internal servers (services.common.server.GrpcService) use them. Without it
(servicers built in-process by tests) nothing is required and nothing is sent. The router's public HTTP and gRPC
APIs are not internal: they keep their own API keys."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

TOKEN_KEY = "radixmesh-internal-token"  # gRPC metadata key (lower case, as gRPC requires)
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)  # methods answered without the token
TOKEN_ENV = "RADIXMESH_INTERNAL_TOKEN"
_TOKEN = re.compile(r"^[\x21-\x7e]+$")  # printable ASCII without spaces: valid gRPC metadata
_REFUSED = "this service needs the mesh's internal token (--internal-token or RADIXMESH_INTERNAL_TOKEN)"
_MAX_LOGGED_PEERS = 4096


@dataclass(frozen=True, slots=True)
class InternalAuthSettings:
    """Flags every service takes (pass it to parse_settings as an extra class)."""

    internal_token: str | None = field(default=None, repr=False, metadata={
        "help": "shared secret of the mesh's internal gRPC calls: servers refuse calls without it, clients send it "
                "(several, comma-separated: the first is sent, each is accepted); better from the environment "
                "(RADIXMESH_INTERNAL_TOKEN), which `ps` does not show"})
    internal_token_file: str | None = field(default=None, metadata={
        "help": "a file holding the internal token(s), one per line (e.g. a mounted Kubernetes Secret)"})
    tls_cert: str | None = field(default=None, metadata={
        "help": "PEM certificate of this service, presented as server and as client (mutual TLS between services; "
                "needs --tls-key and --tls-ca)"})
    tls_key: str | None = field(default=None, metadata={"help": "PEM private key of --tls-cert"})
    tls_ca: str | None = field(default=None, metadata={
        "help": "PEM CA certificate(s) that sign the mesh's certificates (several in one file during a rotation)"})
    tls_server_name: str | None = field(default=None, metadata={
        "help": "the name clients expect in servers' certificates (default: the host dialled); for meshes whose "
                "services are dialled by addresses the certificates cannot list, such as pod IPs"})

    def __post_init__(self) -> None:
        given = [bool(self.tls_cert), bool(self.tls_key), bool(self.tls_ca)]
        if any(given) and not all(given):
            raise ValueError("--tls-cert, --tls-key and --tls-ca go together")
        if self.tls_server_name and not self.tls_cert:
            raise ValueError("--tls-server-name needs --tls-cert, --tls-key and --tls-ca")
        if self.internal_token and self.internal_token_file:
            raise ValueError("give the internal token by --internal-token (RADIXMESH_INTERNAL_TOKEN) or by "
                             "--internal-token-file, not both")


def parse_tokens(raw: str, where: str = "--internal-token") -> tuple[str, ...]:
    """Tokens separated by commas or line breaks (blank ones dropped); ValueError for none or a malformed one."""
    tokens = tuple(t.strip() for t in re.split(r"[,\r\n]+", raw) if t.strip())
    if not tokens:
        raise ValueError(f"{where} holds no token")
    for t in tokens:
        if not _TOKEN.match(t):
            raise ValueError(f"{where}: a token must be printable ASCII without spaces")
    return tokens


def _read(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if not data.strip():
        raise ValueError(f"{what} {path} is empty")
    return data


@dataclass(frozen=True, slots=True)
class InternalAuth:
    """The resolved credentials: tokens (the first is sent, each accepted) and PEM bytes (all None: no TLS)."""

    tokens: tuple[str, ...] = ()
    cert: bytes | None = None
    key: bytes | None = field(default=None, repr=False)
    ca: bytes | None = None
    server_name: str | None = None

    @classmethod
    def from_settings(cls, settings: InternalAuthSettings) -> InternalAuth:
        """Reads the files named; ValueError (naming the flag or file) when one is missing, empty or malformed."""
        tokens: tuple[str, ...] = ()
        if settings.internal_token:
            tokens = parse_tokens(settings.internal_token)
        elif settings.internal_token_file:
            raw = _read(settings.internal_token_file, "--internal-token-file")
            tokens = parse_tokens(raw.decode("ascii", "replace"), settings.internal_token_file)
        if not settings.tls_cert:
            return cls(tokens)
        cert, key, ca = (_read(p, what) for p, what in ((settings.tls_cert, "--tls-cert"),
                                                        (settings.tls_key, "--tls-key"), (settings.tls_ca, "--tls-ca")))
        for data, what in ((cert, "--tls-cert"), (key, "--tls-key"), (ca, "--tls-ca")):
            if b"-----BEGIN" not in data:
                raise ValueError(f"{what} is not PEM")
        return cls(tokens, cert, key, ca, settings.tls_server_name)

    @property
    def tls(self) -> bool:
        return self.cert is not None

    @property
    def token(self) -> str | None:
        """The token clients send."""
        return self.tokens[0] if self.tokens else None

    def describe(self) -> str:
        token = f"internal token on ({len(self.tokens)} accepted)" if self.tokens else "internal token off"
        return f"{token}, mutual TLS {'on' if self.tls else 'off'}"

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


_current = InternalAuth()


def configure(auth: InternalAuth) -> None:
    """Make `auth` this process's: its clients send it, its internal servers require it."""
    global _current
    _current = auth


def current() -> InternalAuth:
    return _current


def setup(settings: InternalAuthSettings | dict) -> InternalAuth:
    """Resolve the flags (a settings object or its keyword arguments) and configure(); exits with the reason when
    a file cannot be read or a flag is wrong."""
    try:
        if isinstance(settings, dict):
            settings = InternalAuthSettings(**settings)
        auth = InternalAuth.from_settings(settings)
    except ValueError as e:
        raise SystemExit(f"internal authentication: {e}") from None
    configure(auth)
    log.info("%s", auth.describe())
    return auth


def add_port(server: grpc.aio.Server, address: str, auth: InternalAuth | None = None) -> int:
    """Listen on `address`: with TLS (client certificates required) when `auth` (default: this process's) has it."""
    auth = auth or _current
    if auth.tls:
        return server.add_secure_port(address, auth.server_credentials())
    return server.add_insecure_port(address)


def server_interceptors(auth: InternalAuth | None = None) -> list:
    """The interceptors an internal server puts first: none without a token."""
    auth = auth or _current
    return [TokenInterceptor(auth.tokens)] if auth.tokens else []


async def _first_message(requests, timeout_s: float = 1.0) -> None:
    """Waits (briefly) for a streaming call's first request message, unparsed. A status sent while the client's
    first message is still on its way fails that send, and grpc's Python client then reports the call as INTERNAL
    ("Failed execute_batch: SendMessageOperation") instead of the status the server sent: a refused client of
    GenerateStream or TokenizeStream would not learn that its token was wrong."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(timeout_s):
            await anext(aiter(requests), None)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls (but the health service's) whose metadata lacks one of `tokens`: UNAUTHENTICATED. The first
    refusal from each peer host is logged at WARNING, without any token's value."""

    def __init__(self, tokens: tuple[str, ...]):
        self._tokens = tuple(t.encode() for t in tokens)
        self._logged: set[str] = set()

    def _verdict(self, metadata) -> str | None:
        """None when a valid token came; else why not."""
        for key, value in metadata or ():
            if key == TOKEN_KEY:
                given = value.encode() if isinstance(value, str) else bytes(value)
                ok = False
                for token in self._tokens:  # every one compared, so the time taken tells nothing
                    ok |= hmac.compare_digest(given, token)
                return None if ok else "a wrong internal token"
        return "no internal token"

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(OPEN_PREFIXES):
            return await continuation(handler_call_details)
        reason = self._verdict(handler_call_details.invocation_metadata)
        handler = await continuation(handler_call_details)
        if reason is None or handler is None:
            return handler
        return self._refusal(handler, method, reason)

    def _note(self, peer: str, method: str, reason: str) -> None:
        host = peer.rpartition(":")[0] or peer  # "ipv4:10.0.0.5:41234" -> "ipv4:10.0.0.5"
        if host in self._logged or len(self._logged) >= _MAX_LOGGED_PEERS:
            return
        self._logged.add(host)
        log.warning("refused %s from %s: %s (further refusals from this peer are not logged)", method, host, reason)

    def _refusal(self, handler: grpc.RpcMethodHandler, method: str, reason: str) -> grpc.RpcMethodHandler:
        streamed = handler.stream_unary is not None or handler.stream_stream is not None

        async def refuse(request, context):  # a coroutine serves every call type in grpc.aio
            self._note(context.peer(), method, reason)
            if streamed:  # see _first_message
                await _first_message(request)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSED)

        args = (None, handler.response_serializer)  # requests refused are not parsed
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(refuse, *args)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(refuse, *args)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(refuse, *args)
        return grpc.stream_stream_rpc_method_handler(refuse, *args)
