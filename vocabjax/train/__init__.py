"""Measure training: train a GPT with nested vocabulary heads, then measure each head's held-out
bits per byte and training tokens/s into a training profile (``training.json``).

    config.py      RunConfig / CorpusSpec: what run.json holds
    data.py        per-head tokenizer levels, token streams, windows, bytes per token
    steps.py       parameters as named arrays, AdamW + warm-up/cosine, the jitted steps
    checkpoint.py  atomic checkpoints (state.npz + meta.json)
    evaluate.py    held-out bits per byte and per-head throughput
    pruned.py      a run started from a larger-V run through a pruned tokenizer's id map
    mesh.py        data-parallel and V-sharded training on a (data, model) device mesh
    run.py         the run: fresh or resumed, progress, checkpoints, training.json
"""

from vocabjax.train.checkpoint import (
    Checkpoint,
    load_checkpoint,
    restore_params,
    save_checkpoint,
)
from vocabjax.train.config import RUN_FILE, TOKENIZER_DIR, CorpusSpec, RunConfig, read_run
from vocabjax.train.data import (
    IGNORE,
    HeadTokenizer,
    Windows,
    encode_streams,
    eval_windows,
    token_bytes,
    tokenizers_from_dir,
    tokenizers_from_nested,
)
from vocabjax.train.evaluate import HeldOut, heldout_bpb, throughput
from vocabjax.train.mesh import MeshSpec, Placement
from vocabjax.train.run import (
    TRAINING_FILE,
    HeadResult,
    TrainResult,
    device_label,
    resume_config,
    train,
)
from vocabjax.train.steps import Functional, init_params, make_train_step, optimizer

__all__ = [
    "IGNORE",
    "RUN_FILE",
    "TOKENIZER_DIR",
    "TRAINING_FILE",
    "Checkpoint",
    "CorpusSpec",
    "Functional",
    "HeadResult",
    "HeadTokenizer",
    "HeldOut",
    "MeshSpec",
    "Placement",
    "RunConfig",
    "TrainResult",
    "Windows",
    "device_label",
    "encode_streams",
    "eval_windows",
    "heldout_bpb",
    "init_params",
    "load_checkpoint",
    "make_train_step",
    "optimizer",
    "read_run",
    "restore_params",
    "resume_config",
    "save_checkpoint",
    "throughput",
    "token_bytes",
    "tokenizers_from_dir",
    "tokenizers_from_nested",
    "train",
]
