"""The word n-gram behind the FastConformer's beam search (runtime/models/asr/word_lm.py) and its recipe
(`runtime train word-lm`): a proper distribution, Kneser-Ney's continuation counts, an exact ARPA round trip,
and an estimate that can never see a held-out text."""

import json
import math
import random

import pytest
from cli_common import one_error_line, run_cli

from runtime.models.asr.word_lm import BOS, EOS, UNK, WordLM
from runtime.train.texts import is_heldout

WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "rug", "big", "small", "red"]


def corpus(n: int, seed: int = 0) -> list[list[str]]:
    rng = random.Random(seed)
    return [[rng.choice(WORDS) for _ in range(rng.randint(1, 7))] for _ in range(n)]


@pytest.mark.parametrize(("order", "listed"), [(1, ()), (2, ()), (3, ()), (4, ()), (3, ("lamp", "sofa", "cat"))])
def test_every_history_gets_a_distribution_that_sums_to_one(order, listed):
    lm = WordLM.fit(corpus(300), order=order, listed=listed, listed_weight=0.25)
    outcomes = [*sorted(lm.vocabulary), EOS, UNK]
    histories = [(), (BOS,), ("the",), (BOS, "the"), ("cat", "sat"), ("rug", "rug", "rug"), ("never", "seen")]
    for history in histories:
        total = sum(math.exp(lm.logp(history, w)) for w in outcomes)
        assert total == pytest.approx(1.0, abs=1e-9), history


def test_kneser_ney_unigrams_count_contexts_not_occurrences():
    # "francisco" occurs five times but only ever after "san"; "cat" three times after three different words.
    sentences = [["san", "francisco"]] * 5 + [["the", "cat"], ["a", "cat"], ["my", "cat"]]
    lm = WordLM.fit(sentences, order=2)
    assert lm.logp(("zebra",), "cat") > lm.logp(("zebra",), "francisco")  # unseen history: the continuation
    assert lm.logp(("san",), "francisco") > lm.logp(("san",), "cat")  # the seen bigram still wins


def test_listed_words_get_their_weighted_share_of_the_unseen_mass():
    plain = WordLM.fit(corpus(300), order=3)
    lm = WordLM.fit(corpus(300), order=3, listed=["lamp", "sofa", "cat"], listed_weight=0.25)
    assert lm.vocabulary == plain.vocabulary | {"lamp", "sofa"}  # "cat" was seen: listing it changes nothing
    for history in [(), ("the",), ("cat", "sat")]:
        assert lm.logp(history, "lamp") == pytest.approx(lm.logp(history, UNK) + math.log(0.25))
        assert lm.logp(history, "lamp") < min(lm.logp(history, w) for w in plain.vocabulary)
        for word in plain.vocabulary:  # the seen words keep almost all of their probability
            assert lm.logp(history, word) == pytest.approx(plain.logp(history, word), abs=0.05)
    with pytest.raises(ValueError, match="listed_weight"):
        WordLM.fit(corpus(10), listed=["lamp"], listed_weight=0.0)


def test_arpa_round_trip_is_exact_to_the_printed_digits(tmp_path):
    lm = WordLM.fit(corpus(200, seed=1), order=3)
    path = tmp_path / "lm.arpa"
    lm.save_arpa(path)
    back = WordLM.load_arpa(path)
    assert back.order == 3 and back.vocabulary == lm.vocabulary
    rng = random.Random(2)
    for _ in range(500):
        history = tuple(rng.choice([*WORDS, BOS, "oov"]) for _ in range(rng.randint(0, 3)))
        word = rng.choice([*WORDS, EOS, "oov"])
        assert back.logp(history, word) == pytest.approx(lm.logp(history, word), abs=1e-5)
    text = path.read_text()
    assert text.startswith("\n\\data\\\nngram 1=") and text.rstrip().endswith("\\end\\")


def test_a_broken_arpa_file_names_its_line(tmp_path):
    path = tmp_path / "bad.arpa"
    path.write_text("\\data\\\nngram 1=2\n\n\\1-grams:\n-1.0\tthe\n-1.0 a b c d\n\\end\\\n")
    with pytest.raises(ValueError, match=r"bad\.arpa:6: not an ARPA 1-gram line"):
        WordLM.load_arpa(path)
    path.write_text("just some text\n")
    with pytest.raises(ValueError, match="bad.arpa"):
        WordLM.load_arpa(path)


