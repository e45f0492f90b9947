"""The CTC prefix beam search with a word LM (runtime/models/asr/ctc_beam.py), against brute force: with no
pruning it must return exactly the transcript that maximises ln P_ctc(text) (every path spelling it summed) +
lm_weight * ln P_lm + word_bonus * words - oov_penalty * OOV words. Its stable words must never change, its
result must not depend on how frames are chunked, and in the shipped demo stream it must equal the same
search over the offline forward."""

import itertools
import math
import os

import numpy as np
import pytest

from runtime.models.asr.ctc_beam import BeamOptions, CTCBeamSearch, Pieces, WordScorer
from runtime.models.asr.word_lm import WordLM

os.environ["HF_HUB_OFFLINE"] = "1"
PIECES = ["\u2581a", "\u2581b", "a", "b", "\u2581"]  # label 5 is the blank
BLANK = len(PIECES)
EXACT = dict(beam=10**6, token_prune=math.inf, beam_prune=math.inf)


def frames(t: int, seed: int, sharpness: float = 3.0, v: int = BLANK + 1) -> np.ndarray:
    logits = np.random.default_rng(seed).normal(size=(t, v)) * sharpness
    return logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)


def brute_force(lp: np.ndarray, lm: WordLM | None, opts: BeamOptions) -> tuple[str, ...]:
    """Enumerate every label path, collapse it, spell it, sum per text, score, and take the best."""
    acoustic: dict[tuple[str, ...], float] = {}
    for path in itertools.product(range(lp.shape[1]), repeat=lp.shape[0]):
        labels = [c for i, c in enumerate(path) if c != BLANK and (i == 0 or path[i - 1] != c)]
        words = tuple("".join(PIECES[c] for c in labels).replace("\u2581", " ").split())
        p = float(sum(lp[t, c] for t, c in enumerate(path)))
        acoustic[words] = np.logaddexp(acoustic.get(words, -math.inf), p)

    def score(words: tuple[str, ...]) -> float:
        extra = opts.word_bonus * len(words)
        if lm is not None:
            extra += opts.lm_weight * lm.sentence_logp(words) - opts.oov_penalty * sum(
                w not in lm.vocabulary for w in words)
        return acoustic[words] + extra

    return max(acoustic, key=score)


def search(lm: WordLM | None, opts: BeamOptions) -> CTCBeamSearch:
    return CTCBeamSearch(Pieces(PIECES, BLANK), WordScorer(lm, opts))


LM = WordLM.fit([["a", "b"], ["ab", "a"], ["b", "b", "a"], ["ab"], ["a", "ab", "b"]], order=2)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("with_lm", [False, True])
def test_unpruned_beam_equals_brute_force(seed, with_lm):
    lp = frames(6, seed)
    opts = BeamOptions(**EXACT, lm_weight=0.8, word_bonus=0.5, oov_penalty=2.0)
    lm = LM if with_lm else None
    s = search(lm, opts)
    s.advance(lp)
    assert s.finish() == brute_force(lp, lm, opts)


def test_the_lm_changes_the_answer_where_the_acoustics_are_unsure():
    """Brute force says which texts win with and without the LM; find frames where they differ and check the
    beam follows the LM there (so the LM term is really in the search, not only in the final pick)."""
    opts = BeamOptions(**EXACT, lm_weight=3.0, word_bonus=0.0, oov_penalty=5.0)
    for seed in range(200):
        lp = frames(5, seed, sharpness=1.0)
        plain, scored = brute_force(lp, None, opts), brute_force(lp, LM, opts)
        if plain != scored:
            s = search(LM, opts)
            s.advance(lp)
            assert s.finish() == scored
            return
    pytest.fail("no frames where the LM changes the best transcript")


