"""Publishers of KV-cache event batches (kv_cache.events), over vLLM's transport.

The engine core hands a publisher one KVEventBatch after each step that changed the cache;
`publish` only queues it, so a step never waits on a socket or a slow subscriber. The ZeroMQ
publisher's own thread encodes each batch with msgspec and sends it as a three-frame message
on a PUB socket:

    [topic (UTF-8), sequence number (8 bytes, big-endian, from 0, +1 per batch sent), payload]

and, with a replay endpoint, serves a ROUTER socket from a buffer of the last `buffer_steps`
(sequence number, payload) pairs. A client sends the first sequence number it wants as 8
big-endian bytes and gets one [sequence number, payload] message per buffered batch from
there, then the end marker [-1 as 8 signed big-endian bytes, empty payload]. That is how a
subscriber that joined late or saw a gap in the sequence numbers catches up. The client
should be a DEALER socket sending [b"", start]: a REQ socket takes one reply per request,
so ZeroMQ drops every message after the first (libzmq 4.3, as pyzmq 27 bundles it).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import deque

import msgspec
import zmq

from kvserve.config import KVEventsConfig
from kvserve.kv_cache.events import KVEventBatch

log = logging.getLogger(__name__)

REPLAY_END = (-1).to_bytes(8, "big", signed=True)


def binds(endpoint: str) -> bool:
    """Whether the PUB socket binds `endpoint` (a wildcard host, ipc or inproc: kvserve is
    the stable end) or connects to it (a collector that binds, as vLLM decides it)."""
    return ("*" in endpoint or "::" in endpoint
            or endpoint.startswith(("ipc://", "inproc://")))


class KVEventPublisher(ABC):
    """Where the engine's event batches go. `publish` never blocks: a batch that cannot be
    queued is dropped and counted in `dropped`."""

    dropped: int = 0
    published: int = 0  # batches handed over (queued, or taken by the null publisher)

    @abstractmethod
    def publish(self, batch: KVEventBatch) -> None: ...

    @abstractmethod
    def close(self) -> None:
        """Send what is queued (briefly), then release sockets and threads. Idempotent."""


class NullPublisher(KVEventPublisher):
    """`publisher: "null"`: the engine collects its events, nothing is sent."""

    def publish(self, batch: KVEventBatch) -> None:
        self.published += 1

    def close(self) -> None:
        return


class ZmqPublisher(KVEventPublisher):
    """PUB (and optional ROUTER replay) sockets driven by a thread of their own. The sockets
    are made, used and closed only on that thread (ZeroMQ sockets are not thread-safe); a
    bind or connect that fails is raised from the constructor, so a bad endpoint stops the
    start-up instead of a silent thread."""

    POLL_S = 0.05  # how long the thread waits for a batch before it checks for replays
    CLOSE_S = 2.0  # how long close waits for the queued batches to go out

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self._queue: queue.Queue[KVEventBatch] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._encoder = msgspec.msgpack.Encoder()  # used on the publisher thread only
        self._ctx = zmq.Context()
        self._closing = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._dropping = False  # in a run of drops: warn once per run
        self.next_seq = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            self._ctx.term()
            raise ValueError(f"kv events: cannot open {config.endpoint}"
                             f"{' / ' + config.replay_endpoint if config.replay_endpoint else ''}"
                             f": {self._error}") from self._error
        log.info("KV events: publishing on %s (%s)%s, topic %r", config.endpoint,
                 "bound" if binds(config.endpoint) else "connected",
                 f", replay on {config.replay_endpoint}" if config.replay_endpoint else "",
                 config.topic)

    def publish(self, batch: KVEventBatch) -> None:
        if self._closing.is_set():
            return
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            if not self._dropping:
                log.warning("KV events: publisher queue full (%d batches); dropping batches "
                            "until it drains (%d dropped so far)", self.config.max_queue_size,
                            self.dropped)
            self._dropping = True
            return
        self._dropping = False
        self.published += 1

    def close(self) -> None:
        if self._closing.is_set():
            return
        self._closing.set()
        self._thread.join(self.CLOSE_S + 1.0)
        if self._thread.is_alive():
            log.warning("KV events: publisher thread did not stop in time")
            return  # its sockets stay with it; the daemon thread dies with the process
        self._ctx.term()

    def _open(self) -> tuple[zmq.Socket, zmq.Socket | None]:
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self.config.hwm)
        pub.setsockopt(zmq.LINGER, 500)  # let the last batches out at close, not forever
        replay = None
        try:
            endpoint = self.config.endpoint
            if binds(endpoint):
                pub.bind(endpoint)
            else:
                pub.connect(endpoint)
            if self.config.replay_endpoint is not None:
                replay = self._ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(self.config.replay_endpoint)
        except BaseException:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)
            raise
        return pub, replay

    def _run(self) -> None:
        try:
            pub, replay = self._open()
        except BaseException as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        deadline = None
        try:
            while True:
                if self._closing.is_set():
                    # Send what was queued before close, for a little while, then stop.
                    deadline = deadline or time.monotonic() + self.CLOSE_S
                    if self._queue.empty() or time.monotonic() > deadline:
                        break
                if replay is not None:
                    while replay.poll(0):
                        self._serve_replay(replay)
                try:
                    batch = self._queue.get(timeout=self.POLL_S)
                except queue.Empty:
                    continue
                payload = self._encode(batch)
                seq = self.next_seq.to_bytes(8, "big")
                try:
                    pub.send_multipart((self._topic, seq, payload))
                except zmq.ZMQError as e:  # a PUB send drops rather than blocks; not this
                    log.warning("KV events: batch %d not sent: %s", self.next_seq, e)
                self._buffer.append((self.next_seq, payload))
                self.next_seq += 1
        except Exception:
            log.exception("KV events: publisher thread failed; no more events are sent")
        finally:
            pub.close()
            if replay is not None:
                replay.close()

    def _encode(self, batch: KVEventBatch) -> bytes:
        return self._encoder.encode(batch)

    def _serve_replay(self, replay: zmq.Socket) -> None:
        """One replay request: [client, b"", start seq] in, the buffered batches from start
        seq out, then the end marker."""
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: ignoring a malformed replay request (%d frames)",
                        len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", REPLAY_END, b""))


def make_publisher(config: KVEventsConfig) -> KVEventPublisher:
    """The publisher `config` names (an enabled config: see KVEventsConfig.enabled)."""
    if config.publisher == "zmq":
        return ZmqPublisher(config)
    return NullPublisher()