def _synth_folder(tmp_path, texts):
    folder = tmp_path / "data"
    folder.mkdir()
    rows = [{"audio": f"train/{i}.flac", "text": t} for i, t in enumerate(texts)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_train_word_lm_writes_lm_arpa_into_a_checkpoint_directory(capsys, tmp_path):
    texts = [" ".join(s) for s in corpus(400, seed=3) if not is_heldout(" ".join(s))]
    folder = _synth_folder(tmp_path, texts)
    (folder / "heldout.jsonl").write_text(json.dumps({"text": "the cat sat on the mat"}) + "\n")
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    code, out, _ = run_cli(capsys, "train", "word-lm", "--data", str(folder), "--out", str(checkpoint),
                           "--order", "2", "--words", "none")
    assert code == 0
    summary = json.loads(out)
    assert summary["sentences"] == len(texts) and summary["order"] == 2 and summary["heldout_perplexity"] > 1
    lm = WordLM.load_arpa(checkpoint / "lm.arpa")
    assert lm.order == 2 and lm.vocabulary == {w for t in texts for w in t.split()}


def test_train_word_lm_lists_words_beyond_the_training_texts(capsys, tmp_path):
    folder = _synth_folder(tmp_path, [t for t in ("the cat sat", "a dog ran", "the big mat") if not is_heldout(t)])
    seen = {w for line in (folder / "train.jsonl").read_text().splitlines() for w in json.loads(line)["text"].split()}
    words = tmp_path / "words.txt"
    words.write_text("# a comment line\nLamps\nsofa's, cat\n")
    code, out, _ = run_cli(capsys, "train", "word-lm", "--data", str(folder), "--out", str(tmp_path / "w.arpa"),
                           "--words", str(words), "--words-weight", "0.5")
    assert code == 0 and json.loads(out)["listed_words_added"] == 2
    assert WordLM.load_arpa(tmp_path / "w.arpa").vocabulary == seen | {"lamps", "sofa's"}
    code, out, _ = run_cli(capsys, "train", "word-lm", "--data", str(folder), "--out", str(tmp_path / "d.arpa"))
    assert code == 0 and json.loads(out)["listed_words_added"] > 30_000  # the shipped WordNet list by default
    assert {"slides", "stays"} <= WordLM.load_arpa(tmp_path / "d.arpa").vocabulary
    for flags, message in [(["--words", str(tmp_path / "nope.txt")], "no such file"),
                           (["--words-weight", "0"], "--words-weight"), (["--words-weight", "1.5"], "--words-weight")]:
        code, _, err = run_cli(capsys, "train", "word-lm", "--data", str(folder), "--out", str(tmp_path / "x.arpa"),
                               *flags)
        assert code != 0 and message in one_error_line(err)
    assert not (tmp_path / "x.arpa").exists()


def test_train_word_lm_refuses_held_out_texts_and_missing_folders(capsys, tmp_path):
    rng = random.Random(4)
    leaked = next(t for t in (" ".join(rng.choices(WORDS, k=5)) for _ in range(10_000)) if is_heldout(t))
    folder = _synth_folder(tmp_path, ["the cat sat", leaked])
    code, _, err = run_cli(capsys, "train", "word-lm", "--data", str(folder), "--out", str(tmp_path / "x.arpa"))
    assert code != 0 and "held-out split" in one_error_line(err)
    assert not (tmp_path / "x.arpa").exists()
    code, _, err = run_cli(capsys, "train", "word-lm", "--data", str(folder), "--out", str(tmp_path / "nope"))
    assert code != 0 and "no such directory" in one_error_line(err)


def test_train_word_lm_refuses_an_out_that_cannot_be_written(capsys, tmp_path):
    folder = _synth_folder(tmp_path, [t for t in ("the cat sat", "a dog ran") if not is_heldout(t)])
    afile = tmp_path / "afile"
    afile.write_text("x")
    (tmp_path / "dir.arpa").mkdir()
    for out, message in [(afile / "lm.arpa", f"--out's folder {afile} is a file, not a folder"),
                         (tmp_path / "dir.arpa", "is a folder; give a .arpa file path")]:
        code, _, err = run_cli(capsys, "train", "word-lm", "--data", str(folder), "--out", str(out), "--words", "none")
        assert code != 0 and message in one_error_line(err) and "Traceback" not in err
