"""Training the causal adapters on decoder positions as stale as the stream leaves them.

A decoder position keeps the states it got from the frames heard when it was last fed (`decoder.py`): the
prompt is read with the first block, "Ever tried." within the first second, and every later token attends to
those early states. Trained with every position fresh (seeing the whole clip), the adapter never met that, and
at 100 ms blocks a stale prefix made it predict end-of-text while the speaker went on (model card, "Stale
decoder positions"). To train closer to how the stream runs, each position sees only the frames heard when the
stream predicts its next token (`fed_frames`), which needs the time each token is said: Whisper's alignment
heads give it (`models/asr/whisper_alignment.py`), once per clip, cached beside the run (`cached_token_ends`).

An approximation, staler than the stream: the emission rule re-feeds the unstable tail at every block, so a
position is last fed when the token `asr.lookback_tokens` after it is emitted, not when it predicts. The
`lag` (`--stale-lag-ms`) moves every position later by a fixed time instead.
"""

from __future__ import annotations

import json
import os
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


SAVE_EVERY = 200  # clips timed between writes of the cache


def cached_token_ends(base: str, clips: Sequence[tuple[str, np.ndarray, list[int]]], prompt: Sequence[int],
                      eos: int, cache: Path) -> list[list[int]]:
    """End frames of every clip's tokens (clips are (key, audio, ids)), timed by `base`'s alignment heads and
    kept in `cache`, so a resumed or repeated run times nothing twice. The cache names the base and the prompt
    (another base or language starts it afresh) and each clip's ids and length (a changed clip is timed
    again); it is written whole (a temporary file renamed) every SAVE_EVERY clips, so an interrupted run keeps
    what it timed."""
    from tqdm import tqdm

    from runtime.models.asr.whisper_checkpoint import whisper_path

    head = {"base": base, "prompt": list(prompt)}
    try:
        saved = json.loads(cache.read_text()) if cache.is_file() else {}
    except json.JSONDecodeError:
        saved = {}  # not ours, or cut short by a crash outside `save`: time again
    known = saved.get("clips", {}) if all(saved.get(k) == v for k, v in head.items()) else {}

    def save() -> None:
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps({**head, "clips": known}))
        os.replace(tmp, cache)

    todo = [c for c in clips if known.get(c[0], {}).get("ids") != c[2]
            or known[c[0]].get("samples") != len(c[1])]
    if todo:
        print(f"runtime: timing the tokens of {len(todo)} clips with {base}'s alignment heads (once; kept in "
              f"{cache})", file=sys.stderr, flush=True)
        timer = TokenAligner.load(whisper_path(base), prompt, eos)
        for n, (key, audio, ids) in enumerate(tqdm(todo, desc="token times", unit="clip", file=sys.stderr,
                                                   disable=None), 1):
            known[key] = {"ids": ids, "samples": len(audio), "ends": timer.end_frames(audio, ids)}
            if n % SAVE_EVERY == 0:
                save()
        save()
    return [known[key]["ends"] for key, _, _ in clips]
