"""Speculative decoding in the mesh, on the decode side of prefill/decode disaggregation: `radixmesh serve
--speculative-algorithm NGRAM` (or STANDALONE, the model drafting for itself: its draft KV is built on the decode
worker from the transferred prompt; or EAGLE3, a random head in the published format: the prefill worker's head
catches up over the prompt and its KV and the last position's hidden states travel with the first token,
engine.disaggregation.draft_state) with a prefill and a decode worker (shm transfer) streams, in order, the tokens
the plain offline engine decodes greedily (tests/parity/test_pd_speculative.py shows the decode worker's drafts are
a colocated engine's); /generate's meta_info carries SGLang's spec_* keys, and the decode worker's /metrics the
acceptance length."""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.conftest import model_path
from tests.e2e.conftest import MODEL
from tests.e2e.mesh import metric_sum, running_mesh
from tests.engine_utils import parity_prompts

GREEDY = {"max_new_tokens": 24, "temperature": 0.0}
FLAGS = ("--disaggregation", "pd", "--disaggregation-transfer-backend", "shm", "--speculative-num-draft-tokens", "6",
         "--enable-metrics")
ALGORITHMS = {"NGRAM": (), "STANDALONE": ("--speculative-draft-model-path", model_path(MODEL)), "EAGLE3": ()}


def post(url: str, body: dict) -> bytes:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read()


def prompts() -> list[list[int]]:
    """Prompts whose tails repeat earlier spans (n-gram lookup finds drafts in them), and plain ones."""
    base = parity_prompts(model_path(MODEL))
    return [base[1] * 3, base[2][:9] * 6, base[4] + base[4][:30], base[0], base[3]]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_speculative_decode_worker_streams_the_plain_engines_tokens(tmp_path, offline, algorithm):
    inputs = prompts()
    want = [r["output_ids"] for r in offline.generate(input_ids=inputs, sampling_params=GREEDY)]
    sd_file = tmp_path / "targets.json"
    flags = ALGORITHMS[algorithm]
    if algorithm == "EAGLE3":
        from tests.parity.test_speculative_eagle import write_head

        flags = ("--speculative-draft-model-path", write_head(tmp_path / "head", model_path(MODEL), "eagle3"))
    with running_mesh(model_path(MODEL), tmp_path, *FLAGS, "--speculative-algorithm", algorithm, *flags,
                      "--metrics-sd-file", str(sd_file)) as mesh:
        batch = json.loads(post(mesh.url + "/generate", {"input_ids": inputs, "sampling_params": GREEDY}))
        assert [r["output_ids"] for r in batch] == want
        meta = [r["meta_info"] for r in batch]
        if algorithm == "EAGLE3":  # every handoff carried the head's state (else the decode worker warns)
            log = mesh.log_path.read_text(errors="replace")
            assert "draft state" not in log and "draft head" not in log, mesh.log_tail()
        assert all(m["spec_verify_ct"] > 0 for m in meta), meta
        random_head = algorithm == "EAGLE3"  # (its drafts are wrong: drafting is what to see)
        assert sum(m["spec_draft_token_num" if random_head else "spec_accept_token_num"] for m in meta) > 0, meta
        # after the prefill worker's first token, each decode forward gave one token and the drafts it kept
        assert all(m["spec_verify_ct"] + m["spec_accept_token_num"] == m["completion_tokens"] - 1 for m in meta
                   if m["finish_reason"]["type"] == "length"), meta
        for ids, expected in zip(inputs[:2], want[:2]):
            raw = post(mesh.url + "/generate", {"input_ids": ids, "sampling_params": GREEDY, "stream": True})
            events = [json.loads(x[len(b"data: "):]) for x in raw.split(b"\n\n")
                      if x.startswith(b"data: ") and x != b"data: [DONE]"]
            # cumulative outputs: each one extends the one before, several tokens at a time where drafts were kept
            outs = [e["output_ids"] for e in events]
            assert all(b[:len(a)] == a for a, b in zip(outs, outs[1:])) and outs[-1] == expected
            assert events[-1]["meta_info"]["spec_verify_ct"] > 0
        decode = [g for g in json.loads(sd_file.read_text()) if g["labels"]["service"].startswith("worker-decode")]
        assert len(decode) == 1, decode
        url = f"http://{decode[0]['targets'][0]}/metrics"
        assert metric_sum(url, "sglang:spec_accept_length") >= 1.0 if random_head else \
            metric_sum(url, "sglang:spec_accept_length") > 1.0
        assert metric_sum(url, "radixmesh:spec_accepted_tokens_total") > 0 or random_head
