"""`runtime profiles`: every profile on the search path, one line each: what it loads, what it hears and sees, and
what it costs, the default marked.

A user picking a profile needs to know which one sees the screen before loading anything, so the listing reads the
TOML files alone: no model loads, no checkpoint is resolved (that could build a tiny model or download one), torch
is not imported. What it says is derived from the settings (the models named, `screen.read`, `lm.grounded`), except
two things the settings cannot say: the cost, a line each profile states in its `cost` field (measured where it says
so), and whether the answerer sees video, which loading decides from the checkpoint's config (`loaded_models.py`):
the listing goes by the model's name instead, LLaVA-OneVision being the one vision-language family the engine runs
(`models/lm/weights.py`), and a test holds the two equal where the checkpoints are at hand.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from typing import TextIO

from runtime.config import Profile
from runtime.errors import ConfigError
from runtime.profile_files import DEFAULT_PROFILE, available_profiles, find_profile, load_profile

VISION_FAMILIES = ("llava",)  # model names of the vision-language family the engine runs (LLaVA-OneVision)
COST_MEANS = ("cost: where it says measured, seconds to load the models (warm caches), resident memory once loaded and "
              "the demo sample played unpaced, on a 2-core x86 CPU; else what the weights weigh")


@dataclass(frozen=True)
class ProfileLine:
    """One profile as `runtime profiles` lists it."""

    name: str
    default: bool
    path: str
    description: str
    loads: dict[str, str]  # asr, answerer, and when it loads them: screen_reader, vision
    hears: str
    sees: str
    answers: str
    cost: str
    error: str = ""  # the profile does not load: why (the rest is empty)

    def text(self) -> str:
        """The one line of the text listing."""
        mark = "*" if self.default else " "
        if self.error:
            return f"{mark} {self.name}: cannot be read: {self.error}"
        loads = " + ".join(f"{role.replace('_', ' ')} {what}" for role, what in self.loads.items())
        return (f"{mark} {self.name}: loads {loads} | hears {self.hears} | sees {self.sees} | answers {self.answers} "
                f"| cost: {self.cost or 'not stated'}")


def sees_video(profile: Profile) -> bool:
    """Whether the answerer keeps a video memory, judged by the model's name (the module's docstring says why)."""
    return (profile.video.memory and profile.lm.backend == "engine"
            and any(family in profile.lm.model.lower() for family in VISION_FAMILIES))


def describe(profile: Profile, path: str, default: bool = False) -> ProfileLine:
    """What `profile` loads, hears, sees and answers from, and its stated cost, from its settings alone."""
    asr, lm = profile.asr, profile.lm
    asr_details = [asr.backend] + ([f"adapter {asr.adapter}"] if asr.adapter else [])
    if asr.final_pass != "none":
        asr_details.append(f"{asr.final_pass} final pass")
    loads = {"asr": f"{asr.model} ({', '.join(asr_details)})"}
    if lm.backend == "openai":
        loads["answerer"] = f"none here: {lm.model} at {lm.base_url}"
    else:
        loads["answerer"] = f"{lm.model} ({lm.backend}" + (f", {lm.weights})" if lm.weights != "auto" else ")")
    video = sees_video(profile)
    if profile.screen.read:
        loads["screen_reader"] = profile.screen.model
    if video:
        loads["vision"] = f"{lm.model}'s vision tower (video memory)"
    seen = [kind for kind, on in (("text on screen", profile.screen.read), ("the video", video)) if on]
    sees = " and ".join(seen) if seen else "nothing: frames are counted; a screen question is told it cannot see"
    answers = "from what was heard and read only (lm.grounded)" if lm.grounded else "from the conversation"
    if lm.backend == "openai":
        answers += ", on the server"
    return ProfileLine(profile.name, default, path, profile.description, loads, "speech", sees, answers, profile.cost)


def profile_lines() -> list[ProfileLine]:
    """Every profile on the search path, in name order; one that does not load says why instead."""
    lines = []
    for name in available_profiles():
        path = str(find_profile(name))
        try:
            lines.append(describe(load_profile(name), path, name == DEFAULT_PROFILE))
        except ConfigError as err:
            lines.append(ProfileLine(name, name == DEFAULT_PROFILE, path, "", {}, "", "", "", "", error=str(err)))
    return lines


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Print the listing: text, one line a profile, or with `--json` one object."""
    lines = profile_lines()
    if args.json:
        json.dump({"default": DEFAULT_PROFILE, "cost_means": COST_MEANS, "profiles": [asdict(p) for p in lines]},
                  out, indent=2)
        out.write("\n")
        return 0
    out.write(f"profiles (* = the default of serve, demo, transcribe and ask; --profile NAME picks another; "
              f"{COST_MEANS})\n")
    for line in lines:
        out.write(line.text() + "\n")
    return 0
