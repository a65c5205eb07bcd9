"""The checks and position tables of a forward's inputs, a mixin of
:class:`~minillama.model.transformer.Transformer`: token and target arrays, positions in the context
and the RoPE rows at them. It reads ``self.cfg``, ``self.backend``, ``self.dtype`` and the RoPE
tables ``self.cos``, ``self.sin`` that the model sets up."""

from __future__ import annotations

import numpy as np

from minillama.core.errors import MinillamaError
from minillama.core.ops import rope_tables
from minillama.model import packing


class ModelInputs:
    """Input checks and positions for :class:`~minillama.model.transformer.Transformer`."""

    def _tokens(self, tokens):
        """``tokens`` as a checked (B, T) NumPy integer array with ids in [0, V)."""
        tok = np.asarray(self.backend.to_numpy(tokens) if not isinstance(tokens, (list, tuple))
                         else tokens)
        if tok.ndim == 1:
            tok = tok[None, :]
        if tok.ndim != 2 or tok.shape[1] == 0:
            raise MinillamaError(f"tokens must be a non-empty (B, T) integer array, got shape "
                                 f"{tok.shape}")
        if not np.issubdtype(tok.dtype, np.integer):
            raise MinillamaError(f"tokens must be integers, got dtype {tok.dtype}")
        if tok.size and (tok.min() < 0 or tok.max() >= self.cfg.vocab_size):
            raise MinillamaError(
                f"token ids must lie in [0, {self.cfg.vocab_size}), got min {tok.min()} "
                f"max {tok.max()}")
        return tok

    def _targets(self, targets, shape):
        """``targets`` as a (B, T) NumPy array shaped like the tokens."""
        tgt = np.asarray(self.backend.to_numpy(targets) if not isinstance(targets, (list, tuple))
                         else targets)
        if tgt.ndim == 1:
            tgt = tgt[None, :]
        if tgt.shape != shape:
            raise MinillamaError(f"targets shape {tgt.shape} != tokens shape {shape}")
        return tgt

    def _rope_table(self, end: int):
        """The (cos, sin) tables for a forward whose furthest position is end - 1: the fixed ones,
        or for a ``dynamic`` RoPE scaling past its original length, ones rebuilt for ``end``
        positions (as transformers does for the longest position of the batch)."""
        sc = self.cfg.rope_scaling
        if not sc or sc["rope_type"] != "dynamic" or end <= sc["original_max_position_embeddings"]:
            return self.cos, self.sin
        return rope_tables(self.cfg.head_dim, end, self.cfg.rope_theta, self.dtype,
                           self.backend.xp, sc, seq_len=end)

    def _positions(self, start_pos, T: int):
        """Positions start_pos .. start_pos + T - 1, checked against the context: a slice (one
        start for the batch) or a (B, T) index array (one start per sequence; for packed rows,
        restarting per example: :mod:`minillama.model.packing`)."""
        if self.segments is not None:
            return packing.positions(self)
        if np.ndim(start_pos) == 0:
            s = int(start_pos)
            if s < 0 or s + T > self.cfg.max_seq_len:
                raise MinillamaError(f"positions {s}..{s + T - 1} exceed the model context of "
                                     f"{self.cfg.max_seq_len}")
            return slice(s, s + T)
        starts = np.asarray(start_pos, dtype=np.int64).reshape(-1)
        if starts.min() < 0 or starts.max() + T > self.cfg.max_seq_len:
            raise MinillamaError(
                f"positions up to {starts.max() + T - 1} exceed the model context of "
                f"{self.cfg.max_seq_len}")
        return self.backend.asarray(starts[:, None] + np.arange(T)[None, :])

    def _rope_at(self, start_pos, T: int):
        """cos/sin gathered at positions start_pos .. start_pos + T - 1: (T, hd/2) or (B, T, hd/2);
        (None, None) when the model has no RoPE (the positions are checked all the same).
        Packed rows take the rows of their restarting positions (:mod:`minillama.model.packing`)."""
        if self.segments is not None:
            return packing.rope_rows(self, T)
        if self.cfg.pos_encoding != "rope":
            self._positions(start_pos, T)
            return None, None
        if np.ndim(start_pos) == 0:
            s = int(start_pos)
            end = s + T
            if s < 0 or end > self.cfg.max_seq_len:
                raise MinillamaError(
                    f"positions {s}..{end - 1} exceed the model context of {self.cfg.max_seq_len}")
            cos, sin = self._rope_table(end)
            return cos[s:end], sin[s:end]
        starts = np.asarray(start_pos, dtype=np.int64).reshape(-1)
        if starts.min() < 0 or starts.max() + T > self.cfg.max_seq_len:
            raise MinillamaError(
                f"positions up to {starts.max() + T - 1} exceed the model context of "
                f"{self.cfg.max_seq_len}")
        cos, sin = self._rope_table(int(starts.max()) + T)
        pos = self.backend.asarray(starts[:, None] + np.arange(T)[None, :])
        return cos[pos], sin[pos]
