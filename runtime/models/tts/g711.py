"""G.711 encoding (mu-law for `audio/pcmu`, A-law for `audio/pcma`): 16-bit PCM in, one byte a sample out.

Written here with numpy, from the standard's segment tables, rather than taken from FFmpeg (PyAV's `pcm_mulaw` /
`pcm_alaw` encoders): FFmpeg builds its tables by choosing the nearest reconstruction level in the 16-bit domain,
so on 512 (mu-law) and 964 (A-law) of the 65,536 input values, all at segment boundaries, its byte differs from the
standard's decision levels (and from the classic reference implementation that Python's `audioop` carried until
3.13). Any decoder reads either; this one is bit-exact with the standard, which the tests check over every 16-bit
value against an implementation of their own. Decoding stays with PyAV (`runtime/io/audio_formats.py`): a decoder
is a table lookup with nothing to disagree on.

mu-law: the 16-bit sample is cut to 14 bits, its magnitude (clipped to 8158) biased by 33 and located in one of
eight segments that double in width; the code is the segment (3 bits) and the next 4 bits of the magnitude below
its leading one, inverted, with the top bit marking negative samples.
A-law: cut to 13 bits, negative values one's-complemented; segments 0 and 1 are linear with the same step, the
rest double; the code's even bits are inverted (XOR 0x55) and its top bit marks positive samples.
"""

from __future__ import annotations

import numpy as np

_ULAW_SEGMENT_ENDS = np.array([63, 127, 255, 511, 1023, 2047, 4095, 8191])  # of the biased 14-bit magnitude
_ALAW_SEGMENT_ENDS = np.array([31, 63, 127, 255, 511, 1023, 2047, 4095])  # of the 13-bit magnitude


def ulaw_encode(pcm: np.ndarray) -> bytes:
    value = np.asarray(pcm, dtype=np.int16).astype(np.int32) >> 2
    negative = value < 0
    magnitude = np.minimum(np.where(negative, -value, value), 8158) + 33
    segment = np.searchsorted(_ULAW_SEGMENT_ENDS, magnitude)
    mantissa = (magnitude >> (segment + 1)) & 0x0F
    return (((segment << 4) | mantissa) ^ np.where(negative, 0x7F, 0xFF)).astype(np.uint8).tobytes()


def alaw_encode(pcm: np.ndarray) -> bytes:
    value = np.asarray(pcm, dtype=np.int16).astype(np.int32) >> 3
    positive = value >= 0
    magnitude = np.where(positive, value, -value - 1)  # at most 4095: always within the eight segments
    segment = np.searchsorted(_ALAW_SEGMENT_ENDS, magnitude)
    mantissa = (magnitude >> np.where(segment < 2, 1, segment)) & 0x0F
    return (((segment << 4) | mantissa) ^ np.where(positive, 0xD5, 0x55)).astype(np.uint8).tobytes()
