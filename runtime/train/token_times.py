"""Training the causal adapters on decoder positions as stale as the stream leaves them.

The stream feeds a decoder position once with the frames heard then and keeps its states (`decoder.py`): the
prompt is read with the first block, "Ever tried." with the first second, and every later token attends to
those early states. Trained with every position fresh (seeing the whole clip), the adapter never met that, and
at 100 ms blocks a stale prefix made it predict end-of-text while the speaker went on (model card, "Stale
decoder positions"). To train as the stream runs, each position sees only the frames heard when the stream
would feed it (`fed_frames`), which needs the time each token is said: Whisper's alignment heads give it
(`models/asr/whisper_alignment.py`), once per clip, cached beside the run (`cached_token_ends`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from runtime.models.asr.causal_whisper.encoder import block_end
from runtime.models.asr.whisper_alignment import TokenAligner


def fed_frames(ends: Sequence[int], prompt_len: int, width: int, clip_frames: int, block_frames: int,
               lag: int = 0) -> list[int]:
    """Frames each decoder position of a training row sees, as a stream of `block_frames` blocks would first
    feed it: the prompt with the first block (`block_end(0)`), the position predicting token i when the block
    holding its end, `lag` frames later, is heard; the one predicting eos (and the padding after it) with the
    whole clip. `ends` are the tokens' end frames; the row has `width` positions."""
    out = [min(block_end(0, block_frames), clip_frames)] * (prompt_len - 1)
    out += [min(block_end(max(e, 1) - 1 + lag, block_frames), clip_frames) for e in ends]
    out += [clip_frames] * (width - len(out))
    return out[:width]


def cached_token_ends(base: str, clips: Sequence[tuple[str, np.ndarray, list[int]]], prompt: Sequence[int],
                      eos: int, cache: Path) -> list[list[int]]:
    """End frames of every clip's tokens (clips are (key, audio, ids)), timed by `base`'s alignment heads and
    kept in `cache` (JSON, key -> the ids and their ends), so a resumed or repeated run times nothing twice."""
    from tqdm import tqdm

    from runtime.models.asr.whisper_checkpoint import whisper_path

    known = json.loads(cache.read_text()) if cache.is_file() else {}
    todo = [c for c in clips if known.get(c[0], {}).get("ids") != c[2]]
    if todo:
        timer = TokenAligner.load(whisper_path(base), prompt, eos)
        for key, audio, ids in tqdm(todo, desc="token times", unit="clip", file=sys.stderr, disable=None):
            known[key] = {"ids": ids, "ends": timer.end_frames(audio, ids)}
        cache.write_text(json.dumps(known))
    return [known[key]["ends"] for key, _, _ in clips]
