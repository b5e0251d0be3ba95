"""Training and evaluation data for nested heads: one tokenizer level per head, one token stream
per head over the same documents, fixed windows, a seeded order, and the UTF-8 bytes each token
stands for (the denominator of bits per byte).

Each document is encoded with every head's level and followed by the separator (the first
special token, ``<|endoftext|>`` by default, when the level has it). Special tokens written in
the text itself are encoded as text, so a corpus cannot forge a separator.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from vocabjax.corpus import Corpus, batches
from vocabjax.errors import UserError
from vocabjax.vocab import ID_MAP, MANIFEST, NestedBPE, cut_level, load_tokenizers, minimum_vocab
from vocabjax.vocab.bpe import from_json
from vocabjax.vocab.load import bytes_to_unicode, read_manifest

IGNORE = -100  # label of a padded position: no loss, no bytes


@dataclasses.dataclass(frozen=True)
class HeadTokenizer:
    """The tokenizer level of one head and the bytes of each of its token ids."""

    vocab: int  # the head's size: every id is < vocab
    tokenizer: Tokenizer
    separator: int | None  # id appended after each document (None: documents just abut)
    token_bytes: np.ndarray  # int64 [vocab]: UTF-8 bytes an id decodes to (special tokens: 0)

    def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
        """One int32 array per text, each followed by the separator when there is one."""
        tail = [] if self.separator is None else [self.separator]
        return [
            np.asarray(e.ids + tail, dtype=np.int32)
            for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
        ]


def token_bytes(data: Mapping[str, Any], *, where: str) -> np.ndarray:
    """Bytes per token id of a byte-level BPE's tokenizer.json dict: each character of a token
    is one byte in GPT-2's byte <-> unicode table; special tokens count 0 (they are not text)."""
    to_byte = {ch: b for b, ch in enumerate(bytes_to_unicode())}
    vocab = data["model"]["vocab"]
    added = {t["content"]: t for t in data.get("added_tokens", [])}
    out = np.zeros(len(vocab), dtype=np.int64)
    for token, i in vocab.items():
        if token in added:
            out[i] = 0 if added[token].get("special") else len(token.encode("utf-8"))
        elif all(ch in to_byte for ch in token):
            out[i] = len(token)
        else:
            raise UserError(f"{where}: token {token!r} is not byte-level BPE; train needs one")
    return out


def specials_of(data: Mapping[str, Any]) -> list[str]:
    """The special tokens of a tokenizer.json dict, in id order (a level has no manifest)."""
    added = sorted(data.get("added_tokens", []), key=lambda t: t["id"])
    return [t["content"] for t in added if t.get("special")]


def head_tokenizer(data: Mapping[str, Any], specials: Sequence[str], *, where: str):
    tokenizer = from_json(data, where=where)
    tokenizer.encode_special_tokens = True  # "<|endoftext|>" in the text is text
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    sep = tokenizer.token_to_id(specials[0]) if specials else None
    return HeadTokenizer(vocab, tokenizer, sep, token_bytes(data, where=where))


def check_heads(heads: Sequence[int], largest: int, specials: Sequence[str], where: str) -> None:
    floor = minimum_vocab(specials)
    for v in heads:
        if v > largest:
            raise UserError(
                f"head {v} is larger than the tokenizer's largest level {largest} ({where}); "
                f"give heads <= {largest} or a larger tokenizer"
            )
        if v < floor:
            raise UserError(
                f"head {v} must be >= {floor} (the 256-token byte alphabet + "
                f"{len(specials)} special token(s))"
            )


def tokenizers_from_dir(directory: str | Path, heads: Sequence[int]) -> list[HeadTokenizer]:
    """Each head's level from a nested tokenizer directory (``tokenizer train``'s output) or a
    pruned one (``tokenizer prune``'s: one level); a head that is not a level is cut from the
    largest level by token id."""
    path = Path(directory)
    if not path.is_dir():
        raise UserError(f"tokenizer directory {str(path)!r} does not exist")
    if (path / ID_MAP).is_file() and (path / "tokenizer.json").is_file():
        (level,) = load_tokenizers(path)
        specials = specials_of(level.to_json())
        levels = {level.vocab: level}
    elif (path / MANIFEST).is_file():
        specials = [str(s) for s in read_manifest(path).get("specials", [])]
        levels = {t.vocab: t for t in load_tokenizers(path)}
    else:
        raise UserError(
            f"{path} holds no {MANIFEST}: give a directory written by "
            "`python cli.py tokenizer train` (or `tokenizer prune`)"
        )
    largest = max(levels)
    check_heads(heads, largest, specials, str(path))
    out = []
    for v in heads:
        data = levels[v].to_json() if v in levels else None
        if data is None:
            data = cut_level(levels[largest].to_json(), v, where=f"{path} level {largest}")
        out.append(head_tokenizer(data, specials, where=f"{path} head {v}"))
    return out


def tokenizers_from_nested(nested: NestedBPE, heads: Sequence[int]) -> list[HeadTokenizer]:
    """Each head's level of a nested BPE trained in this process."""
    check_heads(heads, nested.vocab_sizes[-1], nested.specials, "trained tokenizer")
    return [head_tokenizer(nested.level(v), nested.specials, where=f"head {v}") for v in heads]


