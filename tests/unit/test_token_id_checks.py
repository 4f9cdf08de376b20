"""The checks of token-id lists run without a Python step per id; they accept and refuse exactly what the per-id
checks they replaced did."""

from __future__ import annotations

import pytest

from radixmesh.engine.results import all_ints
from radixmesh.services.router.request_fields import INT32_MAX, are_token_ids, is_token_id

CASES = [[], [0], [1, 2, 3], [0, INT32_MAX], [INT32_MAX + 1], [-1, 5], [1, True], [False], [1.0], [1, "2"], [None],
         [[1]], [1, 2, 2 ** 70], list(range(5000)), [7] * 3000 + [-3]]


@pytest.mark.parametrize("values", CASES, ids=range(len(CASES)))
def test_the_same_verdicts_as_per_id_checks(values):
    assert all_ints(values) == all(isinstance(t, int) and not isinstance(t, bool) for t in values)
    assert are_token_ids(values) == all(is_token_id(t) for t in values)
