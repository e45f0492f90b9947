"""The voice warp (VTLP on log-mels): identity at alpha 1, a tone's energy lands where the factor says, padding
and the step's generator are respected. The tempo stretch: lengths follow the drawn factor, a ramp stays the
same ramp, padding is zero, the generator decides everything."""

import numpy as np
import pytest
import torch

from runtime.chunks import SAMPLE_RATE
from runtime.models.asr.fastconformer.features import FeatureConfig, MelFeaturizer
from runtime.train.augment import VoiceWarp, filter_centres_hz, spec_augment, tempo_stretch

MELS = 80


@pytest.fixture(scope="module")
def featurizer():
    return MelFeaturizer(FeatureConfig())


def tone(freq: float, seconds: float = 0.5) -> np.ndarray:
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    return (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def make_warp(featurizer, max_warp: float = 0.15, mean: float = -5.0, std: float = 3.0) -> VoiceWarp:
    return VoiceWarp(featurizer, (mean,) * MELS, (std,) * MELS, max_warp)


def normalised(featurizer, audio: np.ndarray) -> torch.Tensor:
    return (featurizer(audio) + 5.0) / 3.0


def test_filter_centres_rise_across_the_band(featurizer):
    c = filter_centres_hz(featurizer)
    assert c.shape == (MELS,) and bool((c[1:] > c[:-1]).all())
    assert 0 < float(c[0]) < 100 and 7000 < float(c[-1]) < SAMPLE_RATE / 2


def test_alpha_one_is_the_identity(featurizer):
    x = normalised(featurizer, tone(700))
    assert torch.allclose(make_warp(featurizer).warp(x, 1.0), x, atol=1e-5)


@pytest.mark.parametrize("alpha", [0.87, 1.15])
def test_a_tone_moves_by_the_factor(featurizer, alpha):
    centres = filter_centres_hz(featurizer)
    x = normalised(featurizer, tone(1000))
    warped = make_warp(featurizer).warp(x, alpha)
    peak = float(centres[int(warped.mean(0).argmax())])
    direct = float(centres[int(normalised(featurizer, tone(1000 * alpha)).mean(0).argmax())])
    assert peak == direct  # the warped 1 kHz tone peaks in the filter a real 1000 * alpha Hz tone peaks in
    assert abs(peak - 1000 * alpha) < 60


def test_batches_keep_padding_and_follow_the_generator(featurizer):
    warp = make_warp(featurizer)
    a, b = normalised(featurizer, tone(500)), normalised(featurizer, tone(2000, 0.3))
    x = torch.zeros(2, a.shape[0], MELS)
    x[0], x[1, : b.shape[0]] = a, b
    lengths = torch.tensor([a.shape[0], b.shape[0]])
    out = warp(x, lengths, torch.Generator().manual_seed(3))
    assert torch.equal(out, warp(x, lengths, torch.Generator().manual_seed(3)))  # pure in the step's generator
    assert not torch.equal(out, warp(x, lengths, torch.Generator().manual_seed(4)))
    assert bool((out[1, b.shape[0]:] == 0).all())
    alphas = warp.draw(1000, torch.Generator().manual_seed(0))
    assert 1 / 1.15 - 1e-6 <= min(alphas) < 0.9 and 1.1 < max(alphas) <= 1.15 + 1e-6
    assert torch.equal(make_warp(featurizer, 0.0)(x, lengths, torch.Generator()), x)


def test_warp_range_is_checked(featurizer):
    with pytest.raises(ValueError, match="max_warp"):
        make_warp(featurizer, 1.0)


def test_spec_augment_masks_only_valid_frames():
    x = torch.ones(2, 300, MELS)
    x[1, 200:] = 0
    out = spec_augment(x, torch.tensor([300, 200]), torch.Generator().manual_seed(0))
    assert bool((out[1, 200:] == 0).all()) and 0 < float((out == 0).float().mean()) < 0.5


def test_tempo_stretch_resamples_each_utterance_in_time():
    lengths = torch.tensor([50, 31, 2])
    x = torch.zeros(3, 50, 4)
    for b, n in enumerate(lengths.tolist()):  # a linear ramp in time per bin: interpolation must keep it one
        x[b, :n] = torch.linspace(-1, 1, n)[:, None] * torch.arange(1, 5)[None, :]
    out, new = tempo_stretch(x, lengths, torch.Generator().manual_seed(3), 0.25)
    again, same = tempo_stretch(x, lengths, torch.Generator().manual_seed(3), 0.25)
    torch.testing.assert_close(out, again)
    assert torch.equal(new, same)
    rates = torch.exp((torch.rand(3, generator=torch.Generator().manual_seed(3)) * 2 - 1) * np.log1p(0.25))
    assert new.tolist() == [max(1, round(n * float(r))) for n, r in zip(lengths.tolist(), rates, strict=True)]
    assert out.shape == (3, int(new.max()), 4)
    for b, m in enumerate(new.tolist()):
        torch.testing.assert_close(out[b, :m], torch.linspace(-1, 1, m)[:, None] * torch.arange(1, 5)[None, :])
        assert not out[b, m:].any()
    assert any(m != n for m, n in zip(new.tolist(), lengths.tolist(), strict=True))


def test_tempo_stretch_off_and_out_of_range():
    x, lengths = torch.randn(2, 10, 4), torch.tensor([10, 7])
    gen = torch.Generator().manual_seed(0)
    out, new = tempo_stretch(x, lengths, gen, 0.0)
    assert out is x and new is lengths
    assert torch.equal(gen.get_state(), torch.Generator().manual_seed(0).get_state())  # nothing drawn
    with pytest.raises(ValueError, match="max_stretch"):
        tempo_stretch(x, lengths, gen, 1.0)
