"""Profiles load from configs/, overrides apply, and mistakes are one-line errors."""

import pytest

from runtime.errors import ConfigError
from runtime.profile_files import available_profiles, load_profile, parse_override


def test_shipped_profiles_load():
    assert {"tiny", "tiny-fastconformer", "cpu", "gpu", "whisper-causal", "whisper-buffered"} <= set(
        available_profiles())
    for name in available_profiles():
        load_profile(name)
    tiny = load_profile("tiny")
    assert tiny.random_weights and tiny.asr.model.startswith("tiny:")
    cpu = load_profile("cpu")
    assert not cpu.random_weights and cpu.device == "cpu"
    assert load_profile("gpu").dtype == "bfloat16"


def test_overrides_and_shortcuts():
    p = load_profile("tiny", overrides=["lm.max_new_tokens=5", "asr.model=/models/whisper", "video.fps=2"],
                     device="cuda:1", dtype="bfloat16")
    assert p.lm.max_new_tokens == 5 and p.asr.model == "/models/whisper" and p.video.fps == 2.0
    assert (p.device, p.dtype) == ("cuda:1", "bfloat16")
    assert parse_override("lm.system_prompt=be brief") == (["lm", "system_prompt"], "be brief")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "nope"}, "unknown profile 'nope'"),
        ({"name": "tiny", "overrides": ["lm.max_new_token=5"]}, "unknown key 'max_new_token'"),
        ({"name": "tiny", "overrides": ["lm.max_new_tokens=many"]}, "must be a int"),
        ({"name": "tiny", "dtype": "float8"}, "dtype 'float8'"),
        ({"name": "tiny", "device": "tpu"}, "device 'tpu'"),
        ({"name": "tiny", "overrides": ["video.fps=0"]}, "video.fps"),
        ({"name": "tiny", "overrides": ["nofield"]}, "--set expects"),
        ({"name": "tiny", "overrides": ["lm.drafter=dyspec"]}, "lm.drafter = dyspec needs lm.draft_model"),
        ({"name": "tiny", "overrides": ["lm.drafter=draft-model"]}, "lm.drafter = draft-model needs lm.draft_model"),
    ],
)
def test_mistakes_are_one_line_errors(kwargs, message):
    name = kwargs.pop("name")
    with pytest.raises(ConfigError, match=message) as err:
        load_profile(name, **kwargs)
    assert "\n" not in str(err.value)


def test_profile_by_path(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('[lm]\nmax_new_tokens = 3\n')
    assert load_profile(str(path)).lm.max_new_tokens == 3
    with pytest.raises(ConfigError, match="does not exist"):
        load_profile(str(tmp_path / "missing.toml"))
