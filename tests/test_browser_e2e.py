"""The demo page in a real browser: headless Chromium with a fake camera and microphone (the demo speech and
the demo scene, from files made here) opens the page of an in-process server, connects over WebRTC, shows
live captions, asks a question and shows the streamed answer. The tiny profile has random weights, so the
captions and the answer are noise: the test checks that they arrive, not what they say. One test hears the page
speak: a scripted answer in the real voice (Piper's joe), measured in the page by WebAudio on the track it plays."""

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import av
import numpy as np
import pytest
import soundfile
from session_fakes import ScriptAnswerer, WordASR, profile_for
from weights_common import packaged_or_skip

from runtime.io.sample import demo_speech, render_frame
from runtime.loaded_models import Models, load_models
from runtime.profile_files import load_profile
from runtime.session_builder import open_session
from runtime.web.server import RealtimeServer
from runtime.worker import DeviceWorker, Priority

# paced in real time with time-outs: `make test` runs these alone, after the rest (docs/testing.md)
pytestmark = pytest.mark.realtime

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CHROMIUM = "/usr/bin/chromium"  # Debian's package; Playwright's own browser downloads are never used
TOTAL_TIMEOUT_S = 90
FPS, SIZE, VIDEO_S = 10, (320, 240), 4.0
HAS_TEXT = "document.getElementById({!r}).textContent.trim().length > 0"


def chromium_or_skip() -> str:
    if os.path.exists(CHROMIUM):
        return CHROMIUM
    reason = f"{CHROMIUM} not found: install Debian's chromium (apt-get install chromium) to run the browser test"
    if os.environ.get("CI"):
        pytest.fail(reason, pytrace=False)  # CI installs it (.ci/run): missing there is a real failure
    pytest.skip(reason)


def write_fake_media(folder: Path) -> tuple[Path, Path]:
    """The fake microphone (WAV, PCM16) and camera (Y4M, planar I420); Chromium loops both."""
    wav = folder / "speech.wav"
    soundfile.write(wav, demo_speech(), 16000, subtype="PCM_16")  # Chromium resamples to its own rate

    y4m = folder / "scene.y4m"
    width, height = SIZE
    with open(y4m, "wb") as out:
        out.write(f"YUV4MPEG2 W{width} H{height} F{FPS}:1 Ip A1:1 C420jpeg\n".encode())
        for i in range(int(VIDEO_S * FPS)):
            rgb = av.VideoFrame.from_ndarray(render_frame(i / FPS, width, height), format="rgb24")
            i420 = rgb.reformat(format="yuv420p").to_ndarray()  # Y, then U, then V: [height * 3 / 2, width]
            out.write(b"FRAME\n" + np.ascontiguousarray(i420).tobytes())
    return wav, y4m


def browser_args(wav: Path, y4m: Path) -> list[str]:
    return [
        "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        # getUserMedia without a prompt, from files instead of devices
        "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-video-capture={y4m}", f"--use-file-for-fake-audio-capture={wav}",
        # ICE: plain IP host candidates (aiortc does not resolve mDNS .local names), loopback included
        "--disable-features=WebRtcHideLocalIpsWithMdns", "--allow-loopback-in-peer-connection",
        # a headless tab must not throttle the media or the timers
        "--autoplay-policy=no-user-gesture-required", "--disable-renderer-backgrounding",
        "--disable-background-timer-throttling", "--disable-backgrounding-occluded-windows",
    ]


class Deadline:
    """One time budget for a whole test, so a slow step cannot hide behind a later one's fresh timeout."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def ms(self) -> float:
        """What is left, for a Playwright timeout (at least 1 s: a timeout of 0 would mean none)."""
        return max(1.0, self.end - time.monotonic()) * 1000

    @property
    def passed(self) -> bool:
        return time.monotonic() >= self.end


@contextlib.asynccontextmanager
async def browser_page(folder: Path, problems: list[str]) -> AsyncIterator:
    """A page in headless Chromium with the fake devices; page errors and console errors go to `problems`."""
    from playwright.async_api import async_playwright

    executable = chromium_or_skip()
    wav, y4m = write_fake_media(folder)
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=executable, headless=True, args=browser_args(wav, y4m))
        try:
            page = await browser.new_page()
            page.on("pageerror", lambda err: problems.append(f"pageerror: {err}"))
            page.on("console", lambda msg: problems.append(f"console.{msg.type}: {msg.text}")
                    if msg.type == "error" else None)
            yield page
        finally:
            await browser.close()


async def text_of(page, selector: str) -> str:
    return (await page.text_content(selector) or "").strip()


async def wait_for(page, condition: str, deadline: Deadline, what: str, problems: list[str]) -> None:
    """Wait for a JS condition; on timeout say what the page's status line and console said, not only that."""
    try:
        await page.wait_for_function(condition, timeout=deadline.ms())
    except Exception as exc:
        raise AssertionError(f"{what}; status: {await text_of(page, '#status')!r}; problems: {problems}") from exc


