"""Draft trees (--speculative-eagle-topk K > 1 with --speculative-num-draft-tokens N): an EAGLE/EAGLE-3 head drafts a
tree, the target verifies every node in one forward under a tree mask, keeps the longest accepted path and moves its
KV into place.

- Greedy outputs equal transformers' for EAGLE and EAGLE-3 heads, several K, steps and N, pages of 1 and 4, the
  torch_native and Triton (interpreter) backends, batches with and without shared prefixes (asked twice: the second
  time from the prefix cache), and no KV leaks.
- Random heads draft mostly wrong, so an oracle head (its logits rank the true next token second, behind a wrong
  one) makes long paths through later siblings: outputs stay exact, the tree keeps drafts where a chain with the same
  head keeps none.
- Every tree the engine drafts equals the one a reference builds from the head recomputed with transformers' modules
  (tests/parity/test_speculative_eagle.ReferenceHead), from the target's hidden states, along each node's path.
"""

from __future__ import annotations

import pytest
import torch

from radixmesh.engine.batch import ForwardMode
from tests.conftest import model_path
from tests.engine_utils import parity_prompts, running_engine
from tests.parity.test_speculative_eagle import ReferenceHead, write_head
from tests.reference import hf_greedy

NAME = "tiny-llama"
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("eagle_tree")
    target = model_path(NAME)
    return {"EAGLE": write_head(root / "eagle", target, "eagle"),
            "EAGLE3": write_head(root / "eagle3", target, "eagle3", seed=1)}


def tree_engine(path, heads, algorithm, topk, steps, n, **kw):
    return running_engine(path, chunked_prefill_size=64, speculative_algorithm=algorithm,
                          speculative_draft_model_path=heads[algorithm], speculative_num_steps=steps,
                          speculative_eagle_topk=topk, speculative_num_draft_tokens=n, **kw)


@pytest.mark.parametrize("algorithm,topk,steps,n,page", [
    ("EAGLE", 2, 3, 6, 1), ("EAGLE", 4, 4, 12, 4), ("EAGLE3", 3, 2, 8, 4), ("EAGLE3", 4, 3, 16, 1),
    ("EAGLE", 16, 5, 20, 4),  # 64 scratch slots: the last frontier's bits reach the sign bit (once an OverflowError)
])
def test_trees_are_token_exact_through_shared_prefixes(algorithm, topk, steps, n, page, heads):
    path = model_path(NAME)
    prompts = parity_prompts(path)
    refs = hf_greedy(path, prompts, 10)
    with tree_engine(path, heads, algorithm, topk, steps, n, page_size=page) as llm:
        first = llm.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 10})
        again = llm.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 10})
        one = [llm.generate(input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 10}) for p in prompts[:2]]
    assert [o["output_ids"] for o in first] == refs == [o["output_ids"] for o in again]
    assert [o["output_ids"] for o in one] == refs[:2]
    assert all(o["meta_info"]["cached_tokens"] > 0 for p, o in zip(prompts, again) if len(p) > 2 * page)
    assert sum(o["meta_info"]["spec_draft_token_num"] for o in first) >= (n - 1) * len(prompts)


class Oracle:
    """Replaces the head's logits: at head position t after input token x (token t + 1 of the sequence) the wrong
    token (x * 7 + 3) % vocab ranks first and the reference answer's token t + 2 second, every other token far
    behind. A chain drafts only the wrong ones; a tree whose nodes hold the second-ranked children drafts the
    answers."""

    def __init__(self, runner, sequences: list[list[int]], vocab: int):
        self.next = {}
        for seq in sequences:
            for i in range(1, len(seq) - 1):
                self.next.setdefault((i - 1, seq[i]), seq[i + 1])
        self.vocab = vocab
        self.forward = runner.forward
        runner.forward = self

    def __call__(self, batch):
        self.forward(batch)  # (the head's KV and outputs as without the oracle)
        rows = slice(None) if batch.mode is ForwardMode.DECODE else batch.logits_indices  # a logits row each
        ids, positions = batch.input_ids[rows].tolist(), batch.positions[rows].tolist()
        logits = torch.zeros((len(ids), self.vocab), device=batch.input_ids.device)
        for row, (x, t) in enumerate(zip(ids, positions)):
            wrong = (x * 7 + 3) % self.vocab
            right = self.next.get((t, x), (x + 1) % self.vocab)
            logits[row, wrong] = 20.0
            if right != wrong:
                logits[row, right] = 19.0
        return logits


