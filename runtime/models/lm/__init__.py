"""The answering language model, chosen by `lm.backend` (see `backend.py` for the seam, `registry.py` for the
names)."""

from runtime.models.lm.backend import Answer, AnswerBackend, AnswerStep, LMStream, NoAnswerer
from runtime.models.lm.generate_answerer import GenerateAnswer, GenerateAnswerer
from runtime.models.lm.registry import BACKENDS, load_answerer

__all__ = [
    "BACKENDS",
    "Answer",
    "AnswerBackend",
    "AnswerStep",
    "GenerateAnswer",
    "GenerateAnswerer",
    "LMStream",
    "NoAnswerer",
    "load_answerer",
]