async def sessions_gone(server: RealtimeServer, deadline: Deadline) -> None:
    while server.sessions and not deadline.passed:
        await asyncio.sleep(0.05)
    assert not server.sessions


@pytest.fixture(scope="module")
def tiny():
    profile = load_profile("tiny", overrides=["pipeline.metrics_interval_s=1", "lm.max_new_tokens=8"])
    with DeviceWorker() as worker:
        yield profile, load_models(profile, worker), worker  # RealtimeServer(*tiny) order


@pytest.mark.asyncio
async def test_page_shows_live_captions_and_a_streamed_answer(tiny, tmp_path):
    deadline, problems = Deadline(TOTAL_TIMEOUT_S), []
    async with RealtimeServer(*tiny, port=0) as server, browser_page(tmp_path, problems) as page:
        await page.goto(f"http://127.0.0.1:{server.port}/", timeout=deadline.ms())
        assert await page.title() == "runtime: live captions and video QA"
        await page.click("#start")
        await wait_for(page, HAS_TEXT.format("captions"), deadline, "no captions", problems)

        await page.fill("#question", "what moved?")
        await page.press("#question", "Enter")  # Enter asks, as the button does
        await wait_for(page, HAS_TEXT.format("answer"), deadline, "no answer", problems)
        # The latency readout: ask-to-first-token measured here, the ASR lag from a server metrics event.
        await wait_for(page, "/\\d/.test(document.getElementById('lat-first').textContent)"
                             " && /\\d/.test(document.getElementById('lat-asr').textContent)",
                       deadline, "no latency readout", problems)
        captions, answer = await text_of(page, "#captions"), await text_of(page, "#answer")
        status = await text_of(page, "#status")
        # The conversation view: the typed question, then its answer, as the server ordered them.
        await wait_for(page, "document.querySelectorAll('#conversation li.assistant').length >= 1", deadline,
                       "no answer in the conversation view", problems)
        # (the page's own speech may have ended a turn first: its audio item is a user item too)
        users = await page.eval_on_selector_all("#conversation li.user .text", "els => els.map(e => e.textContent)")
        assert "what moved?" in [u.strip() for u in users], users

        # The media tracks reached the session: audio heard, frames sampled.
        (session,) = server.sessions.values()
        metrics = session.metrics()
        assert metrics["asr"]["heard_until"] > 0 and metrics["video"]["frames_in"] > 0, metrics

        # A second question through the button; the answer box starts over for it. A third right after it, while
        # the second is asked for or answered: the server takes one response at a time, so the page asks for the
        # third once the second is done, and both are answered. The first answer ends first: two questions typed
        # while it runs are asked for together after it, in one response (the page keeps what was typed meanwhile),
        # which is what failed this test in CI twice (the server idle with two answers of three, until 300 s).
        await wait_for(page, "!/^(asked|answering)/.test(document.getElementById('answer-status').textContent)",
                       deadline, "the first answer did not end", problems)
        await page.evaluate("""() => {  // both in one go, so the third is typed before the second is answered
            const question = document.getElementById('question'), button = document.getElementById('ask');
            question.value = 'and then?'; button.click();
            question.value = 'why?'; button.click();
        }""")
        # (counted by the server: a random-weight answer may be empty text, which adds no assistant item to show)
        while session.answers.answered < 3:
            assert not deadline.passed, (f"the second and third questions were not both answered "
                                         f"({session.answers.answered} answers in all): {problems}")
            await asyncio.sleep(0.05)
        await wait_for(page, "document.getElementById('answer-status').textContent.includes('why?')"
                             " && document.getElementById('answer').textContent.trim().length > 0",
                       deadline, "no third answer", problems)
        assert not (await text_of(page, "#status")).startswith("error"), await text_of(page, "#status")

        await page.click("#stop")
        assert await text_of(page, "#status") == "stopped"
        await sessions_gone(server, deadline)  # Stop closed the peer connection: the server lets its session go

    assert captions and answer
    assert status.startswith("live"), status
    assert not problems, problems


