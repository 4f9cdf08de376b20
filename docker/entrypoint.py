"""The image's entrypoint: `<role> [flags...]` runs one radixmesh service as the container's main process.

  router | tokenizer | worker (colocated) | prefill | decode | kvstore | serve (the whole mesh in one container)

Flags pass through unchanged. Inside a container a service must be reachable from outside it and at a known port,
so unless the command line (or RADIXMESH_HOST / RADIXMESH_PORT, or a --config file) says otherwise, the service
listens on 0.0.0.0 at its role's port: 30000 for the router and `serve` (HTTP), 50051 for the gRPC services. The
image's health check (python -m radixmesh.services.common.healthcheck --auto) probes that same address. Anything
that is not a role runs as a command (`bash`, `python -c ...`)."""

from __future__ import annotations

import os
import sys
from typing import NamedTuple


class Role(NamedTuple):
    module: str  # run as `python -m <module>`
    fixed: tuple[str, ...]  # arguments before the user's (the user's own flags still win)
    port: int  # the container port it listens on by default
    help: str


HTTP_PORT = 30000
GRPC_PORT = 50051
ROLES = {
    "router": Role("radixmesh.services.router", (), HTTP_PORT,
                   "the public HTTP (OpenAI, SGLang) and gRPC endpoint"),
    "tokenizer": Role("radixmesh.services.tokenizer", (), GRPC_PORT,
                      "chat templates, tokenization, detokenization"),
    "worker": Role("radixmesh.services.worker", ("--disaggregation-mode", "null"), GRPC_PORT,
                   "a colocated worker: prefill and decode in one engine"),
    "prefill": Role("radixmesh.services.prefill", (), GRPC_PORT, "a prefill worker (PD disaggregation)"),
    "decode": Role("radixmesh.services.worker", ("--disaggregation-mode", "decode"), GRPC_PORT,
                   "a decode worker (PD disaggregation)"),
    "kvstore": Role("radixmesh.services.kvstore", (), GRPC_PORT,
                    "the shared L3 KV page store and global prefix index"),
    "serve": Role("radixmesh.services.launch", ("serve",), HTTP_PORT,
                  "tokenizer, workers and router in this one container"),
}


def _given(args: list[str], name: str, environ: dict) -> bool:
    flag = "--" + name
    return (any(a == flag or a.startswith(flag + "=") for a in args) or f"RADIXMESH_{name.upper()}" in environ
            or any(a == "--config" or a.startswith("--config=") for a in args))


def command(argv: list[str], environ: dict) -> list[str]:
    """The argv to exec for the entrypoint's arguments `argv` (role first)."""
    if not argv or argv[0] in ("-h", "--help", "help"):
        return []
    role = ROLES.get(argv[0])
    if role is None:
        return argv  # not a role: a command
    args = argv[1:]
    if any(a in ("-h", "--help") for a in args):
        return [sys.executable, "-m", role.module, *role.fixed, *args]
    defaults = [] if _given(args, "host", environ) else ["--host", "0.0.0.0"]
    defaults += [] if _given(args, "port", environ) else ["--port", str(role.port)]
    return [sys.executable, "-m", role.module, *role.fixed, *defaults, *args]


def usage() -> str:
    width = max(map(len, ROLES))
    lines = [f"  {name:<{width}}  {r.help} (python -m {r.module}, port {r.port})" for name, r in ROLES.items()]
    return "usage: <role> [flags...]   (<role> --help lists its flags)\nroles:\n" + "\n".join(lines)


def main() -> None:
    argv = command(sys.argv[1:], dict(os.environ))
    if not argv:
        print(usage())
        sys.exit(0 if sys.argv[1:] else 2)
    sys.stdout.flush()
    try:
        os.execvp(argv[0], argv)  # the service becomes the container's main process and gets its signals
    except OSError as e:
        sys.exit(f"cannot run {argv[0]}: {e}\n{usage()}")


if __name__ == "__main__":
    main()
