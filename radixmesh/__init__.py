"""radixmesh: LLM serving as gRPC microservices.

Subpackages, one way down: `radixmesh.benchmarks` -> `radixmesh.services` -> `radixmesh.engine` ->
`radixmesh.kernels`. `radixmesh.v1` holds the protobuf stubs generated from `protos/radixmesh/v1` (`make protos`).
"""
