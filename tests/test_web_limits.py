"""Per-session rate bounds: a token bucket admits the sustained rate plus its burst and nothing more; frames
past it are dropped and reported at most once per second with the count dropped in between, audio past it
waits for its turn."""

from runtime.config import ServeConfig
from runtime.web.limits import SessionLimits, TokenBucket


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_bucket_admits_its_burst_then_its_rate():
    clock = Clock()
    bucket = TokenBucket(rate=10.0, capacity=5.0, clock=clock)
    assert [bucket.take(1) for _ in range(6)] == [True] * 5 + [False]
    clock.now += 0.25  # 2.5 units refilled
    assert [bucket.take(1) for _ in range(3)] == [True, True, False]
    clock.now += 100  # never above capacity
    assert sum(bucket.take(1) for _ in range(10)) == 5
    assert not bucket.take(6)  # more than it can ever hold


def test_frames_over_the_rate_are_dropped_and_reported_once_a_second():
    clock = Clock()
    limits = SessionLimits(ServeConfig(max_frames_per_s=5.0), clock)
    assert [limits.admit_frame() for _ in range(6)] == [True] * 5 + [False]
    first = limits.report()  # what the driver does after each refusal
    assert first is not None and "5 per second" in first and "dropped 1 frame(s)" in first
    for _ in range(2):
        assert not limits.admit_frame()
        assert limits.report() is None  # within the same second: counted, not reported
    clock.now += 0.1
    assert not limits.admit_frame()  # 0.5 frames refilled: still short
    clock.now += 1.0
    later = limits.report()
    assert later is not None and "dropped 3 frame(s) since the last report, 4 in all" in later
    assert limits.admit_frame()  # the rate refilled the bucket
    assert limits.counts["image"] == 4


def test_audio_faster_than_the_bound_waits_after_the_burst():
    clock = Clock()
    limits = SessionLimits(ServeConfig(max_audio_speed=2.0, audio_burst_s=10.0), clock)
    second = 16000
    assert [limits.pace_audio(second) for _ in range(10)] == [0.0] * 10  # the 10 s burst
    assert limits.pace_audio(second) == 0.5  # two media seconds per wall second: wait half a second
    assert limits.pace_audio(second) == 1.0  # reservations queue behind each other
    clock.now += 1.0  # paid back: one wall second refilled two media seconds
    assert limits.pace_audio(second) == 0.5
    assert limits.counts["audio_paced_s"] == 2.0


def test_frame_timestamps_are_bounded_by_the_pace_and_one_message_by_the_burst():
    clock = Clock()
    limits = SessionLimits(ServeConfig(max_audio_speed=2.0, audio_burst_s=10.0), clock)
    assert limits.media_horizon() == 10.0  # at the start: the burst alone
    clock.now += 5.0
    assert limits.media_horizon() == 20.0  # then two media seconds per wall second
    assert limits.max_audio_message_s == 10.0  # a longer single message is refused as too large