@pytest.mark.asyncio
async def test_page_says_plainly_when_the_token_is_wrong(tiny, tmp_path):
    deadline, problems = Deadline(TOTAL_TIMEOUT_S), []
    async with (RealtimeServer(*tiny, port=0, token="s3cret") as server,
                browser_page(tmp_path, problems) as page):
        await page.goto(f"http://127.0.0.1:{server.port}/?token=wrong", timeout=deadline.ms())
        assert await page.input_value("#token") == "wrong"  # prefilled from the page's URL
        await page.click("#start")
        await wait_for(page, "document.getElementById('status').classList.contains('error')", deadline,
                       "no error shown", problems)
        status = await text_of(page, "#status")
        assert "401" in status and "unauthorized" in status and "token" in status, status
        assert await page.is_enabled("#start") and not server.sessions  # nothing left half-open

        await page.fill("#token", "s3cret")
        await page.click("#start")
        await wait_for(page, "document.getElementById('status').classList.contains('live')", deadline,
                       "the right token did not connect", problems)
        await page.click("#stop")
        await sessions_gone(server, deadline)

    assert problems == ["console.error: Failed to load resource: the server responded with a status of 401 "
                        "(Unauthorized)"], problems  # the refused POST, as the browser logs it; nothing else


@pytest.mark.asyncio
async def test_page_watches_the_servers_local_session(tiny, tmp_path):
    """`runtime serve --camera 0` serves the page too: ?watch=1 follows the local session's captions and answers
    (here a real session fed the demo speech, its events published as the CLI does), without any camera."""
    from runtime.chunks import AudioChunk
    from runtime.web.broadcast import Broadcast

    deadline, problems = Deadline(TOTAL_TIMEOUT_S), []
    async with RealtimeServer(*tiny, port=0, local=Broadcast("demo speech")) as server, \
            browser_page(tmp_path, problems) as page:
        assert server.local is not None
        session = await (await open_session(*tiny)).start()

        async def publish() -> None:
            async for event in session.events:
                server.local.publish(event)

        async def speak() -> None:
            speech, chunk = demo_speech()[: 3 * 16000], 1600
            for start in range(0, len(speech), chunk):
                await session.push_audio(AudioChunk(speech[start : start + chunk], start))
                await asyncio.sleep(0.05)
            await session.ask("what moved?")

        publisher, speaker = asyncio.create_task(publish()), asyncio.create_task(speak())
        try:
            await page.goto(f"http://127.0.0.1:{server.port}/?watch=1", timeout=deadline.ms())
            assert await page.text_content("#start") == "Watch"
            await page.click("#start")
            await wait_for(page, HAS_TEXT.format("captions"), deadline, "no captions", problems)
            await wait_for(page, HAS_TEXT.format("answer"), deadline, "no answer", problems)
            assert (await text_of(page, "#status")).startswith("live: watching")
            assert await page.is_disabled("#question")  # read-only: questions go to the terminal
            assert len(server.local.watchers) == 1
            await page.click("#stop")
            await wait_for_watchers(server, deadline)
        finally:
            await speaker
            await session.finish()
            await publisher
    assert not problems, problems


async def wait_for_watchers(server: RealtimeServer, deadline: Deadline) -> None:
    while server.local.watchers and not deadline.passed:
        await asyncio.sleep(0.05)
    assert not server.local.watchers


