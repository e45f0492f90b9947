"""The Realtime API's input audio formats: parsing the session field, and decoding each to float32 mono 16 kHz
as a stream that may be cut anywhere.

G.711 is encoded here with the standard's formulas written in numpy (after Sun's public-domain g711.c), an
implementation independent of the FFmpeg decoder under test; a check compares them with FFmpeg's encoder.
"""

from __future__ import annotations

import av
import numpy as np
import pytest

from runtime.io.audio_formats import DEFAULT_FORMAT, AudioDecoder, AudioFormat, parse_audio_format

PARAM = "session.audio.input.format"
PCM24 = AudioFormat("audio/pcm", 24000)
PCM16 = AudioFormat("audio/pcm", 16000)
PCMU = AudioFormat("audio/pcmu", 8000)
PCMA = AudioFormat("audio/pcma", 8000)


def sine(freq: float, rate: int, seconds: float, amplitude: float = 0.5) -> np.ndarray:
    return amplitude * np.sin(2 * np.pi * freq * np.arange(round(rate * seconds)) / rate)


def pcm16(samples: np.ndarray) -> np.ndarray:
    return np.round(np.clip(samples, -1, 1) * 32767).astype("<i2")


def mulaw_encode(pcm: np.ndarray) -> bytes:
    """G.711 mu-law: bias 0x84, clip 32635, 3-bit exponent, 4-bit mantissa, all bits inverted."""
    x = pcm.astype(np.int32)
    sign = np.where(x < 0, 0x80, 0)
    magnitude = np.minimum(np.abs(x), 32635) + 0x84
    exponent = np.floor(np.log2(magnitude)).astype(np.int32) - 7
    mantissa = (magnitude >> (exponent + 3)) & 0x0F
    return (~(sign | (exponent << 4) | mantissa) & 0xFF).astype(np.uint8).tobytes()


def alaw_encode(pcm: np.ndarray) -> bytes:
    """G.711 A-law: 13-bit magnitude in 8 segments, even bits inverted (XOR 0x55; 0xD5 adds the sign)."""
    x = pcm.astype(np.int32) >> 3
    mask = np.where(x >= 0, 0xD5, 0x55)
    x = np.where(x >= 0, x, -x - 1)
    segment = np.searchsorted(np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF]), x)
    shift = np.maximum(segment, 1)
    value = np.where(segment >= 8, 0x7F, (np.minimum(segment, 7) << 4) | ((x >> shift) & 0x0F))
    return (value ^ mask).astype(np.uint8).tobytes()


G711_ENCODERS = {"audio/pcmu": (mulaw_encode, "pcm_mulaw"), "audio/pcma": (alaw_encode, "pcm_alaw")}


def whole(decoder: AudioDecoder, raw: bytes) -> np.ndarray:
    return np.concatenate([decoder.decode(raw), decoder.flush()])


def streamed(decoder: AudioDecoder, pieces: list[bytes]) -> np.ndarray:
    return np.concatenate([*(decoder.decode(piece) for piece in pieces), decoder.flush()])


def random_cuts(raw: bytes, rng: np.random.Generator, unit: int, max_units: int) -> list[bytes]:
    """`raw` cut at random multiples of `unit` bytes, with empty pieces and 1-unit pieces among them."""
    pieces, at = [], 0
    while at < len(raw):
        size = unit * int(rng.choice([0, 1, rng.integers(1, max_units + 1)]))
        pieces.append(raw[at:at + size])
        at += size
    return pieces


# --- parsing -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "expected"), [
    ({"type": "audio/pcm", "rate": 24000}, PCM24),
    ({"type": "audio/pcm"}, PCM24),  # the SDK's types make rate optional ("always 24000")
    ({"type": "audio/pcm", "rate": 16000}, PCM16),
    ({"type": "audio/pcmu"}, PCMU),
    ({"type": "audio/pcma"}, PCMA),
    ({"type": "audio/pcmu", "rate": 8000}, PCMU),
    ("pcm16", PCM24),
    ("g711_ulaw", PCMU),
    ("g711_alaw", PCMA),
    (PCMA, PCMA),
])
def test_parse_accepts_the_api_shapes(value: object, expected: AudioFormat) -> None:
    assert parse_audio_format(value, PARAM) == expected


@pytest.mark.parametrize("value", [
    None, 24000, "pcm", "audio/pcm", "PCM16", "opus", ["pcm16"], {}, {"rate": 24000},
    {"type": "audio/pcm", "rate": 48000}, {"type": "audio/pcm", "rate": 8000}, {"type": "audio/pcm", "rate": "24000"},
    {"type": "audio/pcm", "rate": 24000.0}, {"type": "audio/pcm", "rate": True},
    {"type": "audio/pcm", "rate": 24000, "channels": 1}, {"type": "audio/pcmu", "rate": 16000},
    {"type": "audio/opus"}, {"type": None},
])
def test_parse_refuses_others_naming_the_field_and_the_allowed_values(value: object) -> None:
    with pytest.raises(ValueError) as error:
        parse_audio_format(value, PARAM)
    message = str(error.value)
    assert "\n" not in message and message.startswith(PARAM)
    for allowed in ('"audio/pcm"', "24000", '"audio/pcmu"', '"audio/pcma"', '"pcm16"', '"g711_ulaw"', '"g711_alaw"'):
        assert allowed in message


