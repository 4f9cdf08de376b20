"""benchmarks.profile_decode's per-kernel shares of a step: a kernel's share is its end minus the previous kernel's
end (its own duration, under programmatic dependent launch, includes waiting for the kernel before)."""

from __future__ import annotations

from radixmesh.benchmarks.profile_decode import shares


def test_a_share_is_the_time_from_the_previous_end_to_this_end():
    # two layers of norm -> product, each product launched early and waiting: its duration overlaps the norm's
    timeline = [("norm", 0.0, 1.5), ("product", 0.5, 9.0), ("norm", 9.5, 1.0), ("product", 9.7, 10.3),
                ("head", 20.0, 4.0)]
    got = shares(timeline, least=1)
    assert got["product"] == {"count": 2, "median_us": 8.75, "sum_us": 17.5}  # 9.5 - 1.5 and 20.0 - 10.5
    assert got["norm"] == {"count": 1, "median_us": 1.0, "sum_us": 1.0}  # the first kernel has no share
    assert got["head"]["sum_us"] == 4.0 and list(got) == ["product", "head", "norm"]  # largest sum first
    assert "norm" not in shares(timeline, least=2) and "product" in shares(timeline, least=2)