# The RMS of what the page's <audio id="voice"> plays, every 50 ms, through a WebAudio analyser on its stream (with the
# audio clock, ms, at the reading), and when the page's "speaking" indicator changed (output_audio_buffer.started /
# stopped / cleared), on one clock. A reading is kept only when the audio clock moved since the last: while the audio
# thread is starved (a loaded CI machine) the analyser returns its last buffer again, old sound that is not playing
# (CI, 2026-12-02: the same 0.2178 twice, 200 ms after a Cancel, then silence).
METER = """async () => {
    const voice = document.getElementById('voice'), speaking = document.getElementById('speaking');
    const context = new AudioContext();
    await context.resume();
    const analyser = context.createAnalyser();
    analyser.fftSize = 2048;
    context.createMediaStreamSource(voice.srcObject).connect(analyser);
    const samples = new Float32Array(analyser.fftSize);
    window.levels = [];
    window.speakingLog = [];
    let rendered = -1;
    setInterval(() => {
        if (context.currentTime === rendered) return;
        rendered = context.currentTime;
        analyser.getFloatTimeDomainData(samples);
        let sum = 0;
        for (const v of samples) sum += v * v;
        window.levels.push([performance.now(), Math.sqrt(sum / samples.length), 1000 * rendered]);
    }, 50);
    new MutationObserver(() => window.speakingLog.push([performance.now(), speaking.textContent]))
        .observe(speaking, {childList: true, characterData: true, subtree: true});
    return context.state;
}"""
ANSWER = "Sure, the meeting moved to Thursday. Please bring the slides."
LONG = ("The meeting moved to Thursday at ten, in the large room on the second floor. Please bring the slides, the "
        "budget and the notes from last week, and tell the others.")
QUIET, LOUD = 0.005, 0.03  # RMS (full scale 1): silence on the track is exactly 0; the voice peaks near 0.2


# How much the page's voice has been stretched so far, in ms: the samples its jitter buffer made up while packets
# were late (concealment) or inserted to slow down, as the browser's own receiver counts them
# (RTCInboundRtpStreamStats). Packets that come late on a loaded machine are concealed and then played, so the rest
# of the answer plays that much later behind its `.stopped` event than it began behind `.started` (CI, 2026-12-03:
# 169 ms at the start, heard 1.0 s after `.stopped`; whether this or a starved audio thread, below, was the cause
# there is not known). The samples it removes to catch up again are not subtracted: it removes them mostly from the
# silence after the answer, too late to bring the answer's end forward.
STRETCH = """async () => {
    let ms = 0;
    const stats = await pc.getStats();
    stats.forEach(s => {
        if (s.type !== 'inbound-rtp' || s.kind !== 'audio') return;
        const rate = (stats.get(s.codecId) || {}).clockRate || 48000;
        ms += 1000 * ((s.concealedSamples || 0) + (s.insertedSamplesForDeceleration || 0)) / rate;
    });
    return ms;
}"""


def when(log: list, text: str) -> float:
    return next(t for t, shown in log if shown == text)


def levels_between(levels: list, start: float, end: float) -> list[float]:
    return [rms for t, rms, _ in levels if start <= t < end]


