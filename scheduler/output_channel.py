"""Output channels: one message per engine step per ingress replica. Pure: no Ray.

    ingress replica R                            SchedulerActor (scheduler/actor.py)
      submit(request, channel_id=R)  ------->      EngineGroup.add_request(request, listener=channel R)
      outputs(R)  <==== one Ray stream =====      OutputChannel R: every delta of every request R submitted
          |  one item per step: list[RequestOutput | RequestFailed]
          v
      fan-out by request id to per-request queues (serve_app/engine_client_ray.py)

An engine step hands all its deltas over synchronously (Engine._deliver), so they land in the
channel's buffer together and the reader takes them as one list: one Ray message per step
per replica however many requests it streams, instead of one stream per request (vLLM V1's
output handler has this shape over ZMQ). A reader that falls behind gets several steps'
deltas in one larger item; nothing is dropped.

Transport: a replica on the scheduler's node reads its channel over the scheduler's Unix
socket (serve_socket_reader: the first frame names the channel, then one frame per batch,
framed as scheduler/step_channel.py frames steps); one elsewhere reads it as a Ray streaming
generator (SchedulerActor.outputs). A Ray generator item costs about as much CPU as a Ray
actor call (about 2 ms across the two processes on a 2-core VM), a frame a tenth of that.

Lifetimes:
- a request belongs to its channel from submit until its last final delta (or its failure)
  is put; then the `on_finished` callback (EngineGroup.forget) runs;
- one reader at a time: a new read() of the same channel takes over and the old one ends,
  so a replica can reconnect without losing anything buffered;
- a channel that has had no reader for `orphan_after_s` (its replica died, or never
  connected) gets its open requests aborted by reap_orphans() and is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from scheduler.engine import RequestStream, StreamListener
from scheduler.outputs import RequestOutput
from scheduler.step_channel import encode_frame, picklable_error, read_frame

logger = logging.getLogger(__name__)

ORPHAN_AFTER_S = 60.0  # a channel with no reader for this long: its requests are aborted


@dataclass(frozen=True, slots=True)
class RequestFailed:
    """The engine failed a request: it ends with this error (the ingress maps it to HTTP)."""

    request_id: str  # the client request id
    error: BaseException  # why; always picklable (see failure_of)


ChannelItem = RequestOutput | RequestFailed


def failure_of(request_id: str, error: BaseException) -> RequestFailed:
    """A RequestFailed that is sure to cross Ray or a socket: an error that cannot be pickled
    becomes a RuntimeError with its type and message (picklable_error)."""
    return RequestFailed(request_id, picklable_error(error))


class OutputChannel:
    """One ingress replica's deltas, buffered between reads."""

    def __init__(self, channel_id: str, now: float) -> None:
        self.channel_id = channel_id  # chosen by the replica (unique per replica and scheduler)
        self.open_request_ids: set[str] = set()  # client request ids still streaming here
        self.unread_since: float | None = now  # clock() since when no reader is attached; None: one is
        self.num_batches = 0  # items (lists) handed to readers
        self.num_deltas = 0  # deltas and failures in them
        self.reader_transport: str | None = None  # how the latest reader reads: "socket" or "ray"
        self._buffer: list[ChannelItem] = []
        self._wake = asyncio.Event()
        self._reader: object | None = None  # the token of the attached reader

    def put(self, item: ChannelItem) -> None:
        self._buffer.append(item)
        self._wake.set()

    async def read(self, clock: Callable[[], float] = time.monotonic) -> AsyncIterator[list[ChannelItem]]:
        """Everything put since the previous item, as one list, while this reader is the
        channel's reader (a later read() takes over and this one returns)."""
        token = object()
        self._reader = token
        self.unread_since = None
        self._wake.set()  # a reader we replace wakes up and leaves
        try:
            while self._reader is token:
                if self._buffer:
                    batch, self._buffer = self._buffer, []
                    self.num_batches += 1
                    self.num_deltas += len(batch)
                    yield batch
                    continue
                self._wake.clear()
                await self._wake.wait()
        finally:
            if self._reader is token:
                self._reader = None
                self.unread_since = clock()


class OutputChannels:
    """A scheduler actor's channels by id, and the listeners that feed them."""

    def __init__(
        self,
        abort: Callable[[str], None],
        on_finished: Callable[[str], None],
        orphan_after_s: float = ORPHAN_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._abort = abort  # client request id -> finishes it now (EngineGroup.abort)
        self._on_finished = on_finished  # client request id -> bookkeeping after its last delta
        self.orphan_after_s = orphan_after_s
        self._clock = clock
        self.channels: dict[str, OutputChannel] = {}  # channel id -> channel

    def get(self, channel_id: str) -> OutputChannel:
        channel = self.channels.get(channel_id)
        if channel is None:
            channel = self.channels[channel_id] = OutputChannel(channel_id, self._clock())
        return channel

    def listener(self, channel: OutputChannel, request_id: str) -> StreamListener:
        """What the request's RequestStream calls with each delta (or its failure)."""
        channel.open_request_ids.add(request_id)

        def listen(stream: RequestStream, item: RequestOutput | BaseException) -> None:
            if isinstance(item, BaseException):
                channel.put(failure_of(stream.request_id, item))
            else:
                channel.put(item)
            if stream.finished:
                channel.open_request_ids.discard(request_id)
                self._on_finished(request_id)

        return listen

    def refused(self, channel: OutputChannel, request_id: str) -> None:
        """The request never started (refused or aborted before it arrived)."""
        channel.open_request_ids.discard(request_id)

    async def read(self, channel_id: str, transport: str = "ray") -> AsyncIterator[list[ChannelItem]]:
        channel = self.get(channel_id)
        channel.reader_transport = transport
        async for batch in channel.read(self._clock):
            yield batch

    async def serve_socket_reader(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One replica reading its channel over a Unix socket (asyncio.start_unix_server's
        callback): the first frame is the channel id, then each batch goes out as a frame
        until the replica hangs up or another reader of the channel takes over."""
        try:
            channel_id = pickle.loads(await read_frame(reader))
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return

        async def pump() -> None:
            async for batch in self.read(channel_id, transport="socket"):
                writer.write(encode_frame(batch))
                await writer.drain()

        pumping = asyncio.ensure_future(pump())
        hung_up = asyncio.ensure_future(reader.read())  # b"" at EOF: the replica went away
        try:
            await asyncio.wait({pumping, hung_up}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            pumping.cancel()
            hung_up.cancel()
            writer.close()
        if pumping.done() and not pumping.cancelled() and pumping.exception() is not None:
            logger.warning("output socket of channel %s failed: %r", channel_id, pumping.exception())
        if hung_up.done() and not hung_up.cancelled():
            hung_up.exception()  # a reset connection is a replica gone, as EOF is

    def reap_orphans(self) -> int:
        """Aborts the open requests of channels unread for orphan_after_s and drops those
        channels; returns how many requests were aborted."""
        now = self._clock()
        num_aborted = 0
        for channel_id, channel in list(self.channels.items()):
            if channel.unread_since is None or now - channel.unread_since < self.orphan_after_s:
                continue
            del self.channels[channel_id]
            for request_id in list(channel.open_request_ids):
                self._abort(request_id)
                num_aborted += 1
        return num_aborted
