# A stand-in for docker.io/library/redis where no registry is reachable: the same server, Debian's package.
ARG BASE_IMAGE=localhost/debian-py:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/*
CMD ["redis-server", "--protected-mode", "no"]
