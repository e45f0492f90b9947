"""The CLI as a user meets it: help, one-line errors that name what is wrong, and JSON event lines."""

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_common import one_error_line, read_trace, run_cli
from weights_common import ON_QWEN_CODER

from runtime.cli import main
from runtime.events import parse_event
from runtime.io.sample import demo_speech


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for command in ("serve", "demo", "transcribe", "ask", "profiles", "bench", "train"):
        assert command in out


def test_help_answers_before_the_models_libraries_load():
    """`--help`, a mistyped flag and a mistyped file name answer at once: torch and transformers load only when
    a command's models do."""
    code = ("import sys\nfrom runtime.__main__ import main\n"
            "for argv in (['--help'], ['bench', '--help'], ['train', '--help'], ['transcribe', '--help'], ['ask'],\n"
            "             ['transcribe', '/nonexistent/talk.wav'], ['train', 'fastconformer', '--help'],\n"
            "             ['train', 'average', '--help'], ['train', 'word-lm', '--help'],\n"
            "             ['train', 'causal-whisper', '--help'], ['train', 'distil-whisper', '--help'],\n"
            "             ['train', 'synth-speech', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage: runtime train" in result.stdout and "the following arguments are required" in result.stderr
    assert "cannot read /nonexistent/talk.wav" in result.stderr  # a mistyped file fails before the models' code
    assert result.stdout.strip().splitlines()[-1] == "False False"


def test_every_command_defaults_to_real_models():
    """A newcomer's first command must not print noise: random models only when asked for (--profile tiny)."""
    from runtime.cli_parser import build_parser

    parser = build_parser()
    defaults = {argv[0]: parser.parse_args(argv).profile
                for argv in (["serve"], ["demo"], ["transcribe", "x.wav"], ["ask", "x.wav", "what?"])}
    assert set(defaults.values()) == {"demo"}  # one default (tests/test_profiles.py: what it loads)


def test_a_file_without_a_picture_loads_no_screen_reader(capsys, demo_file, tmp_path, monkeypatch):
    """PP-OCRv4 loads for a video, not for a .wav: the profile the models are loaded for says so."""
    import soundfile

    from runtime import loaded_models
    from runtime.errors import UserError

    reads: list[bool] = []

    def load_models(profile, *_, **__):
        reads.append(profile.screen.read)
        raise UserError("models would load here")

    monkeypatch.setattr(loaded_models, "load_models", load_models)
    wav = tmp_path / "speech.wav"
    soundfile.write(wav, demo_speech()[:16000], 16000)
    for command in (["transcribe", str(wav)], ["ask", str(wav), "what?"], ["transcribe", str(demo_file)]):
        code, _, err = run_cli(capsys, *command, "--profile", "whisper-tiny-en")
        assert code == 1 and "models would load here" in one_error_line(err)
    assert reads == [False, False, True]


def test_a_train_recipe_has_its_flags_when_named(capsys):
    """Each recipe's flags load only when it is named (test_help_answers_before...), and then they are all there."""
    with pytest.raises(SystemExit) as exit_:
        main(["train", "average", "--help"])
    assert exit_.value.code == 0 and "--out" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["train", "average"])
    assert exit_.value.code == 2 and "--out" in capsys.readouterr().err


def test_unknown_benchmark_fails_in_one_line(capsys):
    code, _, err = run_cli(capsys, "bench", "nosuch")
    assert code != 0 and "unknown benchmark 'nosuch'" in one_error_line(err)


def test_train_errors_are_one_line(capsys, tmp_path):
    code, _, err = run_cli(capsys, "train", "causal-whisper", "--base", "tiny:whisper", "--data",
                           str(tmp_path / "nodata"), "--out", str(tmp_path / "out"))
    assert code == 1 and "nodata" in one_error_line(err)


def test_unknown_profile(capsys):
    code, _, err = run_cli(capsys, "transcribe", "x.wav", "--profile", "nosuch")
    assert code == 1 and "unknown profile 'nosuch'" in one_error_line(err)


