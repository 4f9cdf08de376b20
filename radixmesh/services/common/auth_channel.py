"""Channels to the mesh's internal services with this process's credentials (services.common.auth): TLS with the
service certificate when it has one, and the internal token on every call when it has one.

The token rides on each call's metadata. grpc.aio puts every call of a channel with client interceptors on a slower
path (a task per call, a wrapper per streamed message), so the async channel attaches it in a thin wrapper around
the channel's multi-callables instead: one extra function call per call, nothing per message."""

from __future__ import annotations

from typing import Sequence

import grpc

from radixmesh.services.common import auth as auth_mod
from radixmesh.services.common.auth import TOKEN_KEY, InternalAuth


def _target(url: str) -> str:
    return url.removeprefix("grpc://")


def aio_channel(url: str, options: Sequence = (), interceptors: Sequence | None = None,
                auth: InternalAuth | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel to `host:port` with `auth` (default: this process's) applied."""
    auth = auth or auth_mod.current()
    if auth.tls:
        channel = grpc.aio.secure_channel(_target(url), auth.channel_credentials(),
                                          options=[*options, *auth.channel_options()], interceptors=interceptors)
    else:
        channel = grpc.aio.insecure_channel(_target(url), options=list(options), interceptors=interceptors)
    return TokenChannel(channel, auth.token) if auth.tokens else channel


def sync_channel(url: str, options: Sequence = (), auth: InternalAuth | None = None) -> grpc.Channel:
    """A blocking channel to `host:port` with `auth` (default: this process's) applied."""
    auth = auth or auth_mod.current()
    if auth.tls:
        channel = grpc.secure_channel(_target(url), auth.channel_credentials(),
                                      options=[*options, *auth.channel_options()])
    else:
        channel = grpc.insecure_channel(_target(url), options=list(options))
    return grpc.intercept_channel(channel, _SyncToken(auth.token)) if auth.tokens else channel


def with_token(metadata, token_metadata: grpc.aio.Metadata) -> grpc.aio.Metadata:
    """The call's metadata plus the token (a grpc.aio.Metadata: grpc.aio takes it as it is)."""
    if not metadata:
        return token_metadata
    return grpc.aio.Metadata(*metadata, *token_metadata)


class _WithToken:
    """A multi-callable whose calls carry the token; everything else passes through."""

    __slots__ = ("_inner", "_metadata")

    def __init__(self, inner, token_metadata: grpc.aio.Metadata):
        self._inner = inner
        self._metadata = token_metadata

    def __call__(self, *args, **kwargs):
        kwargs["metadata"] = with_token(kwargs.get("metadata"), self._metadata)
        return self._inner(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


class TokenChannel(grpc.aio.Channel):
    """A grpc.aio channel whose calls carry the internal token (stubs take it like any channel). Callers pass
    metadata by keyword, as the generated stubs' users do."""

    def __init__(self, inner: grpc.aio.Channel, token: str):
        self._inner = inner
        self._metadata = grpc.aio.Metadata((TOKEN_KEY, token))  # shared by every call: never mutated

    async def __aenter__(self):
        return self

    async def __aexit__(self, exc_type, exc_val, exc_tb):
        await self._inner.close(None)

    async def close(self, grace: float | None = None):
        await self._inner.close(grace)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self._inner.get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self._inner.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self._inner.channel_ready()

    def unary_unary(self, *args, **kwargs):
        return _WithToken(self._inner.unary_unary(*args, **kwargs), self._metadata)

    def unary_stream(self, *args, **kwargs):
        return _WithToken(self._inner.unary_stream(*args, **kwargs), self._metadata)

    def stream_unary(self, *args, **kwargs):
        return _WithToken(self._inner.stream_unary(*args, **kwargs), self._metadata)

    def stream_stream(self, *args, **kwargs):
        return _WithToken(self._inner.stream_stream(*args, **kwargs), self._metadata)


class _SyncToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the token to every call of a blocking channel."""

    def __init__(self, token: str):
        self._pair = (TOKEN_KEY, token)

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(details.method, details.timeout, (*(details.metadata or ()), self._pair),
                            details.credentials, getattr(details, "wait_for_ready", None),
                            getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression
