"""RayEngineClient's fan-out (serve_app/engine_client_ray.py) over a stand-in scheduler handle
whose methods run the real pure pieces (EngineGroup with FakeRunners, OutputChannels) in this
process: one output stream for every request, a broken stream fails every waiting request
with the right error (a dead scheduler: resumable), strays are aborted, ids are exclusive.
The real actor path is covered by tests/integration (test_faults, test_serving_path)."""

from __future__ import annotations

import asyncio
import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from ray.exceptions import RayActorError

from serve_app.engine_client_ray import RayEngineClient
from serve_app.errors import OpenAIError, SchedulerGoneError
from serve_app.resume import ResumingEngineClient
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.engine_group import EngineGroup, TimedRunner
from scheduler.output_channel import OutputChannels
from scheduler.outputs import EngineRequest, FinishReason, RequestOutput
from scheduler.sampling_params import SamplingParams
from scheduler.testing import FakeRunner

CFG = SchedulerConfig(block_size=4, num_blocks=128, max_model_len=128, max_num_batched_tokens=64)


class Method:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


NODE = "this-node"  # the node the client (the replica) runs on
# how the replica reads its output channel: a Ray stream (scheduler elsewhere), the scheduler's
# socket (same node), or a Ray stream again where the socket cannot be reached (same node id,
# another file system)
TRANSPORTS = ["ray", "socket", "unreachable"]


class StandInScheduler:
    """submit/outputs/abort/ready/output_address with a SchedulerActor's shapes; kill() ends
    its streams like a dead actor, and the next call finds a fresh one (Ray's restart).
    transport "socket": it says it runs on the client's node and serves the output channel on
    a real Unix socket (OutputChannels.serve_socket_reader), which kill() closes; "ray": it
    says it runs elsewhere, so the client reads outputs() (a Ray streaming generator)."""

    def __init__(self, delay_s: float = 0.002, transport: str = "ray") -> None:
        self.delay_s = delay_s
        self.transport = transport
        self.num_aborts = 0
        self.num_socket_readers = 0
        self._directory = tempfile.mkdtemp()
        self._start()
        self.submit = Method(lambda request, channel_id: asyncio.ensure_future(self._submit(request, channel_id)))
        self.outputs = Method(self._outputs)
        self.abort = Method(self._abort)
        self.ready = Method(lambda: asyncio.ensure_future(asyncio.sleep(0, True)))
        self.output_address = Method(lambda: asyncio.ensure_future(self._output_address()))

    def _start(self) -> None:
        runner = TimedRunner(FakeRunner(CFG.block_size, CFG.num_blocks, delay_s=self.delay_s))
        self.group = EngineGroup([Engine(CFG, runner)], [runner])
        self.channels = OutputChannels(abort=self.group.abort, on_finished=self.group.forget)
        self.dead = asyncio.Event()
        self.incarnation = uuid.uuid4().hex
        self._server: asyncio.AbstractServer | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def _output_address(self) -> tuple[str, str, str]:
        if self.transport == "ray":
            return "another-node", "", self.incarnation
        if self.transport == "unreachable":
            return NODE, os.path.join(self._directory, "nobody-listens.sock"), self.incarnation
        path = os.path.join(self._directory, f"{self.incarnation}.sock")
        if self._server is None:
            self._server = await asyncio.start_unix_server(self._serve_reader, path)
        return NODE, path, self.incarnation

    async def _serve_reader(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_socket_readers += 1
        self._writers.append(writer)
        await self.channels.serve_socket_reader(reader, writer)

    async def _submit(self, request: EngineRequest, channel_id: str) -> bool:
        channel = self.channels.get(channel_id)
        return self.group.add_request(request, self.channels.listener(channel, request.request_id)) is not None

    async def _outputs(self, channel_id: str) -> AsyncIterator[Any]:
        reader = self.channels.read(channel_id)
        dead = asyncio.ensure_future(self.dead.wait())
        while True:
            item = asyncio.ensure_future(anext(reader))
            await asyncio.wait([item, dead], return_when=asyncio.FIRST_COMPLETED)
            if dead.done():
                item.cancel()
                raise RayActorError()
            yield item

    def _abort(self, request_id: str) -> None:
        self.num_aborts += 1
        self.group.abort(request_id)

    def kill(self) -> None:
        for engine in self.group.engines:
            engine.take_for_migration()  # its state is gone with it
        self.dead.set()
        if self._server is not None:  # its process is gone: so are its sockets
            self._server.close()
            for writer in self._writers:
                writer.close()
        self._start()


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n)


