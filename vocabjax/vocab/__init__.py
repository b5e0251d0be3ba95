"""Tokenizers: nested byte-level BPE training, compression measurement, pruning, loading.

nested = train_nested(corpus.texts("train"), [8192, 32768])   # one training, two levels
save_nested(nested, "tok/", corpus=corpus.describe("train"))
points = measure(load_tokenizers("tok/"), corpus.texts("heldout"))
profile = compression_profile(points, corpus=corpus.describe("heldout"), source="...")
"""

from vocabjax.vocab.bpe import BYTE_ALPHABET, DEFAULT_SPECIALS, cut_level
from vocabjax.vocab.load import (
    LoadedTokenizer,
    cut_ranks,
    load_largest,
    load_tokenizer,
    load_tokenizers,
    read_manifest,
)
from vocabjax.vocab.measure import (
    CompressionPoint,
    compression_profile,
    curve_notes,
    measure,
    ratio_ci95,
)
from vocabjax.vocab.nested import (
    MANIFEST,
    NestedBPE,
    check_nested_out,
    check_vocab_sizes,
    minimum_vocab,
    save_nested,
    train_nested,
)
from vocabjax.vocab.prune import (
    ID_MAP,
    IdMap,
    Pruned,
    check_prune_out,
    count_usage,
    prune,
    prune_texts,
    prune_to_dir,
    read_id_map,
    write_pruned,
)

__all__ = [
    "BYTE_ALPHABET",
    "DEFAULT_SPECIALS",
    "ID_MAP",
    "IdMap",
    "MANIFEST",
    "CompressionPoint",
    "LoadedTokenizer",
    "NestedBPE",
    "Pruned",
    "check_nested_out",
    "check_prune_out",
    "check_vocab_sizes",
    "compression_profile",
    "cut_ranks",
    "count_usage",
    "curve_notes",
    "cut_level",
    "load_largest",
    "load_tokenizer",
    "load_tokenizers",
    "measure",
    "minimum_vocab",
    "prune",
    "prune_texts",
    "prune_to_dir",
    "ratio_ci95",
    "read_id_map",
    "read_manifest",
    "save_nested",
    "train_nested",
    "write_pruned",
]
