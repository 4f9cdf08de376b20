# A stand-in for docker.io/prom/prometheus where no registry is reachable: the same program, Debian's package.
ARG BASE_IMAGE=localhost/debian-py:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus \
    && rm -rf /var/lib/apt/lists/* && mkdir -p /prometheus
ENTRYPOINT ["/usr/bin/prometheus"]
