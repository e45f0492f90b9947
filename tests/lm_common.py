"""Shared by the language-model tests: prompts that exercise byte-level text, a loop that runs an answer to its
end, and plain greedy decoding with transformers, the reference every answerer must equal token for token."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PretrainedConfig, PreTrainedModel

from runtime.models.lm.backend import Answer, AnswerStep

N = 20  # tokens per answer in these tests
PROMPTS = [
    ("", "What was said?"),
    ("The meeting starts at nine, and the budget will grow by ten percent.", "Who manages the budget?"),
    ("Elle a dit: « café, s'il vous plaît » — 日本語も少し。", "¿Qué pidió? 🙂"),
    ("one two three " * 40, "Count the words."),
]


def run_answer(answer: Answer, max_new_tokens: int = N) -> list[AnswerStep]:
    """Step an answer until done; never more steps than tokens allowed (+1 for the final empty step)."""
    steps: list[AnswerStep] = []
    while not (steps and steps[-1].done):
        steps.append(answer.step())
        assert len(steps) <= max_new_tokens + 1
    return steps


def greedy_ids(model: PreTrainedModel, prompt: list[int], *, pad_token_id: int = 0, **kwargs: object) -> list[int]:
    """transformers' own greedy decoding of N new tokens (an explicit mask: pad id 0 may occur in prompts)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=N,
                         pad_token_id=pad_token_id, **kwargs)
    return out[0, len(prompt):].tolist()


def save_random_model(cls: type[PreTrainedModel], cfg: PretrainedConfig, path: Path) -> PreTrainedModel:
    """A seeded random model saved with save_pretrained (safetensors); biases made non-zero so they count."""
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
    model.save_pretrained(path)
    return model
