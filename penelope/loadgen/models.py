"""Checkpoints for real-server runs on CPU, written on demand: `tiny` (the tests' tiny Qwen3,
`penelope.integration.sglang.verify.tiny_model`) and `scale:S` (the scale model of Qwen3-8B,
`penelope.engine.scale_model`), each with a word-level tokenizer of its vocabulary beside it
(SGLang loads a tokenizer at start-up; the load generator sends and reads ids, never text).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from penelope.errors import UsageError

TINY, SCALE = "tiny", "scale:"


def word_level_tokenizer(folder: Path, vocab: int) -> None:
    """A tokenizer with one word per id (`t0` ... `t{vocab-1}`) saved into `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", eos_token="t1").save_pretrained(folder)


def is_generated(model: str) -> bool:
    return model == TINY or model.startswith(SCALE)


def model_scale(model: str) -> float:
    """S of `scale:S`; UsageError unless a number in [1, 256]."""
    text = model[len(SCALE):]
    try:
        scale = float(text)
    except ValueError:
        raise UsageError(f"`model` {model}: expected scale:S with S a number (the scale of Qwen3-8B)") from None
    if not (math.isfinite(scale) and 1 <= scale <= 256):
        raise UsageError(f"`model` {model}: the scale must be in [1, 256]")
    return scale


def prepare_model(model: str, folder: Path) -> Path:
    """The checkpoint folder for `model`: `tiny` and `scale:S` are written into `folder` (with a
    tokenizer), anything else is returned as given (a folder or a hub id)."""
    if model == TINY:
        from penelope.integration.sglang.verify import tiny_model

        path = tiny_model(folder)
    elif model.startswith(SCALE):
        from penelope.engine.scale_model import save_scale_model

        path = save_scale_model(folder, model_scale(model))
    else:
        return Path(model)
    word_level_tokenizer(path, vocab_size(path))
    return path


def vocab_size(folder: Path) -> int:
    return int(json.loads((Path(folder) / "config.json").read_text())["vocab_size"])


def config_value(model: str, key: str) -> int | None:
    """An integer setting (`max_position_embeddings`, `vocab_size`) of a checkpoint folder's
    config.json, None when the folder or the setting is not readable here (a hub id)."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get(key) if isinstance(config, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else None


def check_model(model: str, vocab: int | None) -> int | None:
    """Before any server starts: a checkpoint given as a path (one that exists here, or starts with
    `/`, `.` or `~`) must be a folder with a config.json, and the vocabulary must be known (`vocab`,
    else the checkpoint's `vocab_size`: without it the load generator cannot draw ids the server
    takes) and no larger than the checkpoint's (ids at or above it crash SGLang's scheduler on CPU).
    Returns the checkpoint's vocabulary size (None: not readable here, a hub id). Not for `tiny` and
    `scale:S`, written later."""
    from penelope.loadgen.target import vocab_of

    path = Path(model).expanduser()
    if path.exists() or model.startswith(("/", ".", "~")):
        if not path.is_dir():
            raise UsageError(f"`model` {model}: " + ("a file, not a checkpoint folder" if path.exists() else
                                                     "no such checkpoint folder"))
        if not (path / "config.json").is_file():
            raise UsageError(f"`model` {model}: no config.json in this folder (not a checkpoint)")
    size = vocab_of(model)
    check_vocab(model, vocab, size)
    return size


def check_vocab(model: str, vocab: int | None, size: int | None) -> None:
    """`vocab` (None: not given) against the checkpoint's vocabulary `size` (None: not readable)."""
    if vocab is None and size is None:
        raise UsageError(f"`model` {model}: its vocabulary size is not readable here (no config.json with "
                         "vocab_size, e.g. a hub id); give `vocab` N (ids at or above it crash the server)")
    if vocab is not None and size is not None and vocab > size:
        raise UsageError(f"`vocab` {vocab} is larger than the vocabulary of `model` {model} ({size:,}): ids at "
                         "or above it crash the server")
