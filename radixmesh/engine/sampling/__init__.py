from radixmesh.engine.sampling.params import SamplingParams

__all__ = ["SamplingParams"]
