"""Whether a question asks about the screen, and what a session that cannot see the screen answers to one.

A session knows the picture only through the screen reader (PP-OCRv4, `screen.read`) or a vision-language model's
video memory. Without either, a text-only answerer asked "what is on the slide?" has nothing to answer from: a
small model guesses, and grounding (`lm.grounded`) would call it "not known yet", as if the slide might still be
read. Neither is true; the honest answer is that this session cannot see the screen, and how to get one that can.

The check is by words, small and readable so a test can pin it down. A question asks about the screen when it
names the screen ("screen", "on-screen", "slide", "whiteboard", "blackboard", "projector", "display"), asks what
is visible ("visible", "can you see"), or asks what is shown, displayed or written in the passive ("what is
shown?", "what's written there?"; not "who has written the report?" nor "written by"). It does not when it also
asks about what was said ("what did the speaker say about the slide?" is answered from the talk), and it checks
only questions and requests ("tell me what the slide says"), not statements ("let me show you the next slide").
It misses screen questions that name none of these ("what colour is the logo?") and takes "screen time" for the
screen: the answer then still says what the session can do, and a question that names the talk goes to the model.
"""

from __future__ import annotations

import re

from runtime.memory.grounding import is_question

# naming the screen: a question with any of these asks about it ("presentation slide", "on screen" have "slide",
# "screen")
SCREEN_NOUNS = frozenset(("screen", "screens", "onscreen", "slide", "slides", "whiteboard", "blackboard",
                          "projector", "display", "displays"))
# asking what is visible, whatever the sentence's form
VISIBLE_WORDS = frozenset(("visible",))
# asking what is shown, in the passive only: "what is shown?", but "the study has shown" is about a finding
PASSIVE_WORDS = frozenset(("shown", "displayed", "written"))
_BE = frozenset(("is", "are", "was", "were", "be", "been", "being", "s", "currently", "now", "still", "just"))
# asking about what was said: such a question is answered from the talk, whatever it says of the screen ("say"
# whose subject is the screen, "what does the slide say?", does not count)
SPEECH_WORDS = frozenset(("say", "says", "said", "saying", "mention", "mentions", "mentioned", "talk", "talks",
                          "talked", "talking", "speak", "speaks", "spoke", "speaking", "explained", "told", "hear",
                          "heard", "discussed", "narrated"))
# a request that asks without a question word: "tell me what the slide says", "read the slide"
_REQUESTS = frozenset(("tell", "describe", "read", "show", "list", "give", "summarize", "summarise"))
_WORD = re.compile(r"[a-z]+")


def asks_about_screen(question: str) -> bool:
    """Whether `question` asks about what is on screen (the rule: this module's docstring)."""
    words = _WORD.findall(question.lower().replace("on-screen", "onscreen"))
    if not words or not (is_question(question) or words[0] in _REQUESTS):
        return False
    if not (any(w in SCREEN_NOUNS or w in VISIBLE_WORDS for w in words) or _sees(words) or _passive(words)):
        return False
    return not any(w in SPEECH_WORDS and not _screen_says(words, i) for i, w in enumerate(words))


def _sees(words: list[str]) -> bool:
    """"can you see", "do you see", "could you see": the question asks what the assistant sees."""
    return any(a in ("can", "do", "could") and b == "you" and c == "see" for a, b, c in zip(words, words[1:],
                                                                                             words[2:], strict=False))


def _passive(words: list[str]) -> bool:
    """"shown", "displayed" or "written" after a form of "be" ("what is shown", "what's written", "what is
    currently displayed"), and "written" not followed by "by" (its author)."""
    for i, word in enumerate(words):
        if word not in PASSIVE_WORDS or i == 0 or words[i - 1] not in _BE:
            continue
        if word == "written" and i + 1 < len(words) and words[i + 1] == "by":
            continue
        return True
    return False


def _screen_says(words: list[str], i: int) -> bool:
    """Whether `words[i]` is "say(s)" with the screen for its subject: "the slide says", "does the screen say"."""
    return words[i] in ("say", "says") and any(w in SCREEN_NOUNS for w in words[max(0, i - 3):i])


CANNOT_SEE_SCREEN = ("I cannot see the screen: this session reads no text on screen and its model sees no video, "
                     "so I know only what was said. The default profile, demo, reads the screen of a source with "
                     "video (`runtime profiles` lists which profiles do).")


# what a grounded session that reads the screen answers to a screen question before it has read any text: the
# reader reads text, so a picture without any (the demo's shapes) is not known to it
NOTHING_READ_YET = "Not known yet: no text has been read on screen so far (the screen reader reads text, not pictures)."
