"""A word n-gram language model for the CTC beam search, estimated from training texts and kept as ARPA.

Why: a 3M-parameter acoustic model half-hears many words ("the sheaf of the cliff"); which word sequences
are English is knowledge it has no room for. A word n-gram of the texts it was trained on supplies it at
decoding time for a few kilobytes per thousand words, and reweighing the beam with it changes nothing in
the model or the streaming encoder.

The estimate is interpolated Kneser-Ney (one discount per order, D = n1 / (n1 + 2 n2)), the smoothing
KenLM's `lmplz` and SRILM use by default; `lmplz` itself is a C++ build tool, not a pip package, and the
model is small, so it is estimated here. It is written and read as an ARPA file (the interpolated
probability of every seen n-gram plus a back-off weight per history), the standard text format that
KenLM and every decoder read, so the model can be inspected or swapped for one built elsewhere.
Probabilities are natural logs in memory and log10 on disk, as ARPA prescribes.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
LN10 = math.log(10.0)
ARPA_FLOOR = -99.0  # log10 probability ARPA uses for "never predicted" (<s>)


class WordLM:
    """P(word | previous order-1 words) with back-off; `logp` is a natural log."""

    def __init__(self, order: int, logprob: dict[tuple[str, ...], float], backoff: dict[tuple[str, ...], float]):
        if order < 1:
            raise ValueError(f"n-gram order must be at least 1, got {order}")
        self.order = order
        self._logprob = logprob
        self._backoff = backoff
        self.vocabulary = frozenset(g[0] for g in logprob if len(g) == 1) - {BOS, EOS, UNK}
        self.unk_logp = logprob.get((UNK,), min(p for g, p in logprob.items() if len(g) == 1 and p > -50))

    def logp(self, history: tuple[str, ...], word: str) -> float:
        """ln P(word | history): the longest seen n-gram, plus the back-off weights of the histories skipped."""
        h = history[len(history) - self.order + 1 :] if self.order > 1 else ()
        return _query(self._logprob, self._backoff, h, word, self.unk_logp)

    def sentence_logp(self, words: Iterable[str]) -> float:
        """ln P of a whole sentence, </s> included (what the beam search accumulates word by word)."""
        history: tuple[str, ...] = (BOS,)
        total = 0.0
        for word in (*words, EOS):
            total += self.logp(history, word)
            history = history + (word,)
        return total

    # -- estimation ---------------------------------------------------------------------------------------
    @classmethod
    def fit(cls, sentences: Iterable[list[str]], order: int = 3, listed: Iterable[str] = (),
            listed_weight: float = 1.0) -> WordLM:
        """Interpolated Kneser-Ney over sentences (lists of words); lower orders use continuation counts.

        `listed` words join the vocabulary without being seen: the unigram level's uniform floor becomes a
        weighted one, in which a seen word (and <unk>) weighs 1 and a listed word `listed_weight`, so a listed
        word gets that share of the floor's mass, the beam can write it without the out-of-vocabulary penalty,
        and every history's distribution still sums to one.
        """
        if order < 1:
            raise ValueError(f"n-gram order must be at least 1, got {order}")
        if not 0.0 < listed_weight <= 1.0:
            raise ValueError(f"listed_weight must be in (0, 1], got {listed_weight}")
        raw: list[Counter[tuple[str, ...]]] = [Counter() for _ in range(order + 1)]
        for words in sentences:
            tokens = (BOS, *words, EOS)
            for n in range(1, order + 1):
                for i in range(len(tokens) - n + 1):
                    raw[n][tokens[i : i + n]] += 1
        if not raw[1]:
            raise ValueError("no sentences to estimate a language model from")
        counts: list[Counter[tuple[str, ...]]] = [Counter() for _ in range(order + 1)]
        counts[order] = raw[order]
        for n in range(order - 1, 0, -1):  # Kneser-Ney: how many distinct words precede g, not how often g occurs
            for gram in raw[n + 1]:
                counts[n][gram[1:]] += 1
            for gram, c in raw[n].items():
                if gram[0] == BOS:  # nothing can precede <s>: its n-grams keep their raw counts
                    counts[n][gram] = c
        del counts[1][(BOS,)]  # <s> is given, never predicted
        logprob: dict[tuple[str, ...], float] = {}
        backoff: dict[tuple[str, ...], float] = {}
        vocab = {g[0] for g in counts[1]} | {UNK}
        unseen = set(listed) - vocab - {BOS, EOS}
        floor_mass = len(vocab) + listed_weight * len(unseen)  # the weighted floor's normaliser
        for n in range(1, order + 1):
            discount = _discount(counts[n])
            total: dict[tuple[str, ...], int] = defaultdict(int)
            types: dict[tuple[str, ...], int] = defaultdict(int)
            for gram, c in counts[n].items():
                total[gram[:-1]] += c
                types[gram[:-1]] += 1
            for gram, c in counts[n].items():
                history, word = gram[:-1], gram[-1]
                gamma = discount * types[history] / total[history]
                lower = 1.0 / floor_mass if n == 1 else math.exp(_query(logprob, backoff, history[1:], word, 0.0))
                logprob[gram] = math.log((c - discount) / total[history] + gamma * lower)
            if n == 1:
                gamma = discount * types[()] / total[()]
                logprob[(UNK,)] = math.log(gamma / floor_mass)
                for word in unseen:
                    logprob[(word,)] = math.log(gamma * listed_weight / floor_mass)
            else:
                for history in total:
                    backoff[history] = math.log(discount * types[history] / total[history])
        logprob[(BOS,)] = ARPA_FLOOR * LN10
        return cls(order, logprob, backoff)

    # -- ARPA ---------------------------------------------------------------------------------------------
    def save_arpa(self, path: Path) -> None:
        by_order: list[list[tuple[str, ...]]] = [[] for _ in range(self.order + 1)]
        for gram in self._logprob:
            by_order[len(gram)].append(gram)
        for n in range(1, self.order):  # a history with a back-off weight must be listed to carry it
            by_order[n] += [h for h in self._backoff if len(h) == n and h not in self._logprob]
        lines = ["", "\\data\\"] + [f"ngram {n}={len(by_order[n])}" for n in range(1, self.order + 1)]
        for n in range(1, self.order + 1):
            lines += ["", f"\\{n}-grams:"]
            for gram in sorted(by_order[n]):
                p = self._logprob.get(gram, ARPA_FLOOR * LN10) / LN10
                line = f"{p:.6f}\t{' '.join(gram)}"
                if gram in self._backoff:
                    line += f"\t{self._backoff[gram] / LN10:.6f}"
                lines.append(line)
        lines += ["", "\\end\\", ""]
        Path(path).write_text("\n".join(lines))

    @classmethod
    def load_arpa(cls, path: Path) -> WordLM:
        """Read an ARPA file (ours or any tool's); a clear ValueError names the line that breaks the format."""
        logprob: dict[tuple[str, ...], float] = {}
        backoff: dict[tuple[str, ...], float] = {}
        order = 0
        section = 0
        with open(path, encoding="utf-8") as lines:
            for number, raw_line in enumerate(lines, 1):
                line = raw_line.strip()
                if not line or line.startswith("ngram ") or line == "\\data\\":
                    continue
                if line == "\\end\\":
                    break
                if line.startswith("\\") and line.endswith("-grams:"):
                    section = int(line[1:].split("-", 1)[0])
                    order = max(order, section)
                    continue
                fields = line.split()
                if section == 0 or len(fields) not in (section + 1, section + 2):
                    raise ValueError(f"{path}:{number}: not an ARPA {section}-gram line: {line[:80]!r}")
                gram = tuple(fields[1 : section + 1])
                logprob[gram] = float(fields[0]) * LN10
                if len(fields) == section + 2:
                    backoff[gram] = float(fields[-1]) * LN10
        if not order:
            raise ValueError(f"{path}: no n-gram sections; is this an ARPA file?")
        return cls(order, logprob, backoff)


def _discount(counts: Counter[tuple[str, ...]]) -> float:
    """The Kneser-Ney discount D = n1 / (n1 + 2 n2) from the counts of counts, kept inside (0.1, 0.9)."""
    of = Counter(counts.values())
    n1, n2 = of.get(1, 0), of.get(2, 0)
    return min(0.9, max(0.1, n1 / (n1 + 2 * n2))) if n1 + n2 else 0.5


def _query(logprob: dict[tuple[str, ...], float], backoff: dict[tuple[str, ...], float],
           history: tuple[str, ...], word: str, unk_logp: float) -> float:
    """ARPA back-off: the longest seen n-gram ending in `word`, plus the weights of the histories dropped."""
    penalty = 0.0
    while True:
        found = logprob.get(history + (word,))
        if found is not None:
            return penalty + found
        if not history:
            return penalty + unk_logp
        penalty += backoff.get(history, 0.0)
        history = history[1:]