@pytest.mark.asyncio
async def test_page_plays_the_spoken_answer_and_cancel_silences_it(tmp_path):
    """The server's voice track, as the page plays it: silent before the answer, loud while it plays (between
    output_audio_buffer.started and .stopped), silent after; the answer's transcript shows in the answer box; Cancel
    during a second answer that is still playing sends output_audio_buffer.clear and the sound stops at once."""
    packaged_or_skip("piper-en-us-joe-medium")
    from runtime.models.tts import load_voice

    deadline, problems = Deadline(TOTAL_TIMEOUT_S), []
    answerer = ScriptAnswerer(ANSWER)
    with DeviceWorker() as worker:
        models = Models(WordASR(per_item=1000), answerer, voice=worker.call(Priority.CONTROL, load_voice))
        async with RealtimeServer(profile_for(), models, worker, port=0) as server, \
                browser_page(tmp_path, problems) as page:
            await page.goto(f"http://127.0.0.1:{server.port}/", timeout=deadline.ms())
            await page.click("#start")
            await wait_for(page, "!document.getElementById('speak').disabled", deadline, "no voice track", problems)
            while not (server.sessions and next(iter(server.sessions.values())).settings.config.output_modalities
                       == ("audio",)):  # the page turned spoken answers on (session.update)
                assert not deadline.passed, "the page did not ask for spoken answers"
                await asyncio.sleep(0.05)
            assert await page.evaluate(METER) == "running"
            await asyncio.sleep(1.0)  # the track before any answer: silence frames

            await page.fill("#question", "when is the meeting?")
            await page.press("#question", "Enter")
            await wait_for(page, "window.speakingLog.some(([, s]) => s === 'speaking')", deadline, "no sound started",
                           problems)
            stretched_before = await page.evaluate(STRETCH)
            await wait_for(page, "window.speakingLog.some(([, s]) => s === '')", deadline, "the sound did not stop",
                           problems)
            # the silence after it, past the jitter buffer's lag (below): at least 2 s, and until the page has read
            # 600 ms of silence after its last sound (beside CI's other tests, 2026-12-03, the sound still played 2 s
            # after .stopped once, the audio thread starved); a sound that never ends fails here at the deadline
            await asyncio.sleep(2.0)
            await wait_for(page, f"(() => {{ const loud = window.levels.filter(([, rms]) => rms >= {QUIET}); "
                           "const last = window.levels[window.levels.length - 1][0]; "
                           "return loud.length > 0 && last - loud[loud.length - 1][0] >= 600; })()", deadline,
                           "the first answer's sound did not end", problems)
            answer = await text_of(page, "#answer")
            first_log, levels = await page.evaluate("[window.speakingLog, window.levels]")
            stretch = await page.evaluate(STRETCH) - stretched_before

            answerer.text = LONG
            await page.fill("#question", "and what else?")
            await page.press("#question", "Enter")
            await wait_for(page, "window.speakingLog.filter(([, s]) => s === 'speaking').length === 2", deadline,
                           "the second answer's sound did not start", problems)
            # Cancel once the page is heard playing it: the sound trails the event by the jitter buffer's lag, which
            # beside CI's other tests passed 1.5 s once (CI, 2026-12-03: a Cancel 1.5 s after .started found the
            # track still silent); the long answer plays about 9 s, so it is still playing then
            await wait_for(page, "(() => { const s = window.speakingLog.filter(([, x]) => x === 'speaking')[1][0]; "
                           f"return window.levels.some(([t, rms]) => t >= s && rms > {LOUD}); }})()", deadline,
                           "the second answer was never heard", problems)
            await asyncio.sleep(0.3)  # heard for a while, well inside the second before the clear (asserted below)
            await page.click("#cancel")
            await wait_for(page, "window.speakingLog.some(([, s]) => s === 'interrupted')", deadline,
                           "Cancel did not clear the sound", problems)
            await asyncio.sleep(0.8)
            second_log, second_levels = await page.evaluate("[window.speakingLog, window.levels]")
            assert not (await text_of(page, "#status")).startswith("error"), await text_of(page, "#status")
            await page.click("#stop")
            await sessions_gone(server, deadline)

    assert answer == ANSWER  # the transcript, shown as the answer is spoken
    started, stopped = when(first_log, "speaking"), when(first_log, "")
    assert 2.0 <= (stopped - started) / 1000 <= 8.0, first_log  # the answer plays at real time (about 3.5 s)
    before = levels_between(levels, levels[0][0], started)
    during = levels_between(levels, started, stopped + 300)  # the sound lags the event by the jitter buffer
    assert len(before) >= 15 and max(before) < QUIET, before  # a second of silence before the answer
    assert max(during) > 2 * LOUD and sum(rms > LOUD for rms in during) >= len(during) // 2, during  # speech
    # The page plays the track behind its jitter buffer: 0.3-0.4 s on a quiet machine, past a second beside CI's other
    # tests on a slow hour (2026-11-30: still heard 1.1 s after .stopped). So the sound must end as the event says,
    # behind the lag its start showed and what the buffer stretched it by since (STRETCH), and the track stay silent
    # after it.
    # A starved audio thread lets the page's audio clock fall behind the wall clock, and what the analyser shows falls
    # behind with it: that, between the first sound and the last, is the listener's lag too.
    first = next(reading for reading in levels if reading[0] >= started and reading[1] > LOUD)
    last = max((reading for reading in levels if reading[1] >= QUIET), key=lambda reading: reading[0])
    lag, heard_until = first[0] - started, last[0]
    fell_behind = max(0.0, (last[0] - first[0]) - (last[2] - first[2]))
    assert heard_until <= stopped + lag + stretch + fell_behind + 600, {
        "lag_ms": lag, "stretched_ms": stretch, "audio_clock_behind_ms": fell_behind,
        "heard_after_stopped_ms": heard_until - stopped}
    assert levels[-1][0] - heard_until >= 400 and max(levels_between(levels, heard_until + 1, float("inf"))) < QUIET
    cleared = when(second_log, "interrupted")
    assert max(levels_between(second_levels, cleared - 1000, cleared)) > LOUD  # it was speaking when cancelled
    assert max(levels_between(second_levels, cleared + 200, float("inf"))) < QUIET  # and stopped within 200 ms
    assert not problems, problems
