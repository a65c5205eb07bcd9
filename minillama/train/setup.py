"""Setting up a training run: its token data, the model (fresh from the seed or from
``--init-from``) and its optimizer, and the checks that every rank of a data-parallel run holds
the same of each."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from minillama.backends import get_backend, with_precision
from minillama.core.config import ModelConfig
from minillama.core.errors import MinillamaError
from minillama.io.checkpoint import CKPT_NAME
from minillama.io.data import TokenData, prepare_data
from minillama.io.load import load_params
from minillama.model.transformer import Transformer
from minillama.train.config import MODEL_FIELDS, TrainConfig
from minillama.train.distributed import Communicator
from minillama.train.optim import AdamW


def open_data(tc: TrainConfig, comm: Communicator, out: Path, cfg: ModelConfig,
              data_dir=None) -> TokenData:
    """The token files: ``data_dir`` if given, else ``tc.data`` prepared under ``out/data``
    (by rank 0 alone; the others open what it wrote)."""
    if data_dir is not None:
        folder = Path(data_dir)
    else:
        folder = comm.agree(lambda: prepare_data(tc.data, out / "data"), root_only=True)
    return comm.agree(lambda: TokenData(folder, tc.context, seed=tc.seed,
                                        vocab_size=cfg.vocab_size))


def check_share_of_data(tc: TrainConfig, comm: Communicator, data: TokenData) -> None:
    """Several ranks need at least as many distinct training windows as one step uses."""
    N, A, B, T = comm.size, tc.grad_accum, tc.batch_size, tc.context
    windows = data.train.size - T
    if N > 1 and N * A * B > windows:
        raise MinillamaError(
            f"{N} ranks x --grad-accum {A} x --batch-size {B} = {N * A * B} windows per step, "
            f"but the training split has only {windows} windows of {T} + 1 tokens: launch "
            f"fewer ranks or use a smaller batch")


def build_model(tc: TrainConfig, cfg: ModelConfig, out: Path) -> Transformer:
    """A freshly initialised model (weights from ``tc.seed``), or, with ``tc.init_from`` and
    no checkpoint in ``out/`` yet, one that starts from that checkpoint's weights (its model
    must be the one this run asks for)."""
    params = None
    if tc.init_from and not (out / CKPT_NAME).is_file():
        _, theirs_cfg, params, _ = load_params(tc.init_from)
        mine, theirs = cfg.to_dict(), theirs_cfg.to_dict()
        diff = [k for k in MODEL_FIELDS + ("vocab_size",) if mine[k] != theirs[k]]
        if diff:
            raise MinillamaError(f"--init-from: {tc.init_from} has {diff[0]}="
                                 f"{theirs[diff[0]]!r}, this run asks for {mine[diff[0]]!r}")
    backend = with_precision(get_backend(tc.backend), tc.precision)
    model = Transformer(cfg, params, backend=backend, dtype=np.dtype(tc.dtype), seed=tc.seed)
    model.recompute = bool(tc.recompute)
    return model


def build_optimizer(tc: TrainConfig, model: Transformer) -> AdamW:
    return AdamW(model.params, lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.eps,
                 weight_decay=tc.weight_decay, decay_embeddings=tc.decay_embeddings,
                 backend=model.backend)


def check_weights_agree(comm: Communicator, model: Transformer) -> None:
    """Every rank must hold bit-identical weights (same seed or checkpoint, same updates)."""
    if comm.size > 1:
        h = hashlib.sha1()
        for k in sorted(model.params):
            h.update(np.ascontiguousarray(model.backend.to_numpy(model.params[k])).tobytes())
        comm.agree_on("the model weights (SHA-1 of every parameter)", {"weights": h.hexdigest()})