def stable_words_frame_by_frame(s: CTCBeamSearch, lp: np.ndarray) -> tuple[list, tuple[str, ...]]:
    """The stable words after each frame and the final transcript, checking that no stable word is revised."""
    seen = []
    for row in lp:
        s.advance(row[None])
        seen.append(s.stable_words())
    final = s.finish()
    for earlier, later in zip(seen, [*seen[1:], final], strict=True):
        assert later[: len(earlier)] == earlier
    return seen, final


@pytest.mark.parametrize("seed", range(5))
def test_stable_words_are_never_revised_and_chunking_changes_nothing(seed):
    rng = np.random.default_rng(seed)
    lp = frames(80, seed, sharpness=4.0)
    opts = BeamOptions(beam=8)
    seen, final = stable_words_frame_by_frame(search(LM, opts), lp)
    assert len(seen[-1]) > 0  # the check is not vacuous: words did become stable along the way
    chunked, pos = search(LM, opts), 0
    while pos < len(lp):
        size = int(rng.integers(1, 9))
        chunked.advance(lp[pos : pos + size])
        pos += size
    assert chunked.finish() == final


def tied_start(words: int) -> np.ndarray:
    """Frames whose first word is "a" or "b" with equal odds, then `words` clear words: no later frame can
    ever tell the two readings apart, so they agree on nothing for as long as the utterance lasts."""
    sure, unsure = math.log(0.97), math.log(0.01)
    rows = [[math.log(0.45), math.log(0.45), unsure, unsure, unsure, math.log(0.08)]]
    for i in range(words):
        for label in (BLANK, i % 2, BLANK):
            rows.append([sure if c == label else unsure for c in range(BLANK + 1)])
    lp = np.array(rows)
    return lp - np.logaddexp.reduce(lp, axis=1, keepdims=True)


def test_agreement_alone_holds_every_word_back_behind_an_unsettled_first_word():
    s = search(None, BeamOptions(beam=8))
    s.advance(tied_start(12))
    assert len(s.best_words()) == 13 and s.stable_words() == ()  # the case commit_frames exists for


@pytest.mark.parametrize("k", [1, 4, 9])
def test_a_word_the_leader_holds_for_commit_frames_is_final(k):
    lp = tied_start(12)
    s = search(None, BeamOptions(beam=8, commit_frames=k))
    completed, stable = [], []
    for row in lp:
        s.advance(row[None])
        completed.append(max(0, len(s.best_words()) - 1))  # the last word may still be being spelt
        stable.append(s.stable_words())
    for f in range(k, len(lp)):
        assert len(stable[f]) >= completed[f - k], f  # held k frames: final
        assert stable[f][: len(stable[f - 1])] == stable[f - 1]  # and never revised
    assert len(stable[-1]) >= 12 - math.ceil(k / 3)  # three frames a word: all but the last k frames' words
    final = s.finish()
    assert final[: len(stable[-1])] == stable[-1] and len(final) == 13


@pytest.mark.parametrize("seed", range(4))
def test_commitment_keeps_stable_words_final_and_changes_nothing_when_it_never_fires(seed):
    lp = frames(60, seed, sharpness=2.0)
    plain = search(LM, BeamOptions(beam=8))
    plain.advance(lp)
    late = search(LM, BeamOptions(beam=8, commit_frames=len(lp) + 1))
    late.advance(lp)
    assert late.finish() == plain.finish()
    stable_words_frame_by_frame(search(LM, BeamOptions(beam=8, commit_frames=3)), lp)


