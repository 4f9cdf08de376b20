"""LoRA adapters through the mesh, prefill/decode disaggregated (the adapter's name travels in the worker request to
both sides: the prefill worker computes the prompt's KV with the adapter, the decode worker continues with it):
`radixmesh serve --enable-lora --lora-paths sql=... chat=...`; SGLang's /generate `lora_path` (one per prompt of a
batch) and the OpenAI API's `model: "base:adapter"` give transformers + peft's greedy tokens; an unknown adapter is
a 400 that names it."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.conftest import model_path
from tests.e2e.conftest import MODEL
from tests.e2e.mesh import running_mesh
from tests.engine_utils import parity_prompts
from tests.parity.test_lora import ADAPTERS, NEW, peft_greedy, write_adapter
from tests.reference import hf_greedy

FLAGS = ("--disaggregation", "pd", "--disaggregation-transfer-backend", "shm")


def post(url: str, body: dict) -> dict | list:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_adapters_through_the_pd_mesh_give_peft_s_tokens(tmp_path):
    base = model_path(MODEL)
    paths = {name: write_adapter(base, tmp_path / name, r, a, t, rs, seed=i)
             for i, (name, r, a, t, rs) in enumerate(ADAPTERS)}
    prompt = parity_prompts(base)[3]
    want = {None: hf_greedy(base, [prompt], NEW)[0], **{n: peft_greedy(base, p, [prompt])[0] for n, p in paths.items()}}
    greedy = {"temperature": 0, "max_new_tokens": NEW}
    with running_mesh(base, tmp_path, *FLAGS, "--enable-lora", "--lora-paths",
                      *[f"{n}={p}" for n, p in paths.items()]) as mesh:
        names = [None, "sql", "chat"]
        out = post(mesh.url + "/generate", {"input_ids": [prompt] * 3, "sampling_params": greedy, "lora_path": names})
        assert [r["output_ids"] for r in out] == [want[n] for n in names]
        with urllib.request.urlopen(mesh.url + "/v1/models", timeout=30) as r:
            model = json.loads(r.read())["data"][0]["id"]
        completion = post(mesh.url + "/v1/completions", {"model": f"{model}:chat", "prompt": prompt,
                                                         "max_tokens": NEW, "temperature": 0})
        assert completion["choices"][0]["text"] == out[2]["text"]
        with pytest.raises(urllib.error.HTTPError) as err:
            post(mesh.url + "/generate", {"input_ids": prompt, "sampling_params": greedy, "lora_path": "nope"})
        assert err.value.code == 400 and "unknown LoRA adapter 'nope'" in err.value.read().decode()
