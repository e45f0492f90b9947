"""Channel policies: audio is never dropped under a slow consumer; video keeps the latest and counts drops."""

import asyncio

import numpy as np
import pytest

from runtime.channels import BlockingChannel, ChannelClosed, LatestChannel
from runtime.chunks import AudioChunk, VideoFrame


def _chunk(i: int, n: int = 160) -> AudioChunk:
    return AudioChunk(np.full(n, i, dtype=np.float32), start_sample=i * n)


@pytest.mark.asyncio
async def test_blocking_channel_never_drops_and_slows_the_producer():
    channel: BlockingChannel[AudioChunk] = BlockingChannel(4, "audio")
    sent = 200
    got: list[AudioChunk] = []
    producer_done_at: list[int] = []

    async def producer():
        for i in range(sent):
            await channel.put(_chunk(i))
        producer_done_at.append(len(got))
        channel.close()

    async def slow_consumer():
        async for chunk in channel:
            got.append(chunk)
            assert len(channel) <= channel.capacity
            await asyncio.sleep(0.0005)

    await asyncio.gather(producer(), slow_consumer())
    assert [int(c.samples[0]) for c in got] == list(range(sent))  # all, in order
    assert channel.stats.dropped == 0
    assert channel.stats.max_depth == channel.capacity  # it filled up...
    assert channel.stats.blocked_s > 0  # ...and the producer waited
    assert producer_done_at[0] >= sent - channel.capacity  # the producer could not run far ahead


@pytest.mark.asyncio
async def test_latest_channel_keeps_newest_and_counts_drops():
    channel: LatestChannel[VideoFrame] = LatestChannel(2, "video")
    image = np.zeros((4, 4, 3), dtype=np.uint8)
    dropped = sum(channel.put_nowait(VideoFrame(image, t / 10)) for t in range(10))
    assert dropped == 8 and channel.stats.dropped == 8
    channel.close()
    kept = [f.time async for f in channel]
    assert kept == [0.8, 0.9]


@pytest.mark.asyncio
async def test_latest_channel_with_a_live_consumer_delivers_in_order():
    channel: LatestChannel[int] = LatestChannel(1, "video")
    seen: list[int] = []

    async def consumer():
        async for item in channel:
            seen.append(item)
            await asyncio.sleep(0.002)

    task = asyncio.create_task(consumer())
    for i in range(50):
        channel.put_nowait(i)
        await asyncio.sleep(0.0003)
    channel.close()
    await task
    assert seen == sorted(seen) and seen[-1] == 49
    assert channel.stats.dropped == 50 - len(seen) > 0


@pytest.mark.asyncio
async def test_closed_channel_drains_then_ends_and_refuses_puts():
    channel: BlockingChannel[int] = BlockingChannel(3)
    await channel.put(1)
    await channel.put(2)
    channel.close()
    with pytest.raises(ChannelClosed):
        await channel.put(3)
    assert [await channel.get(), await channel.get(), await channel.get()] == [1, 2, None]


@pytest.mark.asyncio
async def test_close_releases_a_blocked_producer():
    channel: BlockingChannel[int] = BlockingChannel(1)
    await channel.put(1)
    blocked = asyncio.create_task(channel.put(2))
    await asyncio.sleep(0.01)
    assert not blocked.done()
    channel.close()
    with pytest.raises(ChannelClosed):
        await blocked


@pytest.mark.asyncio
async def test_stats_count_what_went_through_worked_out_by_hand():
    latest: LatestChannel[int] = LatestChannel(2, "video")
    assert latest.stats.to_dict() == {"policy": "latest", "capacity": 2, "depth": 0, "max_depth": 0, "put": 0,
                                      "got": 0, "dropped": 0, "blocked_s": 0.0}
    assert [latest.put_nowait(i) for i in range(5)] == [0, 0, 1, 1, 1]  # full from the third on: one out each
    assert latest.drain_nowait() == [3, 4]
    latest.put_nowait(5)
    assert await latest.get() == 5
    assert latest.stats.to_dict() == {"policy": "latest", "capacity": 2, "depth": 0, "max_depth": 2, "put": 6,
                                      "got": 3, "dropped": 3, "blocked_s": 0.0}

    blocking: BlockingChannel[int] = BlockingChannel(1, "audio")
    await blocking.put(0)  # room: no wait at all
    assert blocking.stats.blocked_s == 0.0

    async def consume_after(delay: float) -> None:
        await asyncio.sleep(delay)
        await blocking.get()

    for i in (1, 2):  # two waits of about 50 ms each add up
        reader = asyncio.create_task(consume_after(0.05))
        await blocking.put(i)
        await reader
    assert 0.1 <= blocking.stats.blocked_s < 2.0
    assert blocking.stats.to_dict()["blocked_s"] == round(blocking.stats.blocked_s, 4)
    assert (blocking.stats.put, blocking.stats.got, blocking.stats.depth, blocking.stats.max_depth) == (3, 2, 1, 1)


def test_refusals_say_which_channel_and_why():
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        BlockingChannel(0)
    named, nameless = LatestChannel(1, "video"), LatestChannel(1)
    named.close()
    nameless.close()
    with pytest.raises(ChannelClosed, match="^channel video is closed$"):
        named.put_nowait(1)
    with pytest.raises(ChannelClosed, match=r"^channel \? is closed$"):
        nameless.put_nowait(1)


@pytest.mark.asyncio
async def test_a_put_on_a_closed_blocking_channel_names_it():
    channel: BlockingChannel[int] = BlockingChannel(1, "questions")
    channel.close()
    with pytest.raises(ChannelClosed, match="^channel questions is closed$"):
        await channel.put(1)
    assert channel.stats.put == 0 and channel.stats.blocked_s == 0.0


@pytest.mark.asyncio
async def test_a_drain_counts_what_it_took_and_empties_the_channel():
    # The video processor drains every batch, so its channel's metrics are what `drain_nowait` leaves behind.
    channel: LatestChannel[int] = LatestChannel(4, "video")
    for i in range(3):
        channel.put_nowait(i)
    assert await channel.get() == 0
    assert channel.drain_nowait() == [1, 2]
    assert (channel.stats.got, channel.stats.depth, len(channel)) == (3, 0, 0)  # one get + two drained
    assert channel.drain_nowait() == [] and (channel.stats.got, channel.stats.depth) == (3, 0)
    assert channel.stats.to_dict() == {"policy": "latest", "capacity": 4, "depth": 0, "max_depth": 3, "put": 3,
                                       "got": 3, "dropped": 0, "blocked_s": 0.0}
    blocking: BlockingChannel[int] = BlockingChannel(2, "audio")
    await blocking.put(0)
    await blocking.put(1)
    waiting = asyncio.create_task(blocking.put(2))  # full: waits
    await asyncio.sleep(0.01)
    assert not waiting.done() and blocking.drain_nowait() == [0, 1] and blocking.stats.depth == 0
    await asyncio.wait_for(waiting, 1)  # a drain makes room at once
    assert (blocking.stats.put, blocking.stats.got, blocking.stats.depth) == (3, 2, 1)
