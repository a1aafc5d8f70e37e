"""KV-cache events (--kv-events-config): vLLM's wire layout and transport, the events the
block pool and the tiers log, and what a ZeroMQ subscriber sees from an engine and a server."""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import asdict
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from kvserve.config import KVEventsConfig
from kvserve.engine.args import EngineArgs
from kvserve.engine.kv_events import REPLAY_END, ZmqPublisher, binds
from kvserve.entrypoints import cli
from kvserve.kv_cache.block_pool import BlockPool
from kvserve.kv_cache.events import (
    MEDIUM_DISK,
    MEDIUM_HOST,
    MEDIUM_POOL,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventLog,
    wire_hash,
)
from kvserve.kv_cache.hashing import ROOT_HASH, BlockKey, hash_block
from kvserve.sample.sampling_params import SamplingParams
from tests.conftest import make_llm
from tests.server_utils import run_server

BLOCK = 4
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def chain(tokens: list[int], salt: bytes = b"") -> list[BlockKey]:
    """The keys of the full blocks of `tokens`, computed here from kv_cache.hashing's chain
    (what a router that knows kvserve's hash would compute)."""
    keys, parent = [], ROOT_HASH
    for i in range(len(tokens) // BLOCK):
        block = tuple(tokens[i * BLOCK:(i + 1) * BLOCK])
        h = hash_block(parent, block, salt if i == 0 else b"")
        keys.append(BlockKey(h, parent, block))
        parent = h
    return keys


class Subscriber:
    """What a KV-aware router runs: a SUB socket on the topic, and a DEALER for replays."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, config.topic.encode())
        self.sub.connect(config.endpoint.replace("*", "127.0.0.1"))
        self.topic = config.topic.encode()
        self.replay_endpoint = config.replay_endpoint
        time.sleep(0.3)  # ZeroMQ's slow joiner: the subscription must reach the PUB socket

    def receive(self, timeout_ms: int = 3000) -> tuple[int, bytes] | None:
        if not self.sub.poll(timeout_ms):
            return None
        topic, seq, payload = self.sub.recv_multipart()
        assert topic == self.topic and len(seq) == 8
        return int.from_bytes(seq, "big"), payload

    def drain(self, settle_ms: int = 300) -> list[tuple[int, KVEventBatch]]:
        out = []
        while (got := self.receive(settle_ms)) is not None:
            out.append((got[0], DECODER.decode(got[1])))
        return out

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        assert self.replay_endpoint is not None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        try:
            while True:
                assert dealer.poll(3000), "no end marker from the replay socket"
                empty, seq, payload = dealer.recv_multipart()
                assert empty == b""
                if seq == REPLAY_END:
                    assert payload == b""
                    return got
                got.append((int.from_bytes(seq, "big"), payload))
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


def ipc_config(tmp_path: Path, **kw) -> KVEventsConfig:
    # ipc sockets: no port to race for
    return KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/kv-pub",
                          replay_endpoint=f"ipc://{tmp_path}/kv-replay", topic="kvserve", **kw)


def resident(batches: list[KVEventBatch], medium: str) -> set[int]:
    """Block hashes a consumer believes `medium` holds after applying `batches` in order."""
    held: set[int] = set()
    for batch in batches:
        for e in batch.events:
            if isinstance(e, AllBlocksCleared):
                held.clear()
            elif e.medium == medium:
                if isinstance(e, BlockStored):
                    held.update(e.block_hashes)
                else:
                    held.difference_update(e.block_hashes)
    return held


def kv_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kv-events" and t.is_alive()]


# -------------------------------------------------------------------- the wire layout


def test_batch_encodes_as_vllm_positional_arrays():
    """Plain msgpack decoding shows vLLM's array layout: the batch [ts, events, dp rank],
    each event [tag, fields in vLLM's order]; a 128-bit kvserve hash goes out as its low 64
    bits, an unsigned MessagePack integer."""
    big = (0xABCD << 64) | 0xFFFF_0000_0000_1234
    batch = KVEventBatch(12.5, [
        BlockStored([wire_hash(big), 7], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU"),
        BlockRemoved([7], "CPU"),
        AllBlocksCleared(),
    ], 0)
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(batch))
    assert raw == [12.5, [
        ["BlockStored", [0xFFFF_0000_0000_1234, 7], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None,
         "GPU"],
        ["BlockRemoved", [7], "CPU"],
        ["AllBlocksCleared"],
    ], 0]
    assert DECODER.decode(msgspec.msgpack.encode(batch)) == batch


def test_event_log_coalesces_chains_and_removals():
    keys = chain(list(range(100, 116)))
    other = chain(list(range(200, 208)))
    log = KVEventLog(BLOCK)
    for key in keys[:3]:
        log.stored(key, MEDIUM_POOL)
    log.stored(other[0], MEDIUM_POOL)  # a new chain: a new event
    log.stored(keys[3], MEDIUM_HOST)  # continues the chain, but in another medium
    log.removed(keys[0].block_hash, MEDIUM_POOL)
    log.removed(keys[1].block_hash, MEDIUM_POOL)
    log.removed(keys[2].block_hash, MEDIUM_DISK)
    events = log.take()
    assert len(log) == 0 and log.take() == []
    w = [wire_hash(k.block_hash) for k in keys]
    assert events == [
        BlockStored(w[:3], None, list(range(100, 112)), BLOCK, None, "GPU"),
        BlockStored([wire_hash(other[0].block_hash)], None, list(range(200, 204)), BLOCK,
                    None, "GPU"),
        BlockStored([w[3]], w[2], list(range(112, 116)), BLOCK, None, "CPU"),
        BlockRemoved(w[:2], "GPU"),
        BlockRemoved([w[2]], "DISK"),
    ]


def test_block_pool_logs_stores_evictions_and_reset():
    """Stored minus removed is what the pool caches, after hits, evictions and a reset."""
    log = KVEventLog(BLOCK)
    pool = BlockPool(4, events=log)
    keys = chain(list(range(24)))  # 6 blocks
    blocks = pool.allocate(4)
    for b, k in zip(blocks, keys, strict=False):
        pool.cache(b, k)
    pool.cache(blocks[0], keys[0])  # already cached: no second event
    pool.free(reversed(blocks))
    fresh = pool.allocate(2)  # evicts the two tail blocks (freed first)
    pool.cache(fresh[0], keys[4])
    batches = [KVEventBatch(0.0, log.take(), 0)]
    w = [wire_hash(k.block_hash) for k in keys]
    assert batches[0].events == [
        BlockStored(w[:4], None, list(range(16)), BLOCK, None, "GPU"),
        BlockRemoved([w[3], w[2]], "GPU"),
        BlockStored([w[4]], w[3], list(range(16, 20)), BLOCK, None, "GPU"),
    ]
    assert resident(batches, "GPU") == {wire_hash(h) for h in pool.cached}
    pool.reset_prefix_cache()
    batches.append(KVEventBatch(1.0, log.take(), 0))
    assert batches[1].events == [AllBlocksCleared()]
    assert resident(batches, "GPU") == set() and not pool.cached


# ---------------------------------------------------------------------- the config


@pytest.mark.parametrize(("value", "message"), [
    ('{"enable_kv_cache_events": true, "bogus": 1}', "unknown kv-events-config field"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher must be one of"),
    ('{"enable_kv_cache_events": true, "endpoint": "tcp://*"}', "is not tcp://HOST:PORT"),
    ('{"enable_kv_cache_events": true, "endpoint": "http://x:1"}', "is not tcp://HOST:PORT"),
    ('{"enable_kv_cache_events": true, "endpoint": "tcp://*:70000"}', "port must be"),
    ('{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:5557"}', "must differ"),
    ('{"enable_kv_cache_events": true, "buffer_steps": -1}', "buffer_steps must be"),
    ('{"enable_kv_cache_events": true, "hwm": -5}', "hwm must be"),
    ('{"enable_kv_cache_events": true, "max_queue_size": 0}', "max_queue_size must be"),
    ('{"enable_kv_cache_events": "yes"}', "true or false"),
    ('{"enable_kv_cache_events": true,', "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
])
def test_bad_configs_are_refused(value, message):
    with pytest.raises(ValueError, match=message):
        KVEventsConfig.parse(value)


def test_config_defaults_follow_vllm():
    on = KVEventsConfig.parse('{"enable_kv_cache_events": true}')
    assert on is not None and on.publisher == "zmq" and on.endpoint == "tcp://*:5557"
    assert (on.buffer_steps, on.hwm, on.max_queue_size, on.topic) == (10_000, 100_000,
                                                                       100_000, "")
    off = KVEventsConfig.parse({"publisher": "zmq"})
    assert off is not None and not off.enabled
    assert KVEventsConfig.parse(None) is None and KVEventsConfig.parse("") is None
    assert binds("tcp://*:5557") and binds("ipc:///tmp/x") and not binds("tcp://10.0.0.1:5557")


def test_serve_refuses_a_bad_config_with_a_message(tiny_llama_dir, capsys):
    for value, message in [('{"enable_kv_cache_events": true, "hwm": -1}', "hwm must be"),
                           ('{"enable_kv_cache_events": true}', "need prefix caching")]:
        rc = cli.main(["serve", "--model", str(tiny_llama_dir), "--kv-events-config", value,
                       *(["--no-enable-prefix-caching"] if "prefix" in message else [])])
        err = capsys.readouterr().err
        assert rc == 2 and "kvserve: error:" in err and message in err, err
        assert "Traceback" not in err


# ---------------------------------------------------------------------- the publisher


def sample_batch(i: int) -> KVEventBatch:
    return KVEventBatch(float(i), [BlockRemoved([i], "GPU")], 0)


def test_publisher_sequence_numbers_and_replay(tmp_path):
    config = ipc_config(tmp_path, buffer_steps=6)
    publisher = ZmqPublisher(config)
    sub = Subscriber(config)
    try:
        for i in range(10):
            publisher.publish(sample_batch(i))
        got = sub.drain()
        assert [seq for seq, _ in got] == list(range(10))  # +1 per batch, from 0
        assert [b.events[0].block_hashes for _, b in got] == [[i] for i in range(10)]
        # the buffer holds the last 6 batches: a replay from 7 gets 7..9, from 0 gets 4..9
        replayed = sub.replay(7)
        assert [seq for seq, _ in replayed] == [7, 8, 9]
        assert [DECODER.decode(p).events[0].block_hashes for _, p in replayed] == [[7], [8],
                                                                                   [9]]
        assert [seq for seq, _ in sub.replay(0)] == [4, 5, 6, 7, 8, 9]
        assert sub.replay(10) == []
    finally:
        publisher.close()
        sub.close()
    assert not kv_threads()


def test_publisher_binds_tcp_and_filters_by_topic(tmp_path):
    port = free_port()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}",
                            topic="replica-a")
    publisher = ZmqPublisher(config)
    mine, others = Subscriber(config), Subscriber(
        KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}",
                       topic="replica-b"))
    try:
        publisher.publish(sample_batch(0))
        assert mine.receive() is not None
        assert others.receive(300) is None
    finally:
        publisher.close()
        mine.close()
        others.close()


def test_a_full_queue_drops_instead_of_blocking(tmp_path):
    """The thread is held inside its first encode: one batch fits the queue, the next ones
    are dropped at once and counted; the step that published them never waits."""
    entered, release = threading.Event(), threading.Event()

    class HeldPublisher(ZmqPublisher):
        def _encode(self, batch):
            entered.set()
            release.wait(10)
            return super()._encode(batch)

    config = ipc_config(tmp_path, max_queue_size=1)
    publisher = HeldPublisher(config)
    sub = Subscriber(config)
    try:
        publisher.publish(sample_batch(0))
        assert entered.wait(5)
        publisher.publish(sample_batch(1))  # queued
        t0 = time.perf_counter()
        publisher.publish(sample_batch(2))  # queue full: dropped
        publisher.publish(sample_batch(3))
        assert time.perf_counter() - t0 < 0.05
        assert publisher.dropped == 2 and publisher.published == 2
        release.set()
        got = sub.drain()
        assert [(seq, b.events[0].block_hashes) for seq, b in got] == [(0, [0]), (1, [1])]
    finally:
        release.set()
        publisher.close()
        sub.close()


def free_port() -> int:
    with socket.socket() as s:  # let go just before the publisher binds it
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_endpoint_in_use_fails_at_start(tmp_path):
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{free_port()}")
    first = ZmqPublisher(config)
    try:
        with pytest.raises(ValueError, match="kv events: cannot open tcp://"):
            ZmqPublisher(config)
    finally:
        first.close()
    assert not kv_threads()


# ------------------------------------------------------------- an engine's events


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 37 + 11 * i) % 250 + 3 for i in range(n)]


@pytest.mark.slow
def test_llm_publishes_prompt_blocks_evictions_and_reset(tiny_llama_dir, tmp_path):
    config = ipc_config(tmp_path)
    # 12 blocks of 4 tokens: the fourth 18-token prompt evicts; no calibration requests
    llm = make_llm(tiny_llama_dir, num_kv_blocks=12, target_itl_ms=0,
                   kv_events_config=json.dumps(asdict(config)))  # as the flag gives it
    sub = Subscriber(config)
    try:
        first = tokens(1, 18)
        llm.generate([first], ONE_TOKEN)
        (seq0, batch0), = sub.drain()
        assert seq0 == 0 and batch0.data_parallel_rank == 0
        expected = chain(first)  # 4 full blocks; the 18th token's block is partial
        assert batch0.events == [BlockStored([wire_hash(k.block_hash) for k in expected], None,
                                             first[:16], BLOCK, None, "GPU")]
        # the same 8 tokens then new ones: stored from block 2 on, its parent block 1
        second = first[:8] + tokens(2, 10)
        llm.generate([second], ONE_TOKEN)
        (seq1, batch1), = sub.drain()
        keys2 = chain(second)
        assert seq1 == 1 and batch1.events == [
            BlockStored([wire_hash(k.block_hash) for k in keys2[2:]],
                        wire_hash(keys2[1].block_hash), second[8:16], BLOCK, None, "GPU")]
        # decoded without the Structs: vLLM's field order, position by position
        raw = msgspec.msgpack.decode(sub.replay(1)[0][1])
        assert raw[1][0] == ["BlockStored", [wire_hash(k.block_hash) for k in keys2[2:]],
                             wire_hash(keys2[1].block_hash), second[8:16], BLOCK, None, "GPU"]
        batches = [batch0, batch1]
        for seed in (3, 4, 5):
            llm.generate([tokens(seed, 18)], ONE_TOKEN)
        later = sub.drain()
        assert [seq for seq, _ in later] == [2, 3, 4]
        batches += [b for _, b in later]
        removed = [e for b in batches for e in b.events if isinstance(e, BlockRemoved)]
        assert removed and all(e.medium == "GPU" for e in removed)
        pool = llm.engine.local_core.kv.pool
        assert resident(batches, "GPU") == {wire_hash(h) for h in pool.cached}
        assert len(pool.cached) > 0
        llm.reset_prefix_cache()
        (seq5, reset), = sub.drain()
        assert seq5 == 5 and reset.events == [AllBlocksCleared()]
        assert not pool.cached
    finally:
        sub.close()
        llm.close()
    assert not kv_threads()


def test_each_rank_gets_its_own_endpoints():
    """vLLM's rule for data-parallel ranks: a tcp port plus the rank, an ipc or inproc name
    with _dp{rank}; rank 0 as given; and a config whose ranks would meet is refused."""
    tcp = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:5557",
                         replay_endpoint="tcp://127.0.0.1:6000")
    assert tcp.for_rank(0) is tcp
    three = tcp.for_rank(3)
    assert (three.endpoint, three.replay_endpoint) == ("tcp://*:5560", "tcp://127.0.0.1:6003")
    assert three.topic == tcp.topic and three.enabled
    ipc = KVEventsConfig(enable_kv_cache_events=True, endpoint="ipc:///tmp/kv",
                         replay_endpoint="inproc://replay")
    assert (ipc.for_rank(2).endpoint, ipc.for_rank(2).replay_endpoint) == \
        ("ipc:///tmp/kv_dp2", "inproc://replay_dp2")
    tcp.check_ranks(443)  # 5557..5999 and 6000..6442: apart
    with pytest.raises(ValueError, match="rank 443 and rank 0 would both use tcp://"):
        KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:5557",
                       replay_endpoint="tcp://*:6000").check_ranks(444)
    with pytest.raises(ValueError, match="past 65535"):
        KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:65535").for_rank(1)


def test_a_ranked_engine_publishes_on_its_endpoint_with_its_rank(tiny_llama_dir, tmp_path):
    """--data-parallel-rank 2: the engine binds the endpoints of rank 2 and its batches say
    data_parallel_rank 2, so one --kv-events-config serves every replica."""
    config = ipc_config(tmp_path)
    llm = make_llm(tiny_llama_dir, target_itl_ms=0, data_parallel_rank=2,
                   kv_events_config=json.dumps(asdict(config)))
    sub = Subscriber(config.for_rank(2))
    try:
        llm.generate([tokens(1, 18)], ONE_TOKEN)
        (seq, batch), = sub.drain()
        assert seq == 0 and batch.data_parallel_rank == 2 and batch.events
        assert sub.replay(0)[0][0] == 0  # the replay endpoint is rank 2's too
    finally:
        sub.close()
        llm.close()
    with pytest.raises(ValueError, match="--data-parallel-rank must be >= 0"):
        make_llm(tiny_llama_dir, data_parallel_rank=-1)


@pytest.mark.slow
def test_tier_events_carry_their_medium(tiny_llama_dir, tmp_path):
    """A pool of 8 blocks over a host tier of 4 that spills to disk: the events of each
    medium, applied in order, give exactly what that medium holds."""
    config = ipc_config(tmp_path)
    block_bytes = 2 * 2 * 2 * BLOCK * 16 * 4  # layers x K/V x KV heads x tokens x dim x fp32
    llm = make_llm(tiny_llama_dir, num_kv_blocks=8, target_itl_ms=0,
                   host_kv_cache_memory=4 * block_bytes, kv_cache_dir=str(tmp_path / "disk"),
                   kv_events_config=asdict(config))
    sub = Subscriber(config)
    try:
        for seed in range(6):
            llm.generate([tokens(seed, 14)], ONE_TOKEN)
        batches = [b for _, b in sub.drain()]
        media = {e.medium for b in batches for e in b.events if isinstance(e, BlockStored)}
        assert media == {"GPU", "CPU", "DISK"}
        assert any(isinstance(e, BlockRemoved) and e.medium == "CPU"
                   for b in batches for e in b.events)
        kv = llm.engine.local_core.kv
        host, disk = kv.store.tiers
        for medium, held in (("GPU", list(kv.pool.cached)),
                             ("CPU", [k.block_hash for k in host.held_keys()]),
                             ("DISK", [k.block_hash for k in disk.held_keys()])):
            assert held, medium
            assert resident(batches, medium) == {wire_hash(h) for h in held}, medium
        # a tier's BlockStored carries the block's parent and tokens too
        disk_stores = [e for b in batches for e in b.events
                       if isinstance(e, BlockStored) and e.medium == "DISK"]
        assert all(len(e.token_ids) == BLOCK * len(e.block_hashes) for e in disk_stores)
        # after a reset the lower tiers are announced again, right after the clear
        llm.reset_prefix_cache()
        (_, reset), = sub.drain()
        assert reset.events[0] == AllBlocksCleared()
        assert resident(batches + [reset], "CPU") == {
            wire_hash(k.block_hash) for k in host.held_keys()}
        assert resident(batches + [reset], "GPU") == set()
    finally:
        sub.close()
        llm.close()


@pytest.mark.slow
def test_null_publisher_collects_but_sends_nothing(tiny_llama_dir, tmp_path):
    config = ipc_config(tmp_path, publisher="null")
    llm = make_llm(tiny_llama_dir, target_itl_ms=0, kv_events_config=asdict(config))
    try:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(config.endpoint)
        time.sleep(0.2)
        llm.generate([tokens(9, 18)], ONE_TOKEN)
        publisher = llm.engine.local_core.kv_events
        assert type(publisher).__name__ == "NullPublisher" and publisher.published == 1
        assert not sub.poll(300)
        sub.close(linger=0)
        ctx.term()
    finally:
        llm.close()
    assert not kv_threads()


@pytest.mark.slow
def test_server_publishes_and_shuts_down_cleanly(tiny_llama_dir, tmp_path):
    config = ipc_config(tmp_path)
    args = EngineArgs(model=str(tiny_llama_dir), dtype="float32", block_size=BLOCK,
                      num_kv_blocks=64, target_itl_ms=0, kv_events_config=asdict(config))
    with run_server(args) as (url, _app):
        sub = Subscriber(config)
        try:
            r = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": tiny_llama_dir.name, "prompt": tokens(4, 18), "max_tokens": 2,
                "temperature": 0})
            assert r.status_code == 200, r.text
            got = sub.drain(1000)
            assert got and got[0][0] == 0
            stored = got[0][1].events[0]
            assert isinstance(stored, BlockStored) and stored.token_ids == tokens(4, 18)[:16]
        finally:
            sub.close()
    deadline = time.monotonic() + 5
    while kv_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not kv_threads()
    # the sockets are closed: the endpoint can be bound again
    again = ZmqPublisher(config)
    again.close()
