"""The tile files shipped in radixmesh/kernels/configs (written on a GPU by benchmarks.tune_moe and
benchmarks.tune_fp8_gemm, read by the kernels at run time): each is named for the GPU it says it was tuned on, and
every entry reads back as a launch the kernels accept, so a hand edit or a truncated copy fails here rather than
in a user's first forward on that GPU."""

from __future__ import annotations

import json

import pytest

from radixmesh.kernels import fp8_gemm, moe
from radixmesh.kernels.runtime import CONFIG_DIR, config_file

FILES = sorted(CONFIG_DIR.glob("*.json"))


def _power_of_two(v: int) -> bool:
    return isinstance(v, int) and v > 0 and v & (v - 1) == 0


def test_configs_are_shipped():
    assert any(f.name.startswith("moe-") for f in FILES)


@pytest.mark.parametrize("path", FILES, ids=[f.name for f in FILES])
def test_a_shipped_tile_file_names_its_gpu_and_every_entry_is_a_launch(path):
    doc = json.loads(path.read_text())
    kind = next(k for k in ("moe", "fp8-gemm") if path.name.startswith(k + "-"))
    assert path == config_file(kind, doc["device"], CONFIG_DIR)
    assert doc["shapes"]
    if kind == "moe":
        for shape, entries in doc["shapes"].items():
            assert shape.startswith("experts=")
            for tokens in (1, *(int(t) for t in entries), 1 << 20):
                block_m, up, down = moe.pick(entries, tokens)
                assert _power_of_two(block_m) and block_m >= 16
                for tiles in (up, down):
                    assert all(_power_of_two(v) for v in (tiles.block_n, tiles.block_k, tiles.num_warps))
                    assert 1 <= tiles.num_stages <= 8
    else:
        tuned = fp8_gemm.read_tuned(path)
        assert tuned
        for (n, k, bn, bk, bucket), tiles in tuned.items():
            assert n > 0 and k > 0 and _power_of_two(bn) and _power_of_two(bk)
            assert bucket in fp8_gemm.CANDIDATES and tuple(tiles) in fp8_gemm.CANDIDATES[bucket]