def test_unreadable_files(capsys, tmp_path):
    code, _, err = run_cli(capsys, "transcribe", str(tmp_path / "missing.mp4"))
    assert code == 1 and "cannot read" in one_error_line(err) and "missing.mp4" in err
    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(b"this is not a video" * 100)
    code, _, err = run_cli(capsys, "ask", str(garbage), "what?")
    assert code == 1 and "cannot read" in one_error_line(err) and "garbage.mp4" in err


def test_missing_weights_fail_at_once_naming_the_checkpoint(capsys, demo_file):
    started = time.perf_counter()
    code, _, err = run_cli(capsys, "transcribe", str(demo_file), "--set", "asr.model=/nonexistent/whisper-base")
    assert code == 1 and "/nonexistent/whisper-base" in one_error_line(err)
    code, _, err = run_cli(capsys, "transcribe", str(demo_file), "--profile", "whisper-buffered")  # not cached
    assert code == 1 and "openai/whisper-base" in one_error_line(err) and "--set asr.model=" in err
    code, _, err = run_cli(capsys, "transcribe", str(demo_file), "--profile", "cpu")
    assert code == 1 and "stt_en_fastconformer" in one_error_line(err)
    assert time.perf_counter() - started < 10


def test_no_camera_fails_fast_naming_the_device(capsys):
    started = time.perf_counter()
    code, _, err = run_cli(capsys, "serve", "--camera", "97")
    assert time.perf_counter() - started < 5
    line = one_error_line(err)
    assert code == 1 and "/dev/video97" in line and "--source" in line


def test_no_microphone_fails_fast_naming_the_device(capsys):
    started = time.perf_counter()
    code, _, err = run_cli(capsys, "serve", "--no-camera", "--mic", "hw:97")
    assert time.perf_counter() - started < 5
    line = one_error_line(err)
    assert code == 1 and "hw:97" in line


@pytest.fixture(scope="module")
def short_speech(tmp_path_factory) -> Path:
    """The demo's first 4 s of speech as a .wav, for the in-process transcribe tests that are not about the demo's
    length or its picture: no screen reader loads for it, and `runtime transcribe` on it took 6.7 CPU s in-process
    against 12.0 on the whole demo mp4 (12.8 s of speech; 2-core AMD EPYC, 2026-12-02)."""
    import soundfile

    path = tmp_path_factory.mktemp("speech") / "short.wav"
    soundfile.write(path, demo_speech()[:4 * 16000], 16000)
    return path


@pytest.fixture(scope="module")
def short_film(tmp_path_factory) -> Path:
    """The demo's first 4 s as an mp4, speech and picture (so the default profile's screen reader loads and reads it
    too): `runtime transcribe` on it cost a child 14 CPU s against 19 on the whole demo (2-core AMD EPYC,
    2026-12-02), most of both the child's imports and loads."""
    from runtime.io.sample import DEMO_FPS, render_frame, write_media_file

    frames = [(i / DEMO_FPS, render_frame(i / DEMO_FPS)) for i in range(4 * DEMO_FPS)]
    return write_media_file(tmp_path_factory.mktemp("film") / "short.mp4", demo_speech()[:4 * 16000], frames)


def _subprocess(*argv: str, stdin: str | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "runtime", *argv], input=stdin, capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=Path(__file__).parent.parent)


def _events(stdout: str) -> list:
    lines = stdout.splitlines()
    assert lines, "no output"
    return [parse_event(json.loads(line)) for line in lines]  # every line is one valid event


@pytest.mark.slow
@ON_QWEN_CODER
def test_demo_at_speed_8_prints_transcript_and_answer():
    result = _subprocess("demo", "--speed", "8", "--json")
    assert result.returncode == 0, result.stderr
    events = _events(result.stdout)
    types = [e.type for e in events]
    assert "conversation.item.input_audio_transcription.completed" in types
    assert "response.output_text.delta" in types and "response.done" in types
    assert "random, untrained weights" not in result.stderr  # real weights: Whisper tiny.en and Qwen2.5-Coder-1.5B
    answer = "".join(e.delta for e in events if e.type == "response.output_text.delta").lower()
    # "What did the red ball do?" at 8.3 s: it rolls from the left to the right (said at 2.7 s); at speed 8 an answer
    # that starts half a second late (a loaded machine) also reads "Then the red ball stops near the right edge"
    # (12.7 s), and says so
    assert "roll" in answer or "stop" in answer, answer


