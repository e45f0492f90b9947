"""The model over padded batches, as training and its held-out scoring both run it: the batched encoder
forward (equal, utterance by utterance, to the unbatched one the runtime streams), the CTC loss, and greedy
CTC transcripts scored with text_norm's WER and CER at each look-ahead the model was trained for."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from runtime.models.asr.fastconformer.model import (
    SUB_LEFT,
    SUB_RIGHT,
    ConformerEncoder,
    FastConformerCTC,
    chunked_limited_mask,
    ctc_collapse,
)
from runtime.models.asr.fastconformer.tokenizer import CTCTokenizer
from runtime.train.ctc_data import Utterance, collate, make_batches
from runtime.train.text_norm import cer, wer


def encode_batch(
    encoder: ConformerEncoder, feats: torch.Tensor, lengths: torch.Tensor, context: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ConformerEncoder.forward` over a padded batch: [B, T, mels], [B] -> [B, T', d], [B] encoder lengths.
    Each utterance's valid frames equal its own unbatched forward: subsampling stages zero the frames past its
    length (the offline right padding), attention masks keys past it, and the depthwise convs are causal."""
    sub = encoder.pre_encode
    x = feats.unsqueeze(1)
    n = lengths.to(feats.device)
    for i in range(len(sub.stage_slices)):
        x = sub.stage(i, F.pad(x, (0, 0, SUB_LEFT, SUB_RIGHT)))
        n = n // 2 + 1
        keep = torch.arange(x.shape[2], device=x.device)[None, :] < n[:, None]
        x = x * keep[:, None, :, None].to(x.dtype)
    x = sub.project(x) * encoder.xscale
    t = x.shape[1]
    valid = torch.arange(t, device=x.device)[None, :] < n[:, None]
    allowed = chunked_limited_mask(t, context, x.device)[None] & valid[:, None, :]
    pos = encoder.pos_emb(t, x)
    if pos.is_inference():  # cached by an earlier inference-mode call: autograd cannot save it
        pos = pos.clone()
    for layer in encoder.layers:
        x = layer(x, pos, allowed)[0]
    return x, n


def ctc_loss(model: FastConformerCTC, feats: torch.Tensor, lengths: torch.Tensor, targets: list[list[int]],
             context: tuple[int, int]) -> torch.Tensor:
    """Mean over the batch of each utterance's CTC loss divided by its target length (torch's 'mean')."""
    enc, enc_lengths = encode_batch(model.encoder, feats, lengths, context)
    log_probs = model.decoder(enc)  # [B, T', V + 1] float32
    flat = torch.tensor([t for ts in targets for t in ts], dtype=torch.long, device=log_probs.device)
    target_lengths = torch.tensor([len(ts) for ts in targets], dtype=torch.long)
    return F.ctc_loss(log_probs.transpose(0, 1), flat, enc_lengths.cpu(), target_lengths, blank=model.blank,
                      reduction="mean", zero_infinity=True)


@torch.no_grad()
def greedy_transcripts(model: FastConformerCTC, tokenizer: CTCTokenizer, utts: list[Utterance],
                       context: tuple[int, int], batch_frames: int) -> list[str]:
    """Greedy CTC text of each utterance (batched like training, which equals the unbatched forward)."""
    device = model.device
    hyps = [""] * len(utts)
    for idx in make_batches([u.features.shape[0] for u in utts], batch_frames):  # type: ignore[union-attr]
        feats, lengths = collate([utts[i].features for i in idx])  # type: ignore[misc]
        enc, n = encode_batch(model.encoder, feats.to(device), lengths, context)
        labels = model.decoder(enc).argmax(-1).cpu()
        for j, i in enumerate(idx):
            hyps[i] = tokenizer.decode(ctc_collapse(labels[j, : int(n[j])].tolist(), model.blank))
    return hyps



def score_heldout(model: FastConformerCTC, tokenizer: CTCTokenizer, utts: list[Utterance],
                  batch_frames: int) -> dict[str, dict[str, Any]]:
    """{"lookahead_<ms>ms": {wer, cer, utterances}} for every trained context (features already normalised)."""
    refs = [u.text for u in utts]
    scores = {}
    for context in model.cfg.att_context_sizes:
        hyps = greedy_transcripts(model, tokenizer, utts, context, batch_frames)
        scores[f"lookahead_{model.cfg.lookahead_ms(context)}ms"] = {
            "wer": round(wer(refs, hyps), 4), "cer": round(cer(refs, hyps), 4), "utterances": len(utts)}
    return scores
