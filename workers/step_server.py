"""The worker's end of the step channel (scheduler/step_channel.py): a Unix socket that
takes SchedulerOutputs and answers ModelRunnerOutputs, so a scheduler on the same node
steps this worker without a Ray actor call per step.

Each connection gets its own thread, which reads a frame, runs `handle` on it and writes
the reply, one frame at a time and in order. `handle` serializes with everything else
that touches the runner (WorkerActor holds one lock around the runner). The socket sits in
a fresh directory only this user can enter (private_socket_path), removed at close or exit.

Stdlib only (no torch, no Ray).
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import socket
import threading
from collections.abc import Callable
from typing import Any

from scheduler.step_channel import HEADER, encode_frame, picklable_error, private_socket_path

logger = logging.getLogger(__name__)


class StepServer:
    def __init__(self, handle: Callable[[Any], Any]) -> None:
        self._handle = handle
        self.path = private_socket_path("rayllm-steps-", "worker.sock")
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket.bind(self.path)
        self._socket.listen(4)
        self.num_steps = 0
        threading.Thread(target=self._accept_forever, name="step-server", daemon=True).start()

    def _accept_forever(self) -> None:
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(connection,), name="step-channel", daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        with connection, connection.makefile("rb") as stream:
            while True:
                header = stream.read(HEADER.size)
                if len(header) < HEADER.size:
                    return  # the scheduler went away
                body = stream.read(HEADER.unpack(header)[0])
                try:  # every frame gets a reply, so the scheduler's replies stay in step
                    reply = (True, self._handle(pickle.loads(body)))
                    self.num_steps += 1
                except Exception as error:
                    reply = (False, picklable_error(error))
                try:
                    frame = encode_frame(reply)
                except Exception as error:  # a result that does not pickle: that step fails
                    frame = encode_frame((False, RuntimeError(f"unpicklable step result: {error!r}")))
                try:
                    connection.sendall(frame)
                except OSError:
                    return

    def close(self) -> None:
        try:
            self._socket.close()
        finally:
            shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)