def test_refusal_stays_one_short_line_whatever_was_sent() -> None:
    with pytest.raises(ValueError) as error:
        parse_audio_format({"type": "x\ny" * 500}, PARAM)
    assert "\n" not in str(error.value) and len(str(error.value)) < 400


def test_to_dict_is_the_api_shape_and_parses_back() -> None:
    assert DEFAULT_FORMAT == PCM24
    assert PCM24.to_dict() == {"type": "audio/pcm", "rate": 24000}
    assert PCM16.to_dict() == {"type": "audio/pcm", "rate": 16000}
    assert PCMU.to_dict() == {"type": "audio/pcmu"}
    assert PCMA.to_dict() == {"type": "audio/pcma"}
    for fmt in (PCM24, PCM16, PCMU, PCMA):
        assert parse_audio_format(fmt.to_dict(), PARAM) == fmt


@pytest.mark.parametrize(("kind", "rate"), [("audio/pcmu", 16000), ("audio/pcm", 44100), ("audio/opus", 48000)])
def test_an_unsupported_format_cannot_be_built(kind: str, rate: int) -> None:
    with pytest.raises(ValueError, match="unsupported"):
        AudioFormat(kind, rate)


# --- PCM -----------------------------------------------------------------------------------------------------


def test_pcm_24k_sine_decodes_to_16k_at_the_same_pitch_and_time() -> None:
    out = whole(AudioDecoder(PCM24), pcm16(sine(440, 24000, 1.0)).tobytes())
    assert out.dtype == np.float32 and abs(len(out) - 16000) <= 2
    spectrum = np.abs(np.fft.rfft(out))
    assert np.argmax(spectrum) * 16000 / len(out) == pytest.approx(440, abs=1)
    # the resampler compensates its own delay: sample n is time n / 16 kHz (edges aside, where the filter
    # sees the stream's ends)
    expected = sine(440, 16000, len(out) / 16000)
    assert np.max(np.abs(out - expected)[100:-100]) < 2e-3


@pytest.mark.parametrize("seed", range(4))
def test_pcm_24k_streamed_in_random_whole_sample_pieces_equals_one_call(seed: int) -> None:
    rng = np.random.default_rng(seed)
    raw = pcm16(sine(440, 24000, 0.5) + 0.1 * rng.standard_normal(12000)).tobytes()
    one = whole(AudioDecoder(PCM24), raw)
    pieces = random_cuts(raw, rng, unit=2, max_units=700)
    assert b"".join(pieces) == raw
    many = streamed(AudioDecoder(PCM24), pieces)
    assert len(many) == len(one)
    np.testing.assert_allclose(many, one, atol=1e-6, rtol=0)


def test_pcm_16k_is_the_plain_numpy_path() -> None:
    rng = np.random.default_rng(5)
    ints = rng.integers(-32768, 32768, 4000).astype("<i2")
    decoder = AudioDecoder(PCM16)
    out = decoder.decode(ints.tobytes())
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, ints.astype(np.float32) / 32768)
    assert len(decoder.flush()) == 0  # no resampler, so nothing held back


@pytest.mark.parametrize("fmt", [PCM24, PCM16])
def test_an_odd_pcm_byte_count_raises_and_leaves_the_stream_intact(fmt: AudioFormat) -> None:
    raw = pcm16(sine(300, fmt.rate, 0.1)).tobytes()
    decoder = AudioDecoder(fmt)
    with pytest.raises(ValueError, match="odd number of bytes"):
        decoder.decode(raw[:3])
    np.testing.assert_array_equal(whole(decoder, raw), whole(AudioDecoder(fmt), raw))


def test_full_scale_input_stays_in_range_though_the_filter_overshoots() -> None:
    square = np.where(sine(300, 24000, 0.5) >= 0, 1.0, -1.0)
    out = whole(AudioDecoder(PCM24), pcm16(square).tobytes())
    assert out.dtype == np.float32 and np.max(np.abs(out)) <= 1.0


# --- G.711 ---------------------------------------------------------------------------------------------------


def ffmpeg_g711(codec_name: str, pcm: np.ndarray) -> bytes:
    codec = av.CodecContext.create(codec_name, "w")
    codec.sample_rate, codec.layout, codec.format = 8000, "mono", "s16"
    frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
    frame.sample_rate = 8000
    return b"".join(bytes(packet) for packet in [*codec.encode(frame), *codec.encode(None)])