async def collect(outputs: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [output async for output in outputs]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_request_streams_over_one_output_stream(transport: str) -> None:
    async def main():
        scheduler = StandInScheduler(transport=transport)
        client = RayEngineClient(scheduler, node_id=NODE)
        requests = [EngineRequest(f"r{i}", list(range(i, i + 5)), greedy(8, n=2 if i == 0 else 1)) for i in range(6)]
        results = await asyncio.gather(*(collect(client.generate(r)) for r in requests))
        assert scheduler.num_socket_readers == (transport == "socket")  # one socket, or none
        return client, results

    client, results = asyncio.run(main())
    for i, outputs in enumerate(results):
        n = 2 if i == 0 else 1
        for index in range(n):
            mine = [o for o in outputs if o.index == index]
            assert sum(len(o.new_token_ids) for o in mine) == 8 and mine[-1].finish_reason is FinishReason.LENGTH
    assert client.num_deltas == sum(len(outputs) for outputs in results)
    assert client.num_batches <= 9  # one per step (8 tokens), not one per delta (56)
    assert client.num_deltas >= 6 * client.num_batches - 6


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_dead_scheduler_fails_waiting_requests_and_resume_continues_them(transport: str) -> None:
    async def main():
        scheduler = StandInScheduler(delay_s=0.005, transport=transport)
        client = RayEngineClient(scheduler, node_id=NODE)
        plain = client.generate(EngineRequest("plain", [1, 2, 3], greedy(30)))
        resuming = ResumingEngineClient(client, max_resumes=2, resume_timeout_s=5)
        resumed_task = asyncio.ensure_future(collect(resuming.generate(EngineRequest("kept", [4, 5, 6], greedy(30)))))
        first = await anext(plain)
        await asyncio.sleep(0.03)
        scheduler.kill()
        with pytest.raises(SchedulerGoneError):
            await collect(plain)
        kept = await resumed_task
        fresh = await collect(client.generate(EngineRequest("after", [7, 8], greedy(3))))
        assert scheduler.num_socket_readers == (2 if transport == "socket" else 0)  # the new one's socket
        return first, kept, fresh

    first, kept, fresh = asyncio.run(main())
    assert first.new_token_ids
    tokens = [t for o in kept for t in o.new_token_ids]
    assert len(tokens) == 30 and kept[-1].finish_reason is FinishReason.LENGTH
    assert all(o.request_id == "kept" for o in kept)
    reference = Engine(CFG, FakeRunner(CFG.block_size, CFG.num_blocks)).generate([[4, 5, 6]], greedy(30))
    assert tokens == reference[0].sequences[0].token_ids  # no gap, no duplicate across the restart
    assert sum(len(o.new_token_ids) for o in fresh) == 3  # the next request opened a new stream


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_deltas_of_a_request_nobody_waits_for_get_it_aborted_once(transport: str) -> None:
    async def main():
        scheduler = StandInScheduler(transport=transport)
        client = RayEngineClient(scheduler, node_id=NODE)
        orphan = EngineRequest("orphan", [9, 9, 9], greedy(50))
        await scheduler.submit.remote(orphan, client.channel_id)  # submitted, but no one reads it here
        done = await collect(client.generate(EngineRequest("mine", [1, 2], greedy(4))))
        await asyncio.sleep(0.05)
        return scheduler, done

    scheduler, done = asyncio.run(main())
    assert sum(len(o.new_token_ids) for o in done) == 4
    assert scheduler.num_aborts == 1
    status = scheduler.group.status()
    assert status.num_unfinished_requests == 0 and status.num_running == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_request_id_in_flight_here_is_refused_with_400(transport: str) -> None:
    async def main():
        client = RayEngineClient(StandInScheduler(transport=transport), node_id=NODE)
        first = client.generate(EngineRequest("same", [1, 2], greedy(20)))
        await anext(first)
        with pytest.raises(OpenAIError) as refused:
            await anext(client.generate(EngineRequest("same", [1, 2], greedy(2))))
        await first.aclose()
        return refused.value

    assert asyncio.run(main()).status == 400