@dataclasses.dataclass(frozen=True)
class Streams:
    """One token stream per head over the same documents."""

    ids: tuple[np.ndarray, ...]  # int32 token ids per head
    documents: int
    bytes: int  # UTF-8 bytes of the documents' text
    digest: str  # the documents' text, hashed (``text_digest``): which text it was


def encode_streams(
    heads: Sequence[HeadTokenizer],
    texts: Iterable[str],
    *,
    max_tokens: int | None = None,
    max_bytes: int | None = None,
) -> Streams:
    """Encode ``texts`` with every head. With ``max_tokens``, stop once the first (smallest)
    head has that many tokens; the last document is cut at a token boundary of the first head,
    so that every head sees exactly the same text. With ``max_bytes`` instead, stop after that
    many UTF-8 bytes of text, the last document cut at a character boundary: the same text
    whatever the tokenizer, so runs at different V are evaluated on one text."""
    if max_tokens is not None and max_bytes is not None:
        raise ValueError("give max_tokens or max_bytes, not both")
    parts: list[list[np.ndarray]] = [[] for _ in heads]
    count = docs = nbytes = 0
    digest = text_digest()
    for group in batches(texts, max_docs=256, max_chars=4 << 20):
        if max_tokens is not None:
            group, done = _fit(heads[0], group, max_tokens - count)
        elif max_bytes is not None:
            group, done = _fit_bytes(group, max_bytes - nbytes)
        else:
            done = False
        for j, head in enumerate(heads):
            parts[j] += head.encode(group)
        count += sum(len(a) for a in parts[0][len(parts[0]) - len(group) :])
        docs += len(group)
        for text in group:
            data = text.encode("utf-8")
            nbytes += len(data)
            digest.update(len(data).to_bytes(8, "little") + data)
        if done:
            break
    ids = tuple(np.concatenate(p) if p else np.zeros((0,), dtype=np.int32) for p in parts)
    return Streams(ids=ids, documents=docs, bytes=nbytes, digest=digest.hexdigest())


def text_digest():
    """The hash ``Streams.digest`` is: BLAKE2b-128 over each document's UTF-8 length (8 bytes,
    little-endian) and bytes, in order. Two runs with one digest read the same text; a builtin
    corpus made on another machine (other packages, another Python) shows a different one."""
    return hashlib.blake2b(digest_size=16)


def _fit_bytes(texts: list[str], budget: int) -> tuple[list[str], bool]:
    """The texts (the last one cut at a character boundary) whose UTF-8 bytes fit ``budget``;
    True when the budget is spent."""
    kept: list[str] = []
    for text in texts:
        data = text.encode("utf-8")
        if len(data) < budget:
            kept.append(text)
            budget -= len(data)
            continue
        cut = data[:budget].decode("utf-8", errors="ignore")
        if cut:
            kept.append(cut)
        return kept, True
    return kept, False


def _fit(head: HeadTokenizer, texts: list[str], budget: int) -> tuple[list[str], bool]:
    """The texts (the last one cut) whose tokens in ``head`` fit ``budget``; True when cut."""
    kept: list[str] = []
    encoded = head.tokenizer.encode_batch(texts, add_special_tokens=False)
    for text, enc in zip(texts, encoded, strict=True):
        need = len(enc.ids) + (head.separator is not None)
        if need <= budget:
            kept.append(text)
            budget -= need
            continue
        take = budget - (head.separator is not None)
        if take > 0:
            kept.append(text[: enc.offsets[take - 1][1]])
        return kept, True
    return kept, budget <= 0


@dataclasses.dataclass(frozen=True)
class Windows:
    """A head's training stream cut into non-overlapping windows of T + 1 tokens; each epoch
    visits them in a fresh permutation drawn from (seed, head index, epoch)."""

    windows: np.ndarray  # int32 [n, T + 1]
    seed: int
    head_index: int

    @classmethod
    def cut(cls, ids: np.ndarray, seq_len: int, *, seed: int, head_index: int) -> Windows:
        n = len(ids) // (seq_len + 1)
        return cls(ids[: n * (seq_len + 1)].reshape(n, seq_len + 1), seed, head_index)

    @property
    def count(self) -> int:
        return self.windows.shape[0]

    def order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, self.head_index, epoch]).permutation(self.count)

    def batch(self, step: int, size: int) -> np.ndarray:
        """The ``size`` windows of step ``step`` (0-based): a pure function of (seed, step)."""
        g = np.arange(step * size, (step + 1) * size)
        epochs, pos = np.divmod(g, self.count)
        picks = np.empty(size, dtype=np.int64)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            picks[sel] = self.order(int(epoch))[pos[sel]]
        return self.windows[picks]