def _oracle_run(path, heads, prompts, refs, topk, steps, n, **kw):
    with tree_engine(path, heads, "EAGLE", topk, steps, n, **kw) as llm:
        Oracle(llm.scheduler.spec.model.runner, [p + r for p, r in zip(prompts, refs)], 1000)
        outs = llm.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": len(refs[0])})
        stats = llm.scheduler.load()
    assert [o["output_ids"] for o in outs] == refs
    return stats["spec_accepted_tokens"], stats["spec_verify_rows"]


@pytest.mark.parametrize("page,backend", [(1, "torch_native"), (4, "triton")])
def test_second_ranked_paths_are_kept_token_exact_and_beat_the_chain(page, backend, tmp_path_factory):
    """Depth-1 trees (steps 1) hold the chain's draft and more, so at every state they keep at least what it
    keeps; with steps 3 and every candidate in the tree, the second-ranked child of the second-ranked child is a
    node too: paths through later siblings two deep, whose KV moves to the consecutive positions."""
    path = model_path(NAME)
    heads_ = {"EAGLE": write_head_once(path, tmp_path_factory)}
    if backend == "triton":  # (Triton's interpreter is slow: the deep tree alone, on one prompt, for its mask)
        prompts = parity_prompts(path)[2:3]
        refs = hf_greedy(path, prompts, 8)  # (each verify of 11 rows is a tree-masked decode over every layer)
        deep, rows = _oracle_run(path, heads_, prompts, refs, 2, 3, 11, page_size=page, attention_backend=backend)
        assert deep / rows > 1  # paths through second-ranked children kept, their KV moved into place
        return
    prompts = parity_prompts(path)[:3]
    refs = hf_greedy(path, prompts, 24)
    chain, _ = _oracle_run(path, heads_, prompts, refs, 1, 1, 2, page_size=page, attention_backend=backend)
    shallow, _ = _oracle_run(path, heads_, prompts, refs, 2, 1, 3, page_size=page, attention_backend=backend)
    deep, rows = _oracle_run(path, heads_, prompts, refs, 2, 3, 11, page_size=page, attention_backend=backend)
    assert shallow >= chain
    assert deep > shallow > 0
    assert deep / rows > 1.2  # mostly two kept per verify


_HEAD: dict[str, str] = {}


def write_head_once(target: str, tmp_path_factory) -> str:
    """One random EAGLE head for the file's cases, in pytest's own temporary folder (removed with its old runs)."""
    if "EAGLE" not in _HEAD:
        _HEAD["EAGLE"] = write_head(str(tmp_path_factory.mktemp("eagle_oracle")), target, "eagle", seed=3)
    return _HEAD["EAGLE"]


