"""EngineClient over the SchedulerActor: the ingress's only Ray-facing piece for requests.

One output stream per replica, fanned out here (the shape of vLLM V1's output handler):

    generate(request):  queue = per-request asyncio.Queue, registered under its request id
                        await scheduler.submit(request, channel_id)   (admission: 400/429/503 now)
                        yield the queue's deltas until each of the n sequences has its final one
    reader task:        async for batch in scheduler.outputs(channel_id)   (one Ray item per step)
                            for delta in batch: queues[delta.request_id].put_nowait(delta)

so a step of k streaming requests costs one Ray message, not k. A replica on the scheduler's
node reads the same batches from the scheduler's Unix socket instead (a frame costs a tenth
of a Ray item's CPU; scheduler/output_channel.py); when that socket closes, the scheduler is
asked whether it is still the one that was read (else it died: SchedulerGoneError, as a
broken Ray stream). The reader runs in a fresh
context (it outlives the request that started it, and Ray would otherwise parent the
stream to that request's task and cancel it with it). When the stream breaks, every
request waiting on it gets the error: a dead or restarting scheduler actor is a
SchedulerGoneError, which serve_app/resume.py turns into a resubmission; the next request
opens a new stream. A non-final delta of a request nobody waits for (its client left, or it
was resubmitted) gets the request aborted, so nothing runs for no one.

Errors become OpenAI errors: a request the scheduler refuses (ValueError) is a 400, a dead
or restarting actor is a 503, anything else from the engine a 500. Nothing here blocks
the event loop: every call is awaited or fire-and-forget.
"""

from __future__ import annotations

import asyncio
import contextvars
import pickle
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from serve_app.engine_client import EngineStatus
from serve_app.errors import (
    EngineUnavailableError,
    OpenAIError,
    SchedulerGoneError,
    draining_error,
    queue_full_error,
)
from scheduler.admission import DrainingError, QueueFullError
from scheduler.actor import is_actor_death
from scheduler.engine_group import NoLiveWorkerError, UnknownLoraError
from scheduler.output_channel import ChannelItem, RequestFailed
from scheduler.outputs import EngineRequest, RequestOutput
from scheduler.step_channel import encode_frame, read_frame


def engine_error(error: Exception) -> OpenAIError:
    cause = error.cause if isinstance(error, RayTaskError) and error.cause is not None else error
    if isinstance(cause, UnknownLoraError):
        return OpenAIError(str(cause), 404, param="model", code="model_not_found")
    if isinstance(cause, ValueError):
        return OpenAIError(f"the engine refused the request: {cause}", 400, code="invalid_request")
    if isinstance(cause, NoLiveWorkerError):
        return EngineUnavailableError(f"no worker is alive ({cause}); retry later")
    if isinstance(cause, QueueFullError):
        return queue_full_error(str(cause), cause.retry_after_s)
    if isinstance(cause, DrainingError):
        return draining_error()
    if isinstance(error, RayActorError) and not isinstance(error, RayTaskError):
        # The scheduler actor itself died or is restarting (a RayTaskError would be an error
        # its code raised): the request may be resubmitted (serve_app/resume.py).
        return SchedulerGoneError(f"the scheduler is unavailable ({type(error).__name__}); retry later")
    if is_actor_death(cause) or isinstance(error, RayActorError):
        return EngineUnavailableError(f"the engine is unavailable ({type(cause).__name__}); retry later")
    return OpenAIError(f"engine error: {type(cause).__name__}: {cause}"[:500], 500, error_type="server_error")


NUM_REMEMBERED_STRAYS = 4096  # request ids whose late deltas are already taken care of
ADDRESS_TIMEOUT_S = 10.0  # asking the scheduler where its output socket is


