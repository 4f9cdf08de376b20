"""A draft tree's sampled verify (engine.speculative.tree_verify) keeps the target's distribution: over many rows
with the same tree and target logits, the first output token follows p at the root, and the second, given a first
token the tree holds, follows p at that token's node. Greedy rows keep exactly the argmax path, and the kept path's
KV lands at the consecutive positions."""

from __future__ import annotations

import torch

from radixmesh.engine.cache.kv_pool import KVPool
from radixmesh.engine.sampling.sampler import SamplingBatch
from radixmesh.engine.speculative.tree_verify import TreeLayout, move_path_kv, verify_tree

VOCAB = 6
# node tokens and parents (node i + 1): root -> {2, 4}; node 1 (token 2) -> {1, 5}; node 2 (token 4) -> {0}
TOKENS, PARENTS = [2, 4, 1, 5, 0], [0, 0, 1, 1, 2]
WIDTH = 6


def _sampling(rows: int, greedy: bool) -> SamplingBatch:
    return SamplingBatch(temperatures=torch.ones(rows), greedy=torch.full((rows,), greedy), all_greedy=greedy,
                         top_k=None, top_p=None, min_p=None, penalty_rows=None, penalties=None, masked=None,
                         bias=None, seeds=None, steps=None, want_logprobs=False, top_logprobs_k=0,
                         logprob_token_ids=None, grammar=None)


def _logits(gen: torch.Generator) -> torch.Tensor:
    return torch.randn(WIDTH, VOCAB, generator=gen) * 1.5  # node j's row: p after the path to node j


def test_sampled_tree_verify_keeps_the_target_distribution():
    gen = torch.Generator().manual_seed(0)
    node_logits = _logits(gen)
    batch = 40000
    layout = TreeLayout.build([(TOKENS, PARENTS)] * batch, WIDTH, torch.device("cpu"))
    logits = node_logits.repeat(batch, 1)
    out = verify_tree(logits, layout, _sampling(batch * WIDTH, False), gen).verified
    p = node_logits.softmax(-1)
    first = out.tokens[:, 0]
    freq = torch.bincount(first, minlength=VOCAB).float() / batch
    assert (freq - p[0]).abs().sum() < 0.03, (freq, p[0])
    for token, node in ((2, 1), (4, 2)):  # second token after a kept node follows that node's p
        rows = (first == token) & (out.accepted >= 1)
        second = out.tokens[rows, 1]
        freq = torch.bincount(second, minlength=VOCAB).float() / rows.sum()
        assert (freq - p[node]).abs().sum() < 0.06, (token, freq, p[node])
    assert bool(((out.accepted >= 1) == ((first == 2) | (first == 4))).all())
    assert bool((out.accepted == 2).any())


def test_greedy_tree_verify_keeps_the_argmax_path_and_moves_its_kv():
    gen = torch.Generator().manual_seed(1)
    logits = _logits(gen)
    logits[0, 4] = 9.0  # root's argmax: token 4 (node 2, the second child)
    logits[2, 0] = 9.0  # node 2's argmax: token 0 (node 5)
    layout = TreeLayout.build([(TOKENS, PARENTS)], WIDTH, torch.device("cpu"))
    res = verify_tree(logits, layout, _sampling(WIDTH, True), None)
    assert res.verified.accepted.tolist() == [2]
    assert res.verified.tokens[0, :3].tolist() == [4, 0, int(logits[5].argmax())]
    assert res.path[0].tolist()[:3] == [0, 2, 5]
    pool = KVPool(16, 1, 2, 1, 4, torch.float32, torch.device("cpu"))
    for buf in pool.buffers():
        buf.copy_(torch.randn(buf.shape, generator=gen))
    slots = torch.tensor([[3, 7, 8, 9, 10, 11]])
    before = [buf.clone() for buf in pool.buffers()]
    move_path_kv(pool, slots, res.path, res.verified.accepted)
    for old, buf in zip(before, pool.buffers()):
        assert torch.equal(buf[7], old[8]) and torch.equal(buf[8], old[11])  # nodes 2 and 5 to positions 1, 2
        assert torch.equal(buf[3], old[3]) and torch.equal(buf[9:11], old[9:11])
