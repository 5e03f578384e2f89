"""The simulated worker (`rtp-serve sim-worker`) on the wire, against real NATS, a real
nameservice and master: registration, KV events into the master's index, Snapshot,
deterministic tokens, prefix caching, PD transfer messages, cancellation, deadlines, the
queue limit and drain. No torch in it (tests/test_boundaries.py)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from rtp_serve.core.sampling_params import SamplingParams
from rtp_serve.services.common import grpc_util
from rtp_serve.services.common.convert import params_to_pb
from rtp_serve.services.common.pb import (
    master_pb2,
    master_pb2_grpc,
    nameservice_pb2,
    nameservice_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from rtp_serve.services.launcher.servers import free_port
from tests.procs import grpc_service, spawn, stop
from tests.servers import eventually

BLOCK = 16
SHORT = SamplingParams(max_tokens=5, ignore_eos=True)
LONG = SamplingParams(max_tokens=1900, ignore_eos=True)  # ~6 s of simulated decode
PROMPT = list(range(100, 180))  # 80 tokens: 5 blocks


@contextlib.contextmanager
def sim_workers(nameservice: str, nats: str, role: str, count: int, *flags: str) -> Iterator:
    proc = spawn(
        "sim-worker", "--role", role, "--count", str(count), "--nameservice", nameservice,
        "--nats-url", nats, "--block-size", str(BLOCK), *flags,
    )  # fmt: skip
    try:
        yield proc
    finally:
        stop(proc)


async def _members(nameservice: str, role: int) -> list[nameservice_pb2.Member]:
    async with grpc_util.channel(nameservice) as ch:
        reply = await nameservice_pb2_grpc.NameServiceStub(ch).List(
            nameservice_pb2.ListRequest(role=role), timeout=5
        )
    return list(reply.members)


async def _wait_members(nameservice: str, role: int, n: int, timeout: float = 60.0) -> list:
    async def enough() -> bool:
        return len(await _members(nameservice, role)) >= n

    await eventually(enough, timeout, f"{n} members of role {role}")
    return await _members(nameservice, role)


@pytest.fixture(scope="module")
def cluster(model_dir, nats_server):
    model = str(model_dir("tiny-llama"))
    with grpc_service("nameservice", "--nats-url", nats_server, "--ttl", "1") as (ns, _):
        common = ("--nameservice", ns, "--nats-url", nats_server)
        with (
            grpc_service("master", *common) as (master, _),
            sim_workers(ns, nats_server, "fused", 3, "--model", model),
            sim_workers(ns, nats_server, "prefill", 1, "--model", model),
            sim_workers(ns, nats_server, "decode", 1, "--model", model),
        ):
            fused = asyncio.run(_wait_members(ns, nameservice_pb2.ROLE_FUSED, 3))
            prefill = asyncio.run(_wait_members(ns, nameservice_pb2.ROLE_PREFILL, 1))
            decode = asyncio.run(_wait_members(ns, nameservice_pb2.ROLE_DECODE, 1))
            yield {
                "model": model, "nameservice": ns, "master": master, "nats": nats_server,
                "fused": fused, "prefill": prefill[0], "decode": decode[0],
            }  # fmt: skip


def _request(prompt, params, rid: str, prefill: str = "") -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        request_id=rid, prompt_token_ids=prompt, params=params_to_pb(params),
        prefill_address=prefill,
    )  # fmt: skip


async def _generate(address: str, prompt, params=SHORT, rid="r", prefill="", timeout=30.0):
    async with grpc_util.channel(address) as ch:
        call = worker_pb2_grpc.WorkerStub(ch).Generate(
            _request(prompt, params, rid, prefill), timeout=timeout
        )
        return [msg async for msg in call]


async def _stats(address: str) -> worker_pb2.WorkerStats:
    async with grpc_util.channel(address) as ch:
        return await worker_pb2_grpc.WorkerStub(ch).Stats(worker_pb2.WorkerStatsRequest())


async def _snapshot(address: str) -> worker_pb2.KVSnapshot:
    async with grpc_util.channel(address) as ch:
        return await worker_pb2_grpc.WorkerStub(ch).Snapshot(worker_pb2.KVSnapshotRequest())


async def _idle(address: str) -> None:
    async def idle() -> bool:
        s = await _stats(address)
        return s.held_blocks == 0 and s.num_running == 0 and s.num_waiting == 0

    await eventually(idle, 10.0, f"{address} idle")
    assert (await _stats(address)).integrity_ok


def _tokens(msgs) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


def test_each_worker_registers_with_its_own_identity(cluster):
    fused = cluster["fused"]
    assert len({m.id for m in fused}) == 3
    assert len({m.address for m in fused}) == 3
    assert len({m.cache_salt for m in fused}) == 1 and fused[0].block_size == BLOCK
    stats = asyncio.run(_stats(fused[0].address))
    assert stats.cpu_isa == "sim" and stats.block_size == BLOCK and stats.total_blocks > 0


def test_tokens_are_deterministic_and_the_prefix_is_cached(cluster):
    a, b = (m.address for m in cluster["fused"][:2])

    async def main():
        first = await _generate(a, PROMPT, rid="d1")
        again = await _generate(a, PROMPT, rid="d2")
        elsewhere = await _generate(b, PROMPT, rid="d3")
        other = await _generate(a, [7, *PROMPT[1:]], rid="d4")
        return first, again, elsewhere, other

    first, again, elsewhere, other = asyncio.run(main())
    assert len(_tokens(first)) == SHORT.max_tokens
    assert _tokens(first) == _tokens(again) == _tokens(elsewhere)
    assert _tokens(other) != _tokens(first)
    assert first[0].num_cached_tokens == 0
    # All but the last block (one prompt token is always computed): 4 blocks of 16.
    assert again[0].num_cached_tokens == 4 * BLOCK
    assert first[-1].finished and first[-1].finish_reason == "length"
    asyncio.run(_idle(a))


def test_pd_moves_the_prompt_kv_as_real_messages(cluster):
    decode, prefill = cluster["decode"].address, cluster["prefill"].address
    fused = cluster["fused"][2].address
    prompt = list(range(300, 370))  # 70 tokens: 4 full blocks and a partial one

    async def main():
        pd = await _generate(decode, prompt, rid="pd1", prefill=prefill)
        ref = await _generate(fused, prompt, rid="pd2")
        return pd, ref, await _snapshot(prefill), await _snapshot(decode)

    pd, ref, prefill_snap, decode_snap = asyncio.run(main())
    assert _tokens(pd) == _tokens(ref)
    # The prefill side computed and cached the prompt's 4 full blocks; the decode side
    # cached the same keys from the KV it received (checked block by block on arrival).
    assert len(prefill_snap.block_hashes) >= 4
    assert set(prefill_snap.block_hashes) <= set(decode_snap.block_hashes)
    asyncio.run(_idle(decode))
    asyncio.run(_idle(prefill))


def test_the_master_index_matches_every_snapshot(cluster):
    workers = [*cluster["fused"], cluster["prefill"], cluster["decode"]]

    async def main():
        await asyncio.gather(
            *(_generate(w.address, list(range(i, i + 40)), rid=f"ix{i}") for i, w in
              enumerate(cluster["fused"]))
        )  # fmt: skip

        async def agree() -> bool:
            async with grpc_util.channel(cluster["master"]) as ch:
                index = await master_pb2_grpc.MasterStub(ch).Index(master_pb2.IndexRequest())
            held = {w.worker_id: set(w.block_hashes) for w in index.workers}
            for w in workers:
                snap = await _snapshot(w.address)
                if held.get(w.id) != set(snap.block_hashes):
                    return False
            return True

        await eventually(agree, 10.0, "the master's index equals the workers' snapshots")

    asyncio.run(main())


def test_every_worker_publishes_load_reports_with_its_limits(cluster):
    """The load reports the master routes by, from every simulated worker, with the limits
    it routes around (a full batch, a full queue)."""
    from rtp_serve.services.common import subjects
    from rtp_serve.services.common.bus import Bus
    from rtp_serve.services.common.pb import events_pb2

    ids = {m.id for m in [*cluster["fused"], cluster["prefill"], cluster["decode"]]}
    reports: dict[str, events_pb2.LoadReport] = {}

    async def collect() -> None:
        bus = await Bus.connect(cluster["nats"], "test-sim-load")

        async def keep(msg: events_pb2.LoadReport, headers) -> None:
            reports[msg.worker_id] = msg

        await bus.subscribe(subjects.load_report_all(), events_pb2.LoadReport, keep)
        try:
            await eventually(lambda: ids <= set(reports), 10.0, "a report from each")
        finally:
            await bus.close()

    asyncio.run(collect())
    for worker_id in ids:
        r = reports[worker_id]
        assert (r.max_num_seqs, r.max_num_waiting, r.block_size) == (64, 256, BLOCK), r


def test_cancel_and_deadline_release_everything(cluster):
    address = cluster["fused"][0].address

    async def main():
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _generate(address, PROMPT, LONG, rid="late", timeout=0.5)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await _idle(address)
        async with grpc_util.channel(address) as ch:
            call = worker_pb2_grpc.WorkerStub(ch).Generate(_request(PROMPT, LONG, "gone"))
            got = 0
            async for msg in call:
                got += len(msg.token_ids)
                if got >= 3:
                    break
            call.cancel()
        await _idle(address)

    asyncio.run(main())


def test_queue_limit_refuses_with_resource_exhausted(cluster, model_dir):
    flags = ("--model", cluster["model"], "--max-num-seqs", "1", "--max-num-waiting", "1")
    with sim_workers(cluster["nameservice"], cluster["nats"], "fused", 1, "--worker-id",
                     "queue-limit", *flags):  # fmt: skip

        async def main():
            async def ours() -> bool:
                members = await _members(cluster["nameservice"], nameservice_pb2.ROLE_FUSED)
                return any(m.id == "queue-limit" for m in members)

            await eventually(ours, 60.0, "the queue-limit worker registered")
            members = await _members(cluster["nameservice"], nameservice_pb2.ROLE_FUSED)
            address = next(m.address for m in members if m.id == "queue-limit")
            calls = [
                asyncio.create_task(_generate(address, PROMPT, LONG, rid=f"q{i}", timeout=2.0))
                for i in range(3)
            ]
            results = await asyncio.gather(*calls, return_exceptions=True)
            codes = sorted(r.code().name for r in results if isinstance(r, grpc.aio.AioRpcError))
            assert "RESOURCE_EXHAUSTED" in codes, codes
            await _idle(address)

        asyncio.run(main())


def test_drain_finishes_calls_in_flight_and_leaves_the_nameservice(cluster):
    ns = cluster["nameservice"]
    proc = spawn(
        "sim-worker", "--role", "fused", "--nameservice", ns, "--nats-url", cluster["nats"],
        "--model", cluster["model"], "--worker-id", "drainer", "--drain-timeout", "30",
    )  # fmt: skip
    try:

        async def main():
            async def registered() -> list:
                members = await _members(ns, nameservice_pb2.ROLE_FUSED)
                return [m for m in members if m.id == "drainer"]

            await eventually(registered, 60.0, "the draining worker registered")
            (member,) = await registered()
            params = SamplingParams(max_tokens=400, ignore_eos=True)
            call = asyncio.create_task(_generate(member.address, PROMPT, params, rid="dr"))
            await eventually(lambda: _running(member.address), 10.0, "the request is running")
            proc.send_signal(signal.SIGTERM)
            msgs = await call
            assert len(_tokens(msgs)) == 400 and msgs[-1].finished
            await eventually(lambda: _gone(ns, "drainer"), 10.0, "deregistered")

        asyncio.run(main())
        assert proc.wait(30) == 0
    finally:
        stop(proc)


async def _running(address: str) -> bool:
    return (await _stats(address)).num_running > 0


async def _gone(nameservice: str, member_id: str) -> bool:
    members = await _members(nameservice, nameservice_pb2.ROLE_FUSED)
    return all(m.id != member_id for m in members)


def test_a_hundred_workers_in_one_process_serve_through_frontend_and_master(model_dir, nats_server):
    """A cluster of its own (nameservice, master, frontend) and one sim-worker process of
    100 workers: requests through the frontend are all served, spread over several."""
    model = str(model_dir("tiny-llama"))
    space = ("--nats-url", nats_server, "--namespace", "hundred")
    with grpc_service("nameservice", *space) as (ns, _):
        flags = ("--model", model, "--worker-id", "many", "--namespace", "hundred")
        with (
            grpc_service("master", "--nameservice", ns, *space) as (master, _),
            sim_workers(ns, nats_server, "fused", 100, *flags),
        ):
            asyncio.run(_hundred(ns, master, model))


async def _hundred(ns: str, master: str, model: str) -> None:
    async def registered() -> bool:
        return len(await _members(ns, nameservice_pb2.ROLE_FUSED)) == 100

    await eventually(registered, 120.0, "100 workers registered")
    port = free_port()
    frontend = spawn("frontend", "--nameservice", ns, "--master", master, "--model", model,
                     "--port", str(port), "--namespace", "hundred")  # fmt: skip
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:

            async def ready() -> bool:
                try:
                    return (await http.get("/ready")).status_code == 200
                except httpx.TransportError:
                    return False

            await eventually(ready, 60.0, "the frontend is ready")
            bodies = [
                {"model": Path(model).name, "prompt": list(range(i, i + 50)), "max_tokens": 3}
                for i in range(20)
            ]
            replies = await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies))
    finally:
        await asyncio.to_thread(stop, frontend)
    assert [r.status_code for r in replies] == [200] * 20, replies[0].text
    assert all(r.json()["usage"]["completion_tokens"] == 3 for r in replies)
    async with grpc_util.channel(master) as ch:
        index = await master_pb2_grpc.MasterStub(ch).Index(master_pb2.IndexRequest())
    assert len([w for w in index.workers if w.block_hashes]) >= 2


def test_the_launcher_runs_a_simulated_cluster(model_dir, tmp_path):
    """`rtp-serve up --engine sim`: every service real, the workers simulated, their pools
    sized as a real worker's of the same --kv-cache-mib, served through the official client
    with the second identical prompt reusing the first's blocks; stopped by SIGTERM with
    every service deregistered from the name service, which stops last."""
    import openai

    from rtp_serve.core.model_config import ModelConfig
    from rtp_serve.engine.memory import kv_bytes_per_block
    from tests.cluster import launch

    model = str(model_dir("tiny-llama"))
    flags = ("--engine", "sim", "--fused", "1", "--kv-cache-mib", "3", "--no-cache",
             "--block-size", str(BLOCK))  # fmt: skip
    log = tmp_path / "services.log"
    with (
        log.open("w") as services_log,
        launch(model, tmp_path, *flags, stderr=services_log) as cluster,
    ):
        stats = cluster.worker_stats()
        client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused")
        prompt = list(range(200, 300))  # 100 tokens: 6 full blocks
        first, second = (
            client.completions.create(model=Path(model).name, prompt=prompt, max_tokens=4)
            for _ in range(2)
        )
    per_block = kv_bytes_per_block(ModelConfig.from_dir(model), "float32", BLOCK)
    assert [s.total_blocks for s in stats.values()] == [(3 << 20) // per_block]
    assert first.usage.completion_tokens == second.usage.completion_tokens == 4
    assert first.choices[0].text == second.choices[0].text  # deterministic token ids
    assert second.usage.prompt_tokens_details.cached_tokens == 6 * BLOCK
    # SIGTERM stopped it cleanly: every service deregistered before the name service went.
    assert cluster.proc.returncode == 0
    logged = log.read_text()
    assert "could not deregister" not in logged, logged
    assert logged.count("reason=deregistered") == 3  # master, worker, frontend


def test_the_launcher_refuses_what_a_simulated_worker_lacks(model_dir):
    from rtp_serve.services.launcher.process import CLI

    run = subprocess.run(
        [*CLI, "up", "--engine", "sim", "--model", str(model_dir("tiny-llama")), "--port", "0",
         "--speculative", "ngram", "--threads", "2", "--itl-target-ms", "100"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode != 0
    assert (
        "--engine sim: simulated workers have no --threads, --speculative, --itl-target-ms"
        in run.stderr
    )
    run = subprocess.run(
        [*CLI, "up", "--model", str(model_dir("tiny-llama")), "--port", "0", "--sim-cost", "x"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode != 0 and "--sim-cost and --sim-step are a simulated" in run.stderr


def test_a_worker_whose_publishing_fails_exits_instead_of_serving_unseen(model_dir, nats_server):
    """The load and KV-event publisher runs for the worker's life; if it fails (here: the
    engine's step cost raises), the master would route on stale load and a stale index,
    so the worker stops with the error (its process exits non-zero, and its supervisor
    restarts it) rather than serve on. So does a failure of its role's background work."""
    from rtp_serve.core.sim_cost import SimCost
    from rtp_serve.engine.sim.engine import SimLLM
    from rtp_serve.services.cli import build_parser
    from rtp_serve.services.decode.servicer import DecodeServicer
    from rtp_serve.services.sim.main import sim_config
    from rtp_serve.services.worker.serve import serve_worker

    argv = ["sim-worker", "--model", str(model_dir("tiny-llama")), "--nats-url", nats_server]
    args = build_parser(argv).parse_args(argv)

    class Broken(SimLLM):
        def step_cost(self):
            raise RuntimeError("cost model gone")

    class Failing(DecodeServicer):
        async def background(self, names) -> None:
            await asyncio.sleep(0.2)
            raise RuntimeError("background gone")

    def run(engine: type[SimLLM], servicer: type[DecodeServicer]) -> None:
        def build(_):
            return engine(sim_config(args), SimCost())

        def make(llm, worker_args):
            return servicer(llm, allow_fused=True, role=nameservice_pb2.ROLE_FUSED)

        fused = nameservice_pb2.ROLE_FUSED
        asyncio.run(asyncio.wait_for(serve_worker(args, fused, make, build), 30))

    with pytest.raises(RuntimeError, match="publishing failed") as failed:
        run(Broken, DecodeServicer)
    assert str(failed.value.__cause__) == "cost model gone"
    # The role's background work alike (the base servicer's has none and ends at once).
    with pytest.raises(RuntimeError, match="background work failed") as failed:
        run(SimLLM, Failing)
    assert str(failed.value.__cause__) == "background gone"
