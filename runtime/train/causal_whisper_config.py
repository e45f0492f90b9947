"""What `runtime train causal-whisper` can be told: the run's settings and their flags.

Kept apart from the training loop (`causal_whisper.py`), which imports torch and the model code, so that
`runtime train causal-whisper --help` answers at once.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

RANK = 16  # LoRA rank of a new run: the shipped adapter's, and `lora.DEFAULT_RANK` (a test holds them equal)
FRAME_MS = 20  # the encoder's frame, `encoder.FRAME_MS` (a test holds them equal): --stale-lag-ms counts in it


@dataclass(frozen=True)
class TrainConfig:
    base: str
    data: str
    out: str
    rank: int = RANK
    chunk_ms: int | str = 300  # one size, or several comma-separated (one adapter over all: steps take turns)
    steps: int = 1000
    batch_size: int = 8
    lr: float = 1e-4
    save_every: int = 200
    resume: bool = False
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    language: str = "en"
    init: str = ""  # an adapter (folder or builtin:NAME) whose weights a new run starts from ("": zero, at --rank)
    stale_share: float = 0.0  # share of a batch's clips whose positions see about what the stream's saw
    stale_lag_ms: int = 0  # how long after a token's end its stale position is fed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = TrainConfig("", "", "")
    parser.add_argument("--base", required=True, help="Whisper checkpoint: hub id, local directory or tiny:whisper")
    parser.add_argument("--data", required=True, help="folder of audio files, each with a same-named .txt")
    parser.add_argument("--out", required=True, help="output folder: checkpoint-N/, adapter/, log.jsonl")
    parser.add_argument("--rank", type=int, default=d.rank,
                        help="LoRA rank (16-32; alpha = rank; default: %(default)s)")
    parser.add_argument("--chunk-ms", default=str(d.chunk_ms),
                        help="encoder block (chunk) size to train for, or several (100,200,300): steps take turns")
    parser.add_argument("--steps", type=int, default=d.steps, help="total optimizer steps (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="clips a step (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate, constant (default: %(default)s)")
    parser.add_argument("--save-every", type=int, default=d.save_every,
                        help="steps between checkpoints (default: %(default)s)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest --out/checkpoint-N")
    parser.add_argument("--seed", type=int, default=d.seed, help="random seed (default: %(default)s)")
    parser.add_argument("--device", default=d.device, help="cpu, cuda or cuda:N (default: %(default)s)")
    parser.add_argument("--dtype", default=d.dtype, choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--language", default=d.language, help="language token of the transcripts")
    parser.add_argument("--init", default=d.init, metavar="ADAPTER",
                        help="start from this adapter's weights (a folder or builtin:NAME; its rank, not --rank) "
                             "instead of zero; ignored by --resume, which continues its own checkpoint")
    parser.add_argument("--stale-share", type=float, default=d.stale_share, metavar="S",
                        help="share (0-1) of each batch's clips whose decoder positions see only the frames heard "
                             "when the stream predicts their next token (0: every position sees the whole clip)")
    parser.add_argument("--stale-lag-ms", type=int, default=d.stale_lag_ms, metavar="MS",
                        help="with --stale-share: a stale position is fed this long after its token ends (a multiple "
                             f"of {FRAME_MS} ms; the alignment's ends can be early, and the stream re-checks its last "
                             "tokens on later blocks)")