@pytest.mark.parametrize("fmt", [PCMU, PCMA])
def test_the_numpy_g711_encoders_agree_with_ffmpeg_up_to_decision_edges(fmt: AudioFormat) -> None:
    """FFmpeg's encoder picks the nearest level; the formulas' decision values sit a little off that at some
    edges, so about 1.3 % of codes differ, each by one quantisation level. Bit layout, sign and inversion
    errors would show as far larger differences."""
    encode, codec_name = G711_ENCODERS[fmt.type]
    pcm = np.arange(-32768, 32768, 7, dtype=np.int16)
    ours, theirs = encode(pcm), ffmpeg_g711(codec_name, pcm)
    assert np.mean(np.frombuffer(ours, np.uint8) == np.frombuffer(theirs, np.uint8)) > 0.98
    decoder = av.CodecContext.create(codec_name, "r")  # FFmpeg's table from code to level
    decoder.sample_rate, decoder.layout = 8000, "mono"

    def decode(raw: bytes) -> np.ndarray:
        return np.concatenate([frame.to_ndarray().reshape(-1) for frame in decoder.decode(av.Packet(raw))])

    levels = np.unique(decode(bytes(range(256))))
    ours_levels, their_levels = np.searchsorted(levels, decode(ours)), np.searchsorted(levels, decode(theirs))
    assert np.max(np.abs(ours_levels - their_levels)) <= 1


@pytest.mark.parametrize("fmt", [PCMU, PCMA])
def test_g711_sine_decodes_to_the_original_at_16k(fmt: AudioFormat) -> None:
    encode, _ = G711_ENCODERS[fmt.type]
    out = whole(AudioDecoder(fmt), encode(pcm16(sine(440, 8000, 1.0))))
    assert out.dtype == np.float32 and len(out) == 16000
    expected = sine(440, 16000, 1.0)[100:-100]
    got = out[100:-100]
    assert np.corrcoef(got, expected)[0, 1] > 0.99
    assert np.sqrt(np.mean((got - expected) ** 2)) < 0.01  # G.711's quantisation noise, ~38 dB under a 0.5 sine


@pytest.mark.parametrize("fmt", [PCMU, PCMA])
def test_g711_cut_at_every_byte_equals_one_call(fmt: AudioFormat) -> None:
    encode, _ = G711_ENCODERS[fmt.type]
    rng = np.random.default_rng(7)
    raw = encode(pcm16(sine(440, 8000, 0.25) + 0.05 * rng.standard_normal(2000)))
    one = whole(AudioDecoder(fmt), raw)
    for pieces in ([raw[i:i + 1] for i in range(len(raw))], random_cuts(raw, rng, unit=1, max_units=300)):
        many = streamed(AudioDecoder(fmt), pieces)
        assert len(many) == len(one)
        np.testing.assert_allclose(many, one, atol=1e-6, rtol=0)


# --- the stream's life ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [PCM24, PCM16, PCMU, PCMA])
def test_empty_messages_decode_to_nothing_and_break_nothing(fmt: AudioFormat) -> None:
    """An empty av.Packet is FFmpeg's "drain" signal, after which a decoder refuses all input."""
    raw = bytes(range(256)) * 4
    decoder = AudioDecoder(fmt)
    for _ in range(2):
        out = decoder.decode(b"")
        assert out.dtype == np.float32 and len(out) == 0
    assert len(decoder.flush()) == 0
    np.testing.assert_array_equal(streamed(decoder, [b"", raw[:500], b"", raw[500:]]), whole(AudioDecoder(fmt), raw))


@pytest.mark.parametrize("fmt", [PCM24, PCMU])
def test_flush_ends_the_stream_and_the_next_decode_starts_a_new_one(fmt: AudioFormat) -> None:
    raw = bytes(range(256)) * 4
    decoder = AudioDecoder(fmt)
    first = whole(decoder, raw)
    assert len(decoder.flush()) == 0
    np.testing.assert_array_equal(whole(decoder, raw), first)


@pytest.mark.parametrize(("fmt", "steady", "most"), [(PCM24, 17, 34), (PCMU, 32, 64), (PCMA, 32, 64)])
def test_the_resampler_holds_back_what_the_module_docstring_says(fmt: AudioFormat, steady: int, most: int) -> None:
    unit = 2 if fmt.type == "audio/pcm" else 1
    raw = bytes(np.random.default_rng(3).integers(0, 256, fmt.rate // 2 * unit, dtype=np.uint8))
    for piece_units, bound in ((fmt.rate // 50, steady), (1, most)):  # 20 ms messages; then 1-sample ones
        decoder, fed, out, held = AudioDecoder(fmt), 0, 0, 0.0
        for at in range(0, len(raw), piece_units * unit):
            piece = raw[at:at + piece_units * unit]
            fed += len(piece) // unit
            out += len(decoder.decode(piece))
            held = max(held, fed * 16000 / fmt.rate - out)
        assert held <= bound
        assert len(decoder.flush()) <= steady