class RayEngineClient:
    def __init__(self, scheduler: Any, channel_id: str | None = None, node_id: str | None = None) -> None:
        self._scheduler = scheduler  # ActorHandle of SchedulerActor
        self._node_id = node_id  # the Ray node this replica runs on (None: asked of Ray when needed)
        self.channel_id = channel_id or uuid.uuid4().hex  # this replica's output channel there
        self._queues: dict[str, asyncio.Queue[ChannelItem | OpenAIError]] = {}  # request id -> its deltas
        self._reader: asyncio.Task[None] | None = None
        self._stray_aborts: OrderedDict[str, None] = OrderedDict()  # request ids whose late deltas need no abort
        self.num_batches = 0  # output stream items received (one per engine step with deltas for us)
        self.num_deltas = 0  # deltas and failures in them

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        request_id = request.request_id
        if request_id in self._queues:
            raise OpenAIError(f"the engine refused the request: request id {request_id!r} is already in use",
                              400, code="invalid_request")
        queue: asyncio.Queue[ChannelItem | OpenAIError] = asyncio.Queue()
        self._queues[request_id] = queue  # before submit: its first delta may come before submit's answer
        num_unfinished = request.sampling_params.n
        try:
            self._ensure_reader()
            try:
                accepted = await self._scheduler.submit.remote(request, self.channel_id)
            except (RayTaskError, RayActorError) as error:
                raise engine_error(error) from None
            if not accepted:
                return  # aborted before it arrived
            while num_unfinished:
                item = await queue.get()
                if isinstance(item, OpenAIError):
                    raise item
                if isinstance(item, RequestFailed):
                    raise engine_error(item.error)
                if item.finished:
                    num_unfinished -= 1
                yield item
        finally:
            if self._queues.get(request_id) is queue:
                del self._queues[request_id]
            if num_unfinished:  # left early: the caller aborts it, its late deltas are no strays
                self._remember_stray(request_id)

    def _ensure_reader(self) -> None:
        if self._reader is None or self._reader.done():
            loop = asyncio.get_running_loop()
            self._reader = loop.create_task(self._read(), context=contextvars.Context())

    async def _read(self) -> None:
        """Fans the output stream out to the request queues until it breaks."""
        me = asyncio.current_task()
        incarnation = None
        try:
            socket, incarnation = await self._open_output_socket()
            batches = self._socket_batches(*socket) if socket is not None else self._ray_batches()
            async for batch in batches:
                self.num_batches += 1
                self.num_deltas += len(batch)
                for item in batch:
                    queue = self._queues.get(item.request_id)
                    if queue is not None:
                        queue.put_nowait(item)
                    elif isinstance(item, RequestOutput) and not item.finished:
                        self._abort_stray(item.request_id)
            failure: OpenAIError = EngineUnavailableError("the scheduler closed the output stream; retry later")
        except asyncio.CancelledError:
            raise
        except (RayTaskError, RayActorError) as error:
            failure = engine_error(error)
        except (asyncio.IncompleteReadError, OSError) as error:
            if incarnation is None:  # not from a socket
                failure = EngineUnavailableError(f"output stream failed ({type(error).__name__}); retry later")
            else:  # the output socket closed or broke
                failure = await self._socket_failure(incarnation, error)
        except Exception as error:  # never leave a request waiting on a reader that is gone
            failure = EngineUnavailableError(f"output stream failed ({type(error).__name__}); retry later")
        if self._reader is me:
            self._reader = None  # the next request opens a new stream
        for queue in list(self._queues.values()):
            queue.put_nowait(failure)

    async def _open_output_socket(self) -> tuple[tuple[asyncio.StreamReader, asyncio.StreamWriter] | None, str | None]:
        """The scheduler's output socket, connected and told our channel, with its incarnation,
        when the scheduler runs on this node and the socket is reachable; (None, None): read
        the Ray stream. A dead scheduler raises here (RayActorError), as outputs() would."""
        try:
            node_id, path, incarnation = await asyncio.wait_for(self._scheduler.output_address.remote(),
                                                                ADDRESS_TIMEOUT_S)
        except asyncio.TimeoutError:  # slow to answer: the Ray stream waits for it as before
            return None, None
        if self._node_id is None:
            self._node_id = ray.get_runtime_context().get_node_id()
        if path is None or node_id != self._node_id:
            return None, None
        try:
            reader, writer = await asyncio.open_unix_connection(path)
        except OSError:  # same node id, another file system (a container): the Ray stream
            return None, None
        writer.write(encode_frame(self.channel_id))
        return (reader, writer), incarnation

    async def _ray_batches(self) -> AsyncIterator[list[ChannelItem]]:
        async for ref in self._scheduler.outputs.remote(self.channel_id):
            yield await ref

    async def _socket_batches(self, reader: asyncio.StreamReader,
                              writer: asyncio.StreamWriter) -> AsyncIterator[list[ChannelItem]]:
        try:
            while True:
                yield pickle.loads(await read_frame(reader))
        finally:
            writer.close()

    async def _socket_failure(self, incarnation: str | None, error: BaseException) -> OpenAIError:
        """The output socket closed: if the scheduler we read from is gone (dead, or restarted
        with no state) its requests can be resubmitted (SchedulerGoneError); else it is a 503."""
        try:
            _, _, now = await asyncio.wait_for(self._scheduler.output_address.remote(), ADDRESS_TIMEOUT_S)
        except (RayTaskError, RayActorError) as gone:
            return engine_error(gone)
        except Exception:  # a live scheduler answers at once; its socket closing AND no answer: it died
            return SchedulerGoneError("the scheduler does not answer; retry later")
        if now != incarnation:
            return SchedulerGoneError("the scheduler restarted; retry later")
        return EngineUnavailableError(f"the scheduler's output socket closed ({type(error).__name__}); retry later")

    def _abort_stray(self, request_id: str) -> None:
        if request_id not in self._stray_aborts:
            self._remember_stray(request_id)
            self.abort(request_id)

    def _remember_stray(self, request_id: str) -> None:
        self._stray_aborts[request_id] = None
        while len(self._stray_aborts) > NUM_REMEMBERED_STRAYS:
            self._stray_aborts.popitem(last=False)

    def abort(self, request_id: str) -> None:
        try:
            self._scheduler.abort.remote(request_id)
        except Exception:  # the actor is gone: nothing left to free
            pass

    async def status(self) -> EngineStatus:
        return await self._scheduler.status.remote()

    async def load_lora(self, name: str, path: str) -> dict[str, Any]:
        """The scheduler serves the adapter from now on (serve_app/lora_api.py); OpenAIError
        400 when it does not fit the model or the name is taken."""
        try:
            return await self._scheduler.load_lora.remote(name, path)
        except RayTaskError as error:
            if isinstance(error.cause, ValueError) and not isinstance(error.cause, UnknownLoraError):
                raise OpenAIError(str(error.cause), 400, param="lora_path", code="invalid_lora_adapter") from None
            raise engine_error(error) from None

    async def unload_lora(self, name: str) -> dict[str, Any]:
        try:
            return await self._scheduler.unload_lora.remote(name)
        except RayTaskError as error:
            raise engine_error(error) from None

    async def wait_ready(self, timeout_s: float) -> None:
        """Returns once the scheduler answers again (Ray restarts a dead one, max_restarts);
        EngineUnavailableError if it does not within timeout_s."""
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                await asyncio.wait_for(self._scheduler.ready.remote(), min(remaining, 5.0))
                return
            except asyncio.TimeoutError:
                continue
            except Exception:  # dead or restarting: ask again shortly
                await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        raise EngineUnavailableError(f"the scheduler did not come back within {timeout_s:g}s; retry later")