@pytest.mark.parametrize("commit", [0, 4])
def test_retiring_shared_words_changes_no_result_and_keeps_the_keys_short(commit, monkeypatch):
    """Words all hypotheses share leave the keys (only the LM history keeps them), so a frame's cost does not
    grow with the item. That must change nothing: the same search keeping every word in its keys gives the
    same stable words at every frame and the same transcript."""
    lp = np.concatenate([tied_start(40), frames(120, 7, sharpness=3.0)])
    opts = BeamOptions(beam=8, commit_frames=commit)
    retiring, keeping = search(LM, opts), search(LM, opts)
    monkeypatch.setattr(keeping, "_retire_shared_words", lambda: None)
    longest = 0
    for row in lp:
        retiring.advance(row[None])
        keeping.advance(row[None])
        assert retiring.stable_words() == keeping.stable_words()
        assert retiring.best_words() == keeping.best_words()
        assert retiring.unstable_words() == keeping.best_words()[len(keeping.stable_words()) :]
        longest = max(longest, *(len(words) for words, _, _ in retiring._beams))
    assert len(retiring.stable_words()) > 20 if commit else True
    assert retiring.finish() == keeping.finish()
    if commit:
        assert longest <= 8, longest  # the few words of the last frames, not the item's 40-odd


def test_pieces_read_control_and_byte_pieces():
    pieces = Pieces(["<unk>", "\u2581th", "e", "<0x41>", "<0xE2>", "\u2581"], blank=6)
    assert pieces.chars == ["", "th", "e", "A", "", "", ""]
    assert pieces.starts_word == [False, True, False, False, False, True, False]
    with pytest.raises(ValueError, match="blank label"):
        Pieces(["a"], blank=5)


def test_demo_stream_with_beam_equals_the_same_search_offline():
    """The shipped model and word LM, streamed in ragged chunks at the smallest look-ahead, give the items the
    same search gives over one offline forward of the same mask (items cut at the same pauses)."""
    from runtime.bench.asr_quality import offline_logprobs, offline_text
    from runtime.chunks import AudioChunk
    from runtime.config import ASRConfig
    from runtime.io.sample import demo_speech
    from runtime.models.asr.fastconformer.asr import FastConformerASR, find_checkpoint, load_any

    checkpoint = find_checkpoint("builtin:demo-fastconformer")
    model, tokenizer = load_any(checkpoint)
    cfg = ASRConfig(backend="fastconformer", model=str(checkpoint), lookahead_ms=0, decoder="beam")
    asr = FastConformerASR(model, tokenizer, cfg, checkpoint=checkpoint, pause_s=1e9)  # one item
    assert asr.beam is not None and asr.beam.lm is not None  # the shipped lm.arpa was found and read
    audio = demo_speech()[: 16000 * 5]
    expected = offline_text(asr, offline_logprobs(model, audio, asr.context))
    rng = np.random.default_rng(0)
    stream, updates, pos = asr.open_stream(), [], 0
    while pos < len(audio):
        size = int(rng.integers(160, 4000))
        updates += stream.accept(AudioChunk(audio[pos : pos + size], pos))
        pos += size
    updates += stream.finish()
    (done,) = [u for u in updates if u.completed]
    assert done.transcript == expected != ""
    assert "".join(u.delta for u in updates) == done.transcript  # stable text was only ever appended to
    assert any(u.unstable for u in updates)  # the beam held words back while it was unsure


def test_bad_decoder_settings_are_one_line_errors(capsys, tmp_path):
    import soundfile
    from cli_common import one_error_line, run_cli

    wav = tmp_path / "speech.wav"
    soundfile.write(wav, np.zeros(16000, dtype=np.float32), 16000)
    for setting, says in (("asr.decoder=viterbi", "asr.decoder"), ("asr.beam=0", "asr.beam"),
                          ("asr.lm=/no/such.arpa", "no such file"), ("asr.commit_after_s=-1", "asr.commit_after_s")):
        code, _, err = run_cli(capsys, "transcribe", str(wav), "--profile", "fastconformer", "--speed", "0", "-q",
                               "--set", setting)
        assert code != 0 and says in one_error_line(err), setting
    broken = tmp_path / "broken.arpa"
    broken.write_text("not an arpa file\n")
    code, _, err = run_cli(capsys, "transcribe", str(wav), "--profile", "fastconformer", "--speed", "0", "-q",
                           "--set", f"asr.lm={broken}")
    assert code != 0 and "broken.arpa" in one_error_line(err)
