"""The voice's output audio (runtime/models/tts/output_audio.py): G.711 bytes against an independent implementation
of the standard written here, over every 16-bit value; resampling's rate and length; a response encoded in
pieces equals the same response encoded whole."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.io.audio_formats import PCM, PCMA, PCMU, AudioDecoder, AudioFormat
from runtime.models.tts.output_audio import AudioEncoder, g711_encode, resample
from runtime.models.tts.voice import Speech, check_speed, to_int16

ALL_INT16 = np.arange(-32768, 32768, dtype=np.int64)


# -- the reference: G.711 as the standard describes it, one sample at a time ---------------------------------------
def ref_ulaw(sample: int) -> int:
    """mu-law: 14-bit magnitude plus a bias of 33, a 3-bit exponent (the segment) and 4 mantissa bits, all
    inverted; the sign bit marks negative values. Segment s holds biased magnitudes [32 * 2**s, 64 * 2**s)."""
    value = sample >> 2  # 16 -> 14 bits (arithmetic shift, as the standard's integer tables)
    sign = 0x80 if value < 0 else 0x00
    magnitude = min(-value if value < 0 else value, 8158) + 33
    exponent = max(0, magnitude.bit_length() - 6)  # 33..63 -> 0, 64..127 -> 1, ...
    mantissa = (magnitude >> (exponent + 1)) & 0x0F
    return (sign | (exponent << 4) | mantissa) ^ 0xFF


def ref_alaw(sample: int) -> int:
    """A-law: 13-bit magnitude (negatives one's-complemented), segment 0 and 1 linear, then a 3-bit exponent and
    4 mantissa bits; even bits inverted (XOR 0x55), the sign bit set for positive values."""
    value = sample >> 3  # 16 -> 13 bits
    if value >= 0:
        sign, magnitude = 0x80, value
    else:
        sign, magnitude = 0x00, -value - 1
    if magnitude >= 4096:
        return (sign | 0x7F) ^ 0x55
    exponent = max(0, magnitude.bit_length() - 5)  # 0..31 -> 0, 32..63 -> 1, 64..127 -> 2, ...
    mantissa = (magnitude >> (exponent if exponent else 1)) & 0x0F
    return (sign | (exponent << 4) | mantissa) ^ 0x55


@pytest.mark.parametrize(("fmt", "reference"), [(PCMU, ref_ulaw), (PCMA, ref_alaw)])
def test_g711_matches_the_reference_on_every_16_bit_value(fmt: str, reference) -> None:
    encoded = np.frombuffer(g711_encode(ALL_INT16.astype(np.int16), fmt), dtype=np.uint8)
    expected = np.array([reference(int(v)) for v in ALL_INT16], dtype=np.uint8)
    assert len(encoded) == len(ALL_INT16)
    wrong = np.flatnonzero(encoded != expected)
    assert wrong.size == 0, f"{wrong.size} values differ, first at {ALL_INT16[wrong[0]]}"


def test_g711_matches_audioop_where_python_still_has_it() -> None:
    """A third opinion: CPython's audioop (the classic reference implementation), removed in Python 3.13."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        audioop = pytest.importorskip("audioop")
    pcm = ALL_INT16.astype(np.int16)
    assert g711_encode(pcm, PCMU) == audioop.lin2ulaw(pcm.tobytes(), 2)
    assert g711_encode(pcm, PCMA) == audioop.lin2alaw(pcm.tobytes(), 2)


def test_g711_known_codes() -> None:
    """Silence and full scale, as printed in every G.711 table."""
    assert g711_encode(np.array([0, 32767, -32768], np.int16), PCMU) == bytes([0xFF, 0x80, 0x00])
    assert g711_encode(np.array([0, 32767, -32768], np.int16), PCMA) == bytes([0xD5, 0xAA, 0x2A])
    assert g711_encode(np.zeros(0, np.int16), PCMU) == b""
    with pytest.raises(ValueError, match="not a G.711 format"):
        g711_encode(np.zeros(1, np.int16), PCM)


@pytest.mark.parametrize("fmt", [PCMU, PCMA])
def test_g711_round_trips_through_the_input_decoder(fmt: str) -> None:
    """The input side (PyAV's decoder) reads back what the output side wrote, within G.711's step size."""
    t = np.arange(8000) / 8000
    tone = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    encoder = AudioEncoder(AudioFormat(fmt, 8000), voice_rate=8000)
    data = encoder.encode(tone) + encoder.flush()
    assert len(data) == 8000 and encoder.samples_out == 8000
    decoder = AudioDecoder(AudioFormat(fmt, 8000))
    back = np.concatenate([decoder.decode(data), decoder.flush()])  # at 16 kHz
    assert len(back) == 16000
    assert np.max(np.abs(back[::2][100:-100] - tone[100:-100])) < 0.03


@pytest.mark.parametrize(("rate_in", "rate_out"), [(22050, 24000), (22050, 16000), (22050, 8000), (24000, 24000)])
def test_resampling_keeps_the_duration_and_the_pitch(rate_in: int, rate_out: int) -> None:
    seconds = 1.5
    t = np.arange(round(seconds * rate_in)) / rate_in
    tone = (0.8 * np.sin(2 * np.pi * 1000 * t)).astype(np.float32)
    out = resample(tone, rate_in, rate_out)
    assert out.dtype == np.float32 and abs(len(out) - seconds * rate_out) <= 1
    spectrum = np.abs(np.fft.rfft(out * np.hanning(len(out))))
    assert np.fft.rfftfreq(len(out), 1 / rate_out)[np.argmax(spectrum)] == pytest.approx(1000, abs=2)
    assert np.max(np.abs(out)) <= 1.0


def test_a_response_encoded_in_pieces_equals_it_encoded_whole() -> None:
    """Clause after clause through one encoder: the same bytes as one call on the whole answer (no click at a
    clause boundary, no drift of the sample count)."""
    rng = np.random.default_rng(0)
    audio = (0.3 * rng.standard_normal(22050 * 2)).astype(np.float32)
    for fmt in (AudioFormat(PCM, 24000), AudioFormat(PCMU, 8000), AudioFormat(PCMA, 8000)):
        whole = AudioEncoder(fmt, 22050)
        expected = whole.encode(audio) + whole.flush()
        pieces = AudioEncoder(fmt, 22050)
        cuts = [0, 1, 700, 5000, 5001, 30000, len(audio)]
        got = b"".join(pieces.encode(audio[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)) + pieces.flush()
        assert got == expected
        assert len(got) == pieces.samples_out * pieces.bytes_per_sample
        assert abs(pieces.samples_out - 2 * fmt.rate) <= 1


def test_pcm_output_is_little_endian_int16_at_24_khz() -> None:
    encoder = AudioEncoder(AudioFormat(PCM, 24000), voice_rate=24000)  # same rate: no resampler in the way
    data = encoder.encode(np.array([0.0, 0.5, -1.0, 1.5], np.float32)) + encoder.flush()
    assert np.frombuffer(data, "<i2").tolist() == [0, 16384, -32767, 32767]


def test_int16_conversion_clips_rather_than_wraps() -> None:
    assert to_int16(np.array([0.0, 1.0, -1.0, 2.0, -2.0], np.float32)).tolist() == [0, 32767, -32767, 32767, -32768]
    speech = Speech(np.zeros(2205, np.float32), 22050)
    assert speech.duration_s == pytest.approx(0.1) and speech.int16().dtype == np.int16


def test_speed_is_the_apis_range() -> None:
    assert check_speed(1) == 1.0 and check_speed(0.25) == 0.25 and check_speed(1.5) == 1.5
    for bad in (0.2, 1.6, float("nan"), 0.0):
        with pytest.raises(ValueError, match="between 0.25 and 1.5"):
            check_speed(bad)