class ReferenceTree:
    """The tree engine.speculative.tree chooses, from ReferenceHead's outputs recomputed along each node's path."""

    def __init__(self, head: ReferenceHead):
        self.head = head

    def _logprobs(self, fill: list[int], path: list[int], memo: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probabilities over the target's vocabulary after `path`, the head's output there)."""
        key = tuple(path)
        if key not in memo:
            head = self.head
            if path:
                self._logprobs(fill, path[:-1], memo)  # (and so every shorter prefix's output)
                feats = torch.cat([memo["feats"], *[memo[tuple(path[:i])][1][None] for i in range(len(path))]])
            else:
                feats = memo["feats"]
            out = head._layer(list(fill[1:]) + path, feats)[-1]
            if head.kind == "eagle":
                logits = head.target.lm_head(out)
            else:
                small = head.norms["final"](out) @ head.w["lm_head.weight"].T
                logits = torch.full((head.target.config.vocab_size,), float("-inf"))
                ids = torch.arange(small.shape[0]) + head.w["d2t"]
                logits[ids] = small
            memo[key] = (torch.log_softmax(logits.float(), -1), out)
        return memo[key]

    @torch.inference_mode()
    def build(self, fill: list[int], topk: int, steps: int, nodes: int) -> tuple[list[int], list[int]]:
        feats = self.head.features(fill[:-1])
        if self.head.kind == "eagle3":
            feats = feats @ self.head.w["fc.weight"].T
        memo = {"feats": feats}
        cands = []  # (score, token, parent candidate, path)
        lp, _ = self._logprobs(fill, [], memo)
        values, ids = lp.topk(topk)
        frontier = []
        for v, t in zip(values.tolist(), ids.tolist()):
            cands.append((v, t, -1, [t]))
            frontier.append(len(cands) - 1)
        for _ in range(1, steps):
            children = []
            for f in frontier:
                score, _, _, fpath = cands[f]
                lp, _ = self._logprobs(fill, fpath, memo)
                values, ids = lp.topk(topk)
                for v, t in zip(values.tolist(), ids.tolist()):
                    cands.append((score + v, t, f, fpath + [t]))
                    children.append(len(cands) - 1)
            frontier = sorted(children, key=lambda c: -cands[c][0])[:topk]
        chosen = sorted(sorted(range(len(cands)), key=lambda c: -cands[c][0])[:nodes])
        number = {c: i + 1 for i, c in enumerate(chosen)}
        return [cands[c][1] for c in chosen], [number.get(cands[c][2], 0) for c in chosen]


@pytest.mark.parametrize("algorithm,topk,steps,n", [("EAGLE", 2, 3, 6), ("EAGLE3", 3, 3, 9)])
def test_every_tree_equals_the_reference_head_s(algorithm, topk, steps, n, heads):
    """One request at a time, twice (the second time its prompt is a prefix-cache hit)."""
    path = model_path(NAME)
    prompt = parity_prompts(path)[1][:40]
    reference = ReferenceTree(ReferenceHead(heads[algorithm], path, algorithm.lower()))
    with tree_engine(path, heads, algorithm, topk, steps, n) as llm:
        tree = llm.scheduler.spec.tree
        seen = []
        propose = tree.propose

        def recording(reqs):
            tokens, parents = propose(reqs)
            seen.extend((list(r.fill_ids), t, p) for r, t, p in zip(reqs, tokens, parents))
            return tokens, parents

        tree.propose = recording
        for _ in range(2):
            out = llm.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 10})
            assert out["meta_info"]["spec_verify_ct"] > 0
    assert len(seen) >= 6
    for fill, tokens, parents in seen:
        assert (tokens, parents) == reference.build(fill, topk, steps, n - 1), len(fill)


def test_sampled_requests_verify_trees_and_leak_nothing(heads):
    """Sampled and greedy requests in one batch (the tree's sampled verify: engine.speculative.tree_verify; its
    distribution is tested in tests/parity/test_speculative_tree_sampling.py); seeded outputs repeat."""
    path = model_path(NAME)
    prompts = parity_prompts(path)[:5]
    refs = hf_greedy(path, prompts[:2], 12)
    sampled = {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 12, "sampling_seed": 7}
    params = [{**GREEDY, "max_new_tokens": 12}] * 2 + [sampled] * 3
    with tree_engine(path, heads, "EAGLE", 3, 2, 7) as llm:
        first = llm.generate(input_ids=prompts, sampling_params=params)
        again = llm.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in first[:2]] == refs
    assert [o["output_ids"] for o in first] == [o["output_ids"] for o in again]
    assert all(len(o["output_ids"]) == 12 for o in first)


@pytest.mark.parametrize("kwargs,message", [
    ({"speculative_algorithm": "NGRAM", "speculative_eagle_topk": 2}, "drafted by an EAGLE head"),
    ({"speculative_algorithm": "EAGLE", "speculative_eagle_topk": 2, "speculative_num_steps": 1,
      "speculative_num_draft_tokens": 4}, "at most 3 draft tokens"),
    ({"speculative_algorithm": "EAGLE", "speculative_eagle_topk": 8, "speculative_num_steps": 10,
      "speculative_num_draft_tokens": 8}, "at most 64 tree slots"),
    ({"speculative_algorithm": "EAGLE", "speculative_eagle_topk": 0}, "integer >= 1"),
])
def test_trees_that_cannot_run_are_refused(kwargs, message, heads):
    from radixmesh.engine import Engine

    draft = {"speculative_draft_model_path": heads["EAGLE"]} if kwargs["speculative_algorithm"] != "NGRAM" else {}
    with pytest.raises(ValueError, match=message):
        Engine(model_path=model_path(NAME), device="cpu", **kwargs, **draft)


def test_flashinfer_decode_takes_trees_but_not_under_windows(heads, tmp_path):
    """FlashInfer verifies trees through each row's page list (tests/gpu: test_attention_backends_cuda.py's tree
    cases, test_speculative_cuda.py's engine), which has no sliding window: a windowed model's trees are refused by
    name there, and taken on Triton."""
    import dataclasses

    from radixmesh.engine.config import EngineArgs, resolve_args
    from radixmesh.engine.model_config import ModelConfig
    from radixmesh.engine.speculative.setup import draft_config
    from tests.sliding_models import build

    windowed = build("mistral", tmp_path / "mistral")
    for path, refused in ((model_path(NAME), False), (windowed, True)):
        head = heads["EAGLE"] if not refused else write_head(str(tmp_path / "head"), windowed, "eagle")
        args = EngineArgs.from_kwargs(path, device="cpu", speculative_algorithm="EAGLE", speculative_eagle_topk=2,
                                      speculative_draft_model_path=head)
        target = ModelConfig.from_path(path)
        resolved = resolve_args(args, target)
        flashinfer = dataclasses.replace(resolved, decode_attention_backend="flashinfer")
        if refused:
            with pytest.raises(ValueError, match="under sliding windows verifies with Triton or torch_native"):
                draft_config(flashinfer, target)
        else:
            assert draft_config(flashinfer, target)[0].decode_attention_backend == "flashinfer"
        draft_config(dataclasses.replace(resolved, decode_attention_backend="triton"), target)


def test_tree_verifies_report_the_plain_engine_s_logprobs(heads):
    """Logprobs (the chosen token's and the top 2) of outputs that came from tree verifies, along the kept path,
    are those of decoding without speculation."""
    path = model_path(NAME)
    prompts = parity_prompts(path)[:3]
    want_lp = {**GREEDY, "max_new_tokens": 12}
    with running_engine(path, chunked_prefill_size=64) as plain:
        want = plain.generate(input_ids=prompts, sampling_params=want_lp, return_logprob=True, top_logprobs_num=2)
    with tree_engine(path, heads, "EAGLE", 3, 3, 8) as llm:
        got = llm.generate(input_ids=prompts, sampling_params=want_lp, return_logprob=True, top_logprobs_num=2)
    for g, w in zip(got, want):
        assert g["output_ids"] == w["output_ids"] and g["meta_info"]["spec_verify_ct"] > 0
        gl, wl = g["meta_info"]["output_token_logprobs"], w["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in gl] == [t for _, t, _ in wl]
        assert [lp for lp, _, _ in gl] == pytest.approx([lp for lp, _, _ in wl], abs=1e-5)
        gt, wt = g["meta_info"]["output_top_logprobs"], w["meta_info"]["output_top_logprobs"]
        assert [[t for _, t, _ in row] for row in gt] == [[t for _, t, _ in row] for row in wt]



@pytest.mark.parametrize("backend", ["torch_native", "triton"])
def test_trees_under_a_sliding_window_keep_deep_paths_token_exact(backend, tmp_path):
    """Mistral with a 12-token window on every layer, an oracle head (deep nodes accepted): outputs equal
    transformers', and most verifies keep more than one token. A tree row's window counts back from its position, not
    its table index (kernels.decode_attention); counted from the index, a row at depth d < its node number would lose
    prefix keys its position shows, and the kept deep paths would differ. A window no longer than the tree is deep is
    refused."""
    from tests.sliding_models import VOCAB, build, prompts as window_prompts

    path = build("mistral", tmp_path / "mistral")
    heads_ = {"EAGLE": write_head(str(tmp_path / "head"), path, "eagle", seed=3)}
    # 81 and 90 tokens, past the window (Triton's interpreter is slow: the longer one alone, for its kernel's window)
    prompts = window_prompts()[4:6] if backend == "torch_native" else window_prompts()[5:6]
    refs = hf_greedy(path, prompts, 12 if backend == "torch_native" else 8)
    with tree_engine(path, heads_, "EAGLE", 2, 3, 11, page_size=4, attention_backend=backend,
                     skip_tokenizer_init=True) as llm:
        Oracle(llm.scheduler.spec.model.runner, [p + r for p, r in zip(prompts, refs)], VOCAB)
        outs = llm.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": len(refs[0])})
        stats = llm.scheduler.load()
    assert [o["output_ids"] for o in outs] == refs
    assert stats["spec_accepted_tokens"] / stats["spec_verify_rows"] > 1
    with pytest.raises(ValueError, match="longer than the tree is deep"):
        with tree_engine(path, heads_, "EAGLE", 2, 12, 13, attention_backend=backend, skip_tokenizer_init=True):
            pass
