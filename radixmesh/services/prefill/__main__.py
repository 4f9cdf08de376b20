"""`python -m radixmesh.services.prefill --model-path PATH --port N`: a prefill worker (--disaggregation-mode prefill).
It prefills prompts the router pairs with a decode worker and writes their KV pages into that worker's memory; the
decode worker finds it through the bootstrap port (--disaggregation-bootstrap-port). See services/prefill/bootstrap."""

from __future__ import annotations

import sys

from radixmesh.services.worker.__main__ import main as worker_main


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    # Given first, so a --disaggregation-mode on the command line still wins.
    worker_main(["--disaggregation-mode", "prefill", *argv], description="radixmesh prefill worker")


if __name__ == "__main__":
    main()
