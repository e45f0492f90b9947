"""The answering language model, chosen by `lm.backend`."""

from runtime.models.lm.answerer import Answerer, AnswerState, AnswerStep, load_answerer

__all__ = ["AnswerState", "AnswerStep", "Answerer", "load_answerer"]