def test_ask_at_a_media_time_answers_then_finishes(capsys, demo_file):
    # in-process: a child spent about 10 of its 12 CPU s importing torch and transformers (2-core AMD EPYC, 2026-12-02)
    code, out, err = run_cli(capsys, "ask", str(demo_file), "what moved?", "--at", "3", "--json", "--profile", "tiny",
                             "--set", "lm.max_new_tokens=4")
    assert code == 0, err
    events = _events(out)
    created = next(e for e in events if e.type == "response.created")
    assert created.media_time == 3 and created.response["question"] == "what moved?"
    done = next(e for e in events if e.type == "response.done")
    assert done.response["usage"]["output_tokens"] <= 4
    transcripts = [e for e in events if e.type.endswith("transcription.completed")]
    assert transcripts and transcripts[-1].end > 3  # the file kept streaming after the question


def test_serve_with_a_file_source_takes_questions_on_stdin(demo_file):
    result = _subprocess("serve", "--source", str(demo_file), "--speed", "8", "--json", "--port", "0",
                         "--profile", "tiny", stdin="\nwhat is the red ball doing?\n")
    assert result.returncode == 0, result.stderr
    events = _events(result.stdout)
    created = [e for e in events if e.type == "response.created"]
    assert [e.response["question"] for e in created] == ["what is the red ball doing?"]
    assert any(e.type == "response.done" for e in events)
    # stdin closed after the question (a pipe, as under systemd or nohup): only the questions end, the file
    # plays to its end
    heard = [e for e in events if e.type == "runtime.metrics"][-1].metrics["asr"]["pushed_until"]
    assert heard == pytest.approx(len(demo_speech()) / 16000, abs=0.05)


def test_transcribe_text_output_and_quiet_means_nothing_on_stderr(short_film, tmp_path):
    """One process for all three (each cost a worker 9 s in CI): the text lines, `-q` leaving stderr empty (the
    screen reader's loading included: the film has a picture), and `--trace-jobs` writing the worker's jobs, the
    ASR's on the listening thread, closed when the command ends."""
    result = _subprocess("transcribe", str(short_film), "--speed", "0", "-q", "--trace-jobs", str(tmp_path / "t.json"))
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert "[00:0" in result.stdout  # live lines stamped with media time
    events = read_trace(tmp_path / "t.json")
    threads = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    jobs = {(e["name"], e["cat"], threads[e["tid"]]) for e in events if e["ph"] == "X"}
    assert {("load_asr", "CONTROL", "device-worker"),
            ("CausalWhisperStream.accept", "ASR", "device-worker-listening")} <= jobs, jobs


def test_sigterm_stops_the_server_cleanly():
    """`docker stop`, systemd and `timeout` send SIGTERM: the server shuts down as on Ctrl-C (exit 0, no
    traceback), instead of dying with its sessions open."""
    import re
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "runtime", "serve", "--profile", "tiny", "--port", "0"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=Path(__file__).parent.parent)
    try:
        seen = []
        for line in proc.stderr:  # type: ignore[union-attr]
            seen.append(line)
            if re.search(r"serving the browser demo at http://\S+:\d+/", line):
                break
        else:
            pytest.fail("the server never said it was serving:\n" + "".join(seen))
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, rest
    assert "Traceback" not in rest


def test_synth_speech_workers_end_quietly(tmp_path):
    """The pool's workers are terminated with SIGTERM at the end of every run; they must not print the
    KeyboardInterrupt the CLI's own SIGTERM handling would raise in them."""
    result = _subprocess("train", "synth-speech", "--out", str(tmp_path / "s"), "--hours", "0.002", "--heldout", "2",
                         "--engines", "espeak", "--jobs", "2", "--quiet")
    if result.returncode != 0 and "espeak is not installed" in result.stderr and not os.environ.get("CI"):
        pytest.skip("espeak-ng is not installed")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "KeyboardInterrupt" not in result.stderr


