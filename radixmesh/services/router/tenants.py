"""Which tenant namespace of the KV cache a request runs under, and whether its API key is accepted.

Sources, strongest first:
1. `--api-key-tenants KEY=TENANT ...`: each KEY is a valid API key (besides `--api-key`) and selects TENANT.
2. `--tenant-header NAME` (off by default): a header (gRPC metadata: the name lower-cased) carrying the tenant. It is
   trusted as is, so use it only behind a gateway that authenticates clients and sets (or strips) the header. A
   request whose key names a tenant ignores the header; a request with the plain `--api-key` may use it.
3. Otherwise the shared namespace "".

With no key configured at all, every request is accepted. Keys are compared in constant time, against every
configured key (no early exit), so timing reveals neither a key nor which one matched."""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass

SHARED = ""
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_HEADER = re.compile(r"[A-Za-z0-9-]{1,128}")
RULE = "a tenant name is 1-64 characters of A-Z, a-z, 0-9, '.', '_' and '-'"


class AuthError(Exception):
    """The request carries no accepted API key (HTTP 401, gRPC UNAUTHENTICATED)."""


class TenantError(ValueError):
    """The request names a tenant that is not a valid name (HTTP 400, gRPC INVALID_ARGUMENT)."""


def validate_tenant(name: str, source: str) -> str:
    """`name` if it is a valid tenant name, else TenantError naming `source` (where the name came from)."""
    if not _NAME.fullmatch(name):
        shown = name if len(name) <= 80 else name[:77] + "..."
        raise TenantError(f"invalid tenant {shown!r} in {source}: {RULE}")
    return name


def parse_key_tenants(pairs: tuple[str, ...], api_key: str | None) -> dict[str, str]:
    """`KEY=TENANT` pairs -> {key: tenant}; ValueError (a start-up error) for a malformed pair, an invalid tenant, a
    key listed twice, or a key equal to --api-key (which maps to the shared namespace)."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, tenant = pair.rpartition("=")
        if not sep or not key:
            raise ValueError("--api-key-tenants entries must be KEY=TENANT, got one without a key or '='")
        validate_tenant(tenant, "--api-key-tenants")
        if key in out:
            raise ValueError("--api-key-tenants lists the same key twice")
        if api_key is not None and key == api_key:
            raise ValueError("--api-key-tenants lists the --api-key itself (it selects the shared namespace)")
        out[key] = tenant
    return out


def validate_header_name(name: str) -> str:
    if not _HEADER.fullmatch(name):
        raise ValueError(f"--tenant-header must be an HTTP header name (letters, digits and '-'), got {name!r}")
    return name


@dataclass(frozen=True, slots=True)
class TenantResolver:
    """API-key check plus tenant choice, shared by the HTTP middleware and the public gRPC API."""

    keys: tuple[tuple[bytes, str], ...] = ()  # (b"Bearer <key>", its tenant): --api-key first, tenant ""
    header: str | None = None  # as configured; HTTP headers are case-insensitive, gRPC metadata lower-case

    @classmethod
    def from_settings(cls, settings) -> "TenantResolver":
        keys = [] if settings.api_key is None else [(settings.api_key, SHARED)]
        keys += parse_key_tenants(settings.api_key_tenants, settings.api_key).items()
        header = validate_header_name(settings.tenant_header) if settings.tenant_header else None
        return cls(tuple((f"Bearer {k}".encode("utf-8", "surrogateescape"), t) for k, t in keys), header)

    @property
    def metadata_key(self) -> str | None:
        """The header's gRPC metadata key."""
        return self.header.lower() if self.header else None

    def resolve(self, authorization: str | None, header_value: str | None) -> str:
        """The request's tenant. `authorization` is the Authorization header (`Bearer <key>`), `header_value` the
        tenant header's value (None when absent). AuthError or TenantError when the request must be refused."""
        if self.keys:
            given = (authorization or "").encode("utf-8", "surrogateescape")
            matched: str | None = None
            for expected, tenant in self.keys:
                if hmac.compare_digest(given, expected):
                    matched = tenant
            if matched is None:
                raise AuthError("Invalid API key: pass it as 'Authorization: Bearer <key>'")
            if matched:
                return matched
        if self.header is not None and header_value is not None:
            return validate_tenant(header_value, f"header {self.header}")
        return SHARED
