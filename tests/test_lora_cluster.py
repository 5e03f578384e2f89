"""Multi-LoRA through a whole PD cluster (`rtp-serve up --lora`): adapters as models, the
admin endpoints fanning out to every worker, adapters' KV kept apart across the transfer."""

from __future__ import annotations

import httpx
import pytest

from rtp_serve.engine import LLM, SamplingParams
from rtp_serve.models.make_adapter import build_adapter
from tests.cluster import launch

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fib"
MAX_TOKENS = 8
ADMIN_KEY = "lora-admin"


def launch_with(env: pytest.MonkeyPatch, model: str, run_dir, *flags: str):
    """`launch`, the frontend given the admin key and the adapters' directory as its root."""
    env.setenv("RTP_ADMIN_KEY", ADMIN_KEY)
    env.setenv("RTP_LORA_ROOT", str(run_dir.parent))
    return launch(model, run_dir, *flags)


@pytest.fixture(scope="module")
def setup(model_dir, tmp_path_factory):
    model = str(model_dir("tiny-llama"))
    root = tmp_path_factory.mktemp("lora-cluster")
    a1 = str(build_adapter("tiny-llama", root / "a1", 8, seed=11))
    a2 = str(build_adapter("tiny-llama", root / "a2", 4, seed=12))
    llm = LLM(model, num_kv_blocks=64, loras=(("a1", a1), ("a2", a2)))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    expected = {n: llm.generate([PROMPT], params, lora=n)[0].text for n in ("", "a1", "a2")}
    return model, root, a1, a2, expected


def _complete(client: httpx.Client, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    return client.post("/v1/completions", json=body)


def test_adapters_served_loaded_and_unloaded_on_a_pd_cluster(setup):
    model, root, a1, a2, expected = setup
    run_dir = root / "run"
    run_dir.mkdir()
    # The frontend's --admin-key and --lora-root, by the environment the launcher passes on.
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with (
        pytest.MonkeyPatch.context() as env,
        launch_with(env, model, run_dir, "--prefill", "1", "--decode", "1", f"--lora=a1={a1}") as c,
        httpx.Client(base_url=c.url, timeout=60) as client,
    ):
        cards = client.get("/v1/models").json()["data"]
        base = cards[0]["id"]
        assert [(m["id"], m["parent"]) for m in cards] == [(base, None), ("a1", base)]
        for name, want in ((base, expected[""]), ("a1", expected["a1"])):
            reply = _complete(client, name)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == want  # as the engine, PD transfer and all
        assert expected[""] != expected["a1"]

        missing = _complete(client, "a2")
        assert missing.status_code == 404
        assert "`a2`" in missing.json()["error"]["message"]
        assert missing.json()["error"]["code"] == "model_not_found"

        body = {"lora_name": "a2", "lora_path": a2}
        assert client.post("/v1/load_lora_adapter", json=body).status_code == 401  # no admin key
        load = client.post("/v1/load_lora_adapter", json=body, headers=admin)
        assert load.status_code == 200, load.text
        assert "a2" in [m["id"] for m in client.get("/v1/models").json()["data"]]
        first = _complete(client, "a2").json()
        assert first["choices"][0]["text"] == expected["a2"]
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # not a1's KV
        again = _complete(client, "a2").json()
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # its own KV

        body = {"lora_name": "x", "lora_path": str(root)}
        bad = client.post("/v1/load_lora_adapter", json=body, headers=admin)
        assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
        unload = client.post("/v1/unload_lora_adapter", json={"lora_name": "a2"}, headers=admin)
        assert unload.status_code == 200
        assert _complete(client, "a2").status_code == 404
        gone = client.post("/v1/unload_lora_adapter", json={"lora_name": "a2"}, headers=admin)
        assert gone.status_code == 404
        stats = c.wait_idle()
        assert all(s.integrity_ok and s.held_blocks == 0 for s in stats.values())
        assert all(list(s.loras) == ["a1"] for s in stats.values())