def test_bad_numbers_and_questions_are_refused_before_any_model_loads(capsys, demo_file):
    for argv in (["demo", "--speed", "nan"], ["ask", str(demo_file), "what?", "--at", "-3"],
                 ["ask", str(demo_file), "what?", "--at", "inf"], ["serve", "--port", "99999"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2 and "must be" in capsys.readouterr().err
    started = time.perf_counter()
    for argv in (["ask", str(demo_file), "   "], ["demo", "--question", ""]):
        code, _, err = run_cli(capsys, *argv)
        assert code == 1 and "the question is empty" in one_error_line(err)
    code, _, err = run_cli(capsys, "transcribe", str(demo_file), "--set", "asr.lm_weight=nan")
    assert code == 1 and "asr.lm_weight must be a finite number" in one_error_line(err)
    code, _, err = run_cli(capsys, "bench", "asr", "--quick", "--device", "cuda:x")
    assert code == 1 and "cuda:x" in one_error_line(err)
    assert time.perf_counter() - started < 10


def test_transcribe_needs_audio_and_loads_the_asr_alone(capsys, short_speech, tmp_path):
    from runtime.io.sample import render_frame, write_media_file

    silent_film = write_media_file(tmp_path / "v.mp4", None, [(i / 2, render_frame(i / 2, 64, 48)) for i in range(4)])
    code, _, err = run_cli(capsys, "transcribe", str(silent_film))
    assert code == 1 and "no audio stream" in one_error_line(err)
    # no language model is loaded to transcribe, so a missing one does not matter
    code, out, err = run_cli(capsys, "transcribe", str(short_speech), "--json", "--set", "lm.model=/nonexistent")
    assert code == 0, err
    created = parse_event(json.loads(out.splitlines()[0]))
    assert created.type == "session.created" and created.session["lm"] == {"backend": "none"}
    assert "loading lm" not in err
    # once loaded, the models (and torch's modules) are out of the collector's view: no full collection walks them
    assert gc.get_freeze_count() > 10_000


def test_a_session_that_reports_errors_exits_non_zero(capsys, monkeypatch, short_speech):
    """A run whose ASR failed on every chunk printed errors; its exit status must say so to a script."""
    from runtime import loaded_models
    from runtime.loaded_models import Models

    class BrokenStream:
        def __init__(self, stream):
            self.stream = stream

        def accept(self, chunk):
            raise RuntimeError("broken on purpose")

        def __getattr__(self, name):
            return getattr(self.stream, name)

    class BrokenASR:
        def __init__(self, asr):
            self.asr = asr

        def open_stream(self):
            return BrokenStream(self.asr.open_stream())

        def __getattr__(self, name):
            return getattr(self.asr, name)

    real = loaded_models.load_models
    monkeypatch.setattr(loaded_models, "load_models", lambda *a, **k: (lambda m: Models(BrokenASR(m.asr), m.answerer,
                                                                               m.vision))(real(*a, **k)))
    code, _, err = run_cli(capsys, "transcribe", str(short_speech), "-q")
    assert code == 1 and "error: " in err
    assert "runtime: the session reported" in err.splitlines()[-1]


def test_session_commands_let_openmp_threads_sleep_and_benchmarks_do_not(monkeypatch) -> None:
    """`serve`, `demo`, `ask` and `transcribe` decode on both cores of a two-core machine beside the listening thread,
    so OpenMP's threads must sleep at barriers (set before torch loads); a benchmark keeps OpenMP's default, which its
    peers (llama.cpp) run under too. A value the user set is kept."""
    import runtime.__main__ as entry
    from runtime import cli

    monkeypatch.setattr(cli, "run", lambda args: 0)
    for argv, want in ((["ask", "x.wav", "what?"], "PASSIVE"), (["transcribe", "x.wav"], "PASSIVE"),
                       (["bench", "llm"], None)):
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
        assert entry.main(argv) == 0
        assert os.environ.get("OMP_WAIT_POLICY") == want, argv
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert entry.main(["serve"]) == 0 and os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
