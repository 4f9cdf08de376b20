"""Where tensor-parallel ranks run: node and GPU of every rank (engine.distributed), the GPUs `radixmesh serve
--tp --dp-size` gives each worker (services.launch.plan), and the rendezvous address's form."""

from __future__ import annotations

import pytest

from radixmesh.engine.distributed import local_ranks, rank_device, split_addr
from radixmesh.services.launch import LaunchSettings, plan


def test_ranks_are_numbered_node_by_node():
    assert list(local_ranks(8, 2, 0)) == [0, 1, 2, 3] and list(local_ranks(8, 2, 1)) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="divisible by nnodes"):
        local_ranks(6, 4, 0)
    with pytest.raises(ValueError, match="node_rank"):
        local_ranks(4, 2, 2)


def test_each_rank_gets_base_plus_local_rank_times_step():
    assert [rank_device("cuda", r, 4, 1, 0, 1) for r in range(4)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    # two nodes of two ranks, from GPU 2, every other GPU: the same GPUs on each node
    assert [rank_device("cuda", r, 4, 2, 2, 2) for r in range(4)] == ["cuda:2", "cuda:4", "cuda:2", "cuda:4"]
    assert rank_device("cpu", 3, 4, 1, 0, 1) == "cpu"


def test_the_rendezvous_address_is_host_and_port():
    assert split_addr("10.0.0.5:29500") == ("10.0.0.5", 29500)
    assert split_addr("[::1]:29500") == ("::1", 29500)
    for bad in (None, "", "host"):
        with pytest.raises(ValueError, match="host:port"):
            split_addr(bad)


def test_data_parallel_workers_take_gpus_of_their_own():
    """--tp 2 --dp-size 3: worker i starts at GPU 2i; --worker-gpu-ids leaves the GPU choice to the environment."""
    children = plan(LaunchSettings(num_workers=3), {"model_path": "m", "tp_size": 2})
    workers = [c for c in children if c.name.startswith("worker")]
    bases = [c.argv[c.argv.index("--base-gpu-id") + 1] for c in workers]
    assert bases == ["0", "2", "4"]
    assert all("--tp-size" in c.argv for c in workers)
    pinned = plan(LaunchSettings(num_workers=2, worker_gpu_ids=("0,1", "2,3")), {"model_path": "m", "tp_size": 2})
    workers = [c for c in pinned if c.name.startswith("worker")]
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in workers] == ["0,1", "2,3"]
    assert all("--base-gpu-id" not in c.argv for c in workers)
