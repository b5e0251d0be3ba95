"""Byte-level BPE as HF ``tokenizers`` stores it: the tokenizer.json dict, its merges, cutting a
level by token id, and writing a level in the layout HF tokenizers and transformers load.

Shared by nested training (cut a level from the largest) and pruning (keep a closed subset).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from vocabjax.errors import UserError
from vocabjax.outputs import atomic_write_text

BYTE_ALPHABET = 256  # the byte-level alphabet: one token per byte value
DEFAULT_SPECIALS: tuple[str, ...] = ("<|endoftext|>",)


def byte_alphabet() -> list[str]:
    """The 256 printable stand-ins ByteLevel uses for the byte values (GPT-2's table)."""
    return sorted(pre_tokenizers.ByteLevel.alphabet())


def empty_byte_level() -> Tokenizer:
    """An untrained byte-level BPE with the pre-tokenizer and decoder vocabjax always uses."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def to_json(tokenizer: Tokenizer) -> dict[str, Any]:
    return json.loads(tokenizer.to_str())


def from_json(data: Mapping[str, Any], *, where: str) -> Tokenizer:
    """Build a Tokenizer from its JSON dict; a malformed one is a UserError naming ``where``."""
    try:
        return Tokenizer.from_str(json.dumps(data, ensure_ascii=False))
    except Exception as exc:  # tokenizers raises a plain Exception for a bad file
        raise UserError(f"{where}: HF tokenizers cannot load it ({_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def bpe_model(data: Mapping[str, Any], *, where: str) -> Mapping[str, Any]:
    """The ``model`` of a tokenizer.json, checked to be a plain BPE vocabjax can cut or prune."""
    model = data.get("model") if isinstance(data, Mapping) else None
    if not isinstance(model, Mapping) or model.get("type") != "BPE":
        kind = model.get("type") if isinstance(model, Mapping) else None
        raise UserError(f"{where}: needs a BPE tokenizer, found model type {kind!r}")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise UserError(f"{where}: BPE with subword prefixes or suffixes is not supported")
    return model


def merges(model: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Merges as pairs, whether stored as ``["a", "b"]`` (tokenizers >= 0.20) or ``"a b"``."""
    out = []
    for m in model.get("merges", []):
        if isinstance(m, str):
            a, _, b = m.partition(" ")
        else:
            a, b = m
        out.append((a, b))
    return out


def id_to_token(model: Mapping[str, Any]) -> list[str]:
    """Tokens by id; ids must be 0..n-1 with no gaps (true of every tokenizer vocabjax writes)."""
    vocab = model["vocab"]
    tokens = [""] * len(vocab)
    for token, i in vocab.items():
        if not 0 <= i < len(vocab) or tokens[i]:
            raise UserError("the BPE vocabulary's ids are not 0..n-1 without gaps")
        tokens[i] = token
    return tokens


def with_vocab(
    data: Mapping[str, Any], tokens: Sequence[str], kept_merges: Sequence[tuple[str, str]]
) -> dict[str, Any]:
    """A copy of tokenizer JSON ``data`` with vocabulary ``tokens`` (id = position) and
    ``kept_merges``; added (special) tokens are kept and re-numbered where they are in
    ``tokens``, dropped otherwise."""
    out = copy.deepcopy(dict(data))
    new_ids = {t: i for i, t in enumerate(tokens)}
    out["model"]["vocab"] = new_ids
    out["model"]["merges"] = [[a, b] for a, b in kept_merges]
    added = []
    for tok in data.get("added_tokens", []):
        if tok["content"] in new_ids:
            added.append({**tok, "id": new_ids[tok["content"]]})
    out["added_tokens"] = added
    return out


def cut_level(data: Mapping[str, Any], vocab: int, *, where: str = "tokenizer") -> dict[str, Any]:
    """The level of size ``vocab`` of a trained BPE: its first ``vocab`` token ids and the
    longest prefix of its merges that stays inside them.

    The trainer appends one token per merge, so the merges that build ids below ``vocab`` are a
    prefix of the list: the result equals training at ``vocab`` on the same data.
    """
    model = bpe_model(data, where=where)
    tokens = id_to_token(model)
    if vocab > len(tokens):
        raise UserError(f"{where}: cannot cut {vocab=} from a vocabulary of {len(tokens)}")
    ids = model["vocab"]
    kept: list[tuple[str, str]] = []
    duplicate: list[bool] = []  # the merge makes a token an earlier merge already made
    made: set[str] = set()
    for a, b in merges(model):
        if max(ids.get(a, vocab), ids.get(b, vocab), ids.get(a + b, vocab)) >= vocab:
            break
        kept.append((a, b))
        duplicate.append(a + b in made)
        made.add(a + b)
    # Training at ``vocab`` stops right after the merge that makes its last token: trailing
    # merges that add no token are not part of that level.
    while duplicate and duplicate[-1]:
        duplicate.pop()
        kept.pop()
    return with_vocab(data, tokens[:vocab], kept)


TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "clean_up_tokenization_spaces": False,
    "model_max_length": 1_000_000_000_000_000_019_884_624_838_656,  # transformers' "no limit"
}


def write_level(directory: Path, data: Mapping[str, Any], *, where: str) -> Tokenizer:
    """Write ``tokenizer.json`` (and a ``tokenizer_config.json`` so that transformers'
    ``AutoTokenizer.from_pretrained(directory)`` works) after checking that it loads."""
    tokenizer = from_json(data, where=where)
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write_text(directory / "tokenizer.json", json.dumps(data, ensure_ascii=False))
    config = dict(TOKENIZER_CONFIG)
    specials = [t["content"] for t in data.get("added_tokens", []) if t.get("special")]
    if specials:
        config["eos_token"] = specials[0]
        config["bos_token"] = specials[0]
    atomic_write_text(directory / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
    return tokenizer
