"""The device worker runs jobs off the event loop, in priority order, bounded, and reports failures."""

import asyncio
import threading
import time

import pytest
from cli_common import read_trace

from runtime.worker import DeviceWorker, Priority, WorkerStopped


@pytest.mark.asyncio
async def test_jobs_run_on_the_worker_thread_not_the_loop():
    with DeviceWorker() as worker:
        name = await worker.run(Priority.ASR, lambda: threading.current_thread().name)
        assert name == worker.name != threading.current_thread().name


@pytest.mark.asyncio
async def test_loop_stays_responsive_while_a_job_computes():
    with DeviceWorker() as worker:
        job = asyncio.create_task(worker.run(Priority.DECODE, time.sleep, 0.3))
        ticks = 0
        while not job.done():
            await asyncio.sleep(0.01)
            ticks += 1
        assert ticks >= 10  # the loop kept running during the 0.3 s job


@pytest.mark.asyncio
async def test_asr_overtakes_queued_decode_and_vision():
    order: list[str] = []
    gate = threading.Event()
    with DeviceWorker() as worker:
        blocker = asyncio.create_task(worker.run(Priority.CONTROL, gate.wait, 5))
        await asyncio.sleep(0.02)  # the worker is now busy; the rest queue up
        jobs = [
            asyncio.create_task(worker.run(p, order.append, p.name))
            for p in (Priority.VISION, Priority.DECODE, Priority.PREFILL, Priority.DECODE, Priority.OPENING,
                      Priority.ASR)
        ]
        await asyncio.sleep(0.02)
        gate.set()
        await asyncio.gather(blocker, *jobs)
    # an answer's opening (its first clause) before another question's prefill, and that before decoding on
    assert order == ["ASR", "OPENING", "PREFILL", "DECODE", "DECODE", "VISION"]


@pytest.mark.asyncio
async def test_errors_reach_the_caller_and_the_worker_survives():
    def boom():
        raise ValueError("bad chunk")

    with DeviceWorker() as worker:
        with pytest.raises(ValueError, match="bad chunk"):
            await worker.run(Priority.ASR, boom)
        assert await worker.run(Priority.ASR, lambda: 42) == 42


@pytest.mark.asyncio
async def test_pending_jobs_are_bounded_and_cancelled_jobs_are_skipped():
    ran: list[int] = []
    gate = threading.Event()
    with DeviceWorker(max_pending=2) as worker:
        first = asyncio.create_task(worker.run(Priority.CONTROL, gate.wait, 5))
        queued = [asyncio.create_task(worker.run(Priority.DECODE, ran.append, i)) for i in range(4)]
        await asyncio.sleep(0.05)
        assert worker.stats()["pending"] == 2  # the other three callers wait for a slot
        queued[0].cancel()
        await asyncio.sleep(0.01)
        gate.set()
        await first
        await asyncio.gather(*queued, return_exceptions=True)
    assert ran == [1, 2, 3]


def test_stopped_worker_refuses_work():
    worker = DeviceWorker().start()
    worker.stop()
    assert not worker.thread.is_alive()
    with pytest.raises(WorkerStopped):
        worker.submit(Priority.ASR, print)


def test_with_two_threads_asr_runs_beside_a_long_language_model_job() -> None:
    """`threads=2`: ASR (`LISTENING`) has its own thread, so a long prefill does not hold it back; every other
    priority (the voice's included) stays on the first thread, in order."""
    gate = threading.Event()
    with DeviceWorker(threads=2) as worker:
        held = worker.submit(Priority.PREFILL, gate.wait, 5)
        assert worker.submit(Priority.ASR, threading.current_thread).result(5) is worker.threads[1]
        assert not held.done()  # it ran while the prefill still held the first thread
        speech = worker.submit(Priority.SPEECH, threading.current_thread)
        gate.set()
        assert held.result(5) is True and speech.result(5) is worker.threads[0] is worker.thread
        assert worker.submit(Priority.DECODE, threading.current_thread).result(5) is worker.threads[0]
    assert not any(t.is_alive() for t in worker.threads)
    with pytest.raises(ValueError, match="1 or 2 threads"):
        DeviceWorker(threads=3)


@pytest.mark.asyncio
async def test_a_trace_records_each_job_on_its_threads_track_and_closes_with_the_worker(tmp_path):
    from functools import partial

    from runtime.job_trace import JobTrace

    def step(items: list[int]) -> list[int]:
        time.sleep(0.01)
        return [i * 2 for i in items]

    trace = JobTrace(tmp_path / "jobs.json")
    with DeviceWorker(trace=trace, threads=2) as worker:
        await worker.run(Priority.ASR, partial(time.sleep, 0.02))
        gate = threading.Event()
        blocker = asyncio.create_task(worker.run(Priority.CONTROL, gate.wait, 5))
        await asyncio.sleep(0.02)
        together = [asyncio.create_task(worker.run_together(Priority.DECODE, step, i)) for i in (1, 2)]
        await asyncio.sleep(0.02)
        gate.set()
        assert await asyncio.gather(*together) == [2, 4] and await blocker
    events = read_trace(tmp_path / "jobs.json")
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    jobs = [e for e in events if e["ph"] == "X"]
    assert [(j["name"], j["cat"], names[j["tid"]]) for j in jobs] == [
        ("sleep", "ASR", "device-worker-listening"),  # a partial is named by its function
        ("Event.wait", "CONTROL", "device-worker"),
        ("test_a_trace_records_each_job_on_its_threads_track_and_closes_with_the_worker.<locals>.step", "DECODE",
         "device-worker")]
    assert jobs[0]["dur"] >= 20_000 and jobs[2]["args"] == {"items": 2}  # microseconds; two callers in one job
    assert jobs[1]["ts"] + jobs[1]["dur"] <= jobs[2]["ts"]  # one thread: the step ran after the blocker
    assert trace.jobs == 3
    trace.record("late", "ASR", time.perf_counter(), 0.0)  # after the worker stopped: the file is closed
    assert len(read_trace(tmp_path / "jobs.json")) == len(events)


def test_a_trace_file_that_cannot_be_written_is_one_clear_error(tmp_path):
    from runtime.errors import UserError
    from runtime.job_trace import JobTrace

    with pytest.raises(UserError, match=r"--trace-jobs .*missing/jobs.json: cannot write it"):
        JobTrace(tmp_path / "missing" / "jobs.json")