def eval_windows(ids: np.ndarray, seq_len: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, labels), each [n, batch, T]: windows of T predictions with stride T, so every
    token after the first is predicted once, from at most T tokens of context in its window.
    The last window and the last batch are padded (labels ``IGNORE``)."""
    n_pred = len(ids) - 1
    if n_pred < 1:
        raise UserError("the held-out stream has fewer than 2 tokens")
    n_win = -(-n_pred // seq_len)
    n_win += -n_win % batch
    inputs = np.zeros((n_win, seq_len), dtype=np.int32)
    labels = np.full((n_win, seq_len), IGNORE, dtype=np.int32)
    for w in range(n_win):
        start = w * seq_len
        chunk = ids[start : start + seq_len + 1]
        if len(chunk) < 2:
            break
        inputs[w, : len(chunk) - 1] = chunk[:-1]
        labels[w, : len(chunk) - 1] = chunk[1:]
    shape = (n_win // batch, batch, seq_len)
    return inputs.reshape(shape), labels.reshape(shape)


def check_sizes(
    heads: Sequence[HeadTokenizer], windows: Sequence[Windows], heldout: Streams, batch: int
) -> None:
    """A corpus too small for one batch of every head, or for one held-out prediction, fails."""
    for head, w in zip(heads, windows, strict=True):
        if w.count < batch:
            need = batch * (w.windows.shape[1])
            raise UserError(
                f"the corpus's train part gives head {head.vocab} only {w.count} window(s) of "
                f"{w.windows.shape[1]} tokens; one batch needs {batch} ({need} tokens): give more "
                "text, or a smaller {batch} or {seq_len}",
                settings=["batch", "seq_len"],
            )
    for head, ids in zip(heads, heldout.ids, strict=True):
        if len(ids) < 2:
            raise UserError(
                f"the corpus's held-out part gives head {head.vocab} {len(ids)} token(s); "
                "bits per byte needs at least 2: give more text or a larger held-out fraction"
            )


STREAMS_KEPT = 8  # encoded streams a process keeps: a study trains many runs on one corpus
_streams: collections.OrderedDict[tuple, Streams] = collections.OrderedDict()


def corpus_state(corpus: Corpus) -> tuple | None:
    """What a corpus's documents depend on: its settings and each file's path, size and
    modification time (a builtin corpus's other sources are the running interpreter's); None
    when a file cannot be looked at (reading it will say why)."""
    files = []
    try:
        for path in corpus.files():
            st = path.stat()
            files.append((str(path), st.st_size, st.st_mtime_ns))
    except OSError:
        return None
    return corpus, tuple(files)


def head_state(head: HeadTokenizer) -> tuple:
    """What a head's encoding depends on: its tokenizer, whole, and its separator."""
    digest = hashlib.blake2b(head.tokenizer.to_str().encode("utf-8"), digest_size=16).digest()
    return head.vocab, head.separator, digest


def corpus_streams(
    corpus: Corpus,
    heads: Sequence[HeadTokenizer],
    split: str,
    *,
    max_tokens: int | None = None,
    max_bytes: int | None = None,
) -> Streams:
    """``encode_streams`` of a corpus split, kept for the process: a later run on the same
    files with the same tokenizers (another seed, another model) reads the kept streams, read
    only, instead of reading and encoding the corpus again. The ``STREAMS_KEPT`` last used
    are kept."""
    limits = {"max_tokens": max_tokens, "max_bytes": max_bytes}
    state = corpus_state(corpus)
    if state is None:
        return encode_streams(heads, corpus.texts(split), **limits)
    key = (state, tuple(head_state(h) for h in heads), split, max_tokens, max_bytes)
    if key in _streams:
        _streams.move_to_end(key)
        return _streams[key]
    streams = encode_streams(heads, corpus.texts(split), **limits)
    for ids in streams.ids:
        ids.flags.writeable = False
    _streams[key] = streams
    while len(_streams) > STREAMS_KEPT:
        _streams.popitem(last=False)
    return streams


def load_data(
    corpus: Corpus,
    heads: Sequence[HeadTokenizer],
    *,
    seq_len: int,
    batch: int,
    seed: int,
    eval_tokens: int,
    eval_bytes: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[Windows], Streams, Streams]:
    """(training windows per head, the train streams, the held-out streams), checked. The
    held-out streams are the first ``eval_tokens`` tokens of the smallest head, or with
    ``eval_bytes`` the first that many bytes of text."""
    train = corpus_streams(corpus, heads, "train")
    windows = [
        Windows.cut(ids, seq_len, seed=seed, head_index=j) for j, ids in enumerate(train.ids)
    ]
    tokens = eval_tokens if eval_bytes is None else None
    heldout = corpus_streams(corpus, heads, "heldout", max_tokens=tokens, max_bytes=eval_bytes)
    if progress:
        progress(
            f"train part: {train.documents} documents, {train.bytes / 2**20:.2f} MiB; held-out "
            f"(evaluated): {heldout.documents} documents, {heldout.bytes / 2**10:.1f} KiB"
        )
        for head, ids, w, ev in zip(heads, train.ids, windows, heldout.ids, strict=True):
            progress(
                f"  head {head.vocab}: {len(ids)} train tokens "
                f"({train.bytes / max(len(ids), 1):.2f} bytes/token), {w.count} windows; "
                f"{len(ev)} held-out tokens"
            )
    check_sizes(heads, windows, heldout, batch)
    return windows, train, heldout
