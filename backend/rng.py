"""A counter-based random stream: numbers are a pure function of their key, not of a generator's state.

A key is (``seed``, completion ``index``, output ``position``, ``purpose``): ``uniform`` hashes each
key to one float64 in [0, 1). Nothing is drawn from a shared generator, so:

- **batch invariance**: a row's numbers depend on its key only, not on the other rows of the batch,
  their number or their order (every operation below is elementwise on int64 tensors);
- **replayability**: a request preempted and recomputed, or run on another rank (``--tp``,
  ``--dp``), draws the same numbers at the same positions;
- **purposes apart**: the draft's proposal, the acceptance test, the residual and the target's own
  sample at one position read different numbers (``Purpose``), so a proposal never shares its
  noise with the test that judges it (the independence rejection sampling's exactness needs).

The hash: the key's fields are absorbed one word at a time into splitmix64's finaliser (``_mix``, a
bijection of 64-bit words with full avalanche), ``h = mix(mix(seed ^ C0) ^ word)`` with ``word``
packing (purpose, index, position) into one 64-bit word, then one more ``mix`` whitens the result.
Consequences: two keys that differ only in (purpose, index, position) never give the same 64 bits
(every step is injective in the last word); keys with different seeds collide like a random
function's outputs (about 2**-64 per pair). The stream passes no statistical test suite by
construction, but the statistics it is used for are tested (``tests/backend/test_sampling_stream.py``
and the rejection-sampling convergence test).

Arithmetic: int64 tensors, where torch's multiplication wraps modulo 2**64 (two's complement, on
CPU and CUDA alike) and ``>>`` is arithmetic, so logical shifts mask the sign extension away. On
the CPU the same hash runs on NumPy uint64 arrays sharing the tensors' memory (wrapping
multiplication, logical shifts): the hash is some 40 elementwise operations on a handful of
values, and a torch operation's fixed cost (a few microseconds) made it 170 us for 8 rows, against
about 20 us in NumPy. A test checks both against a pure-Python reference (integers modulo 2**64)
bit for bit. ``Keys`` hashes a batch's seeds and indices once (the first step of the hash depends on
nothing else), so a draw at a new position costs the position's part alone (about 11 us for 8 rows).

Field ranges (``PreconditionError``-free: callers build keys from validated IR columns): ``seed``
in [0, 2**63 - 1], ``index`` in [0, 2**12), ``position`` in [0, 2**44), ``purpose`` a ``Purpose``.
"""

from __future__ import annotations

import enum
from typing import final

import numpy as np
import torch

__all__ = ["Keys", "Purpose", "bits", "uniform"]


class Purpose(enum.IntEnum):
    """Which decision a number is for (the salt that keeps the decisions' noise apart)."""

    TARGET = 1
    """The target's own sample at a position: plain decoding, a prefill's first token, the bonus."""
    DRAFT = 2
    """The draft model's sampled proposal at a position (a full-q draft)."""
    ACCEPT = 3
    """The acceptance test of the proposal at a position."""
    RESIDUAL = 4
    """The replacement token drawn from the residual at the first rejected position."""


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)
_C0 = _signed(0x9E3779B97F4A7C15)
_C1 = _signed(0xD1B54A32D192ED03)
_LOW30 = (1 << 34) - 1  # keeps the low 34 bits: x >>> 30
_LOW27 = (1 << 37) - 1
_LOW31 = (1 << 33) - 1
_INDEX_SHIFT = 44
_PURPOSE_SHIFT = 56


def _mix(z: torch.Tensor) -> torch.Tensor:
    # splitmix64's finaliser with logical shifts spelled as arithmetic shift + mask
    z = (z ^ ((z >> 30) & _LOW30)) * _M1
    z = (z ^ ((z >> 27) & _LOW27)) * _M2
    return z ^ ((z >> 31) & _LOW31)


_U = np.uint64
_UM1, _UM2, _UC0, _UC1 = _U(0xBF58476D1CE4E5B9), _U(0x94D049BB133111EB), _U(0x9E3779B97F4A7C15), _U(0xD1B54A32D192ED03)
_U11, _U27, _U30, _U31, _UINDEX = _U(11), _U(27), _U(30), _U(31), _U(_INDEX_SHIFT)
_UPURPOSE = _U(_PURPOSE_SHIFT)
_SALTS = {p: _U(int(p) << _PURPOSE_SHIFT) for p in Purpose}


def _mix_np(z: np.ndarray) -> np.ndarray:
    """``_mix`` on uint64 arrays (wrapping multiplication, logical shifts)."""
    z = z ^ (z >> _U30)
    z = z * _UM1
    z = z ^ (z >> _U27)
    z = z * _UM2
    out: np.ndarray = z ^ (z >> _U31)
    return out


def _u64(t: torch.Tensor) -> np.ndarray:
    return t.numpy().view(np.uint64)  # int64 keys (an integer tensor never requires grad)


def _bits_np(seed: torch.Tensor, index: torch.Tensor, position: torch.Tensor, purpose: Purpose | torch.Tensor) -> np.ndarray:
    salt = _u64(purpose) << _UPURPOSE if isinstance(purpose, torch.Tensor) else _SALTS[purpose]
    word = _u64(position) | (_u64(index) << _UINDEX) | salt
    return _mix_np(_mix_np(_mix_np(_u64(seed) ^ _UC0) ^ word) + _UC1)


def _on_cpu(*tensors: object) -> bool:
    return all(t.is_cpu for t in tensors if isinstance(t, torch.Tensor))


def _bits_torch(seed: torch.Tensor, index: torch.Tensor, position: torch.Tensor, purpose: Purpose | torch.Tensor) -> torch.Tensor:
    word = position | (index << _INDEX_SHIFT) | ((purpose if isinstance(purpose, torch.Tensor) else int(purpose)) << _PURPOSE_SHIFT)
    return _mix(_mix(_mix(seed ^ _C0) ^ word) + _C1)


def bits(seed: torch.Tensor, index: torch.Tensor, position: torch.Tensor, purpose: Purpose | torch.Tensor) -> torch.Tensor:
    """64 random bits (an int64 tensor) per key; the arguments broadcast against each other."""
    if _on_cpu(seed, index, position, purpose):
        return torch.from_numpy(np.ascontiguousarray(_bits_np(seed, index, position, purpose)).view(np.int64))
    return _bits_torch(seed, index, position, purpose)


_TWO_POW_M53 = 2.0**-53


def uniform(seed: torch.Tensor, index: torch.Tensor, position: torch.Tensor, purpose: Purpose | torch.Tensor) -> torch.Tensor:
    """One float64 in [0, 1) per key: the top 53 bits of ``bits`` times 2**-53 (every multiple of
    2**-53 in [0, 1) equally likely; ``u < r`` holds with probability exactly ``r`` for ``r`` a
    multiple of 2**-53, and within 2**-53 otherwise)."""
    if _on_cpu(seed, index, position, purpose):
        top_np = _bits_np(seed, index, position, purpose) >> _U11
        return torch.from_numpy(np.ascontiguousarray(top_np.astype(np.float64) * _TWO_POW_M53))
    top = (bits(seed, index, position, purpose) >> 11) & ((1 << 53) - 1)
    return top.to(torch.float64) * _TWO_POW_M53


def _mixed(z: np.ndarray) -> np.ndarray:
    """``_mix_np`` of a fresh array, in its own memory (fewer temporaries)."""
    z ^= z >> _U30
    z *= _UM1
    z ^= z >> _U27
    z *= _UM2
    z ^= z >> _U31
    return z


@final
class Keys:
    """Some rows' streams with their seeds and completion indices absorbed, on the host: the hash's
    first step (``mix(seed ^ C0)``) depends on the seed alone and its word's index bits on the index
    alone, so a batch works them out once and a draw hashes only what its position adds.
    ``Keys.of(seed, index).uniform(position, purpose)`` is ``uniform(seed, index, position,
    purpose)`` bit for bit (tested)."""

    __slots__ = ("_absorbed", "_index_word")

    def __init__(self, absorbed: np.ndarray, index_word: np.ndarray) -> None:
        self._absorbed = absorbed
        self._index_word = index_word

    @classmethod
    def of(cls, seed: np.ndarray, index: np.ndarray) -> Keys:
        """The rows' keys: ``seed`` and ``index`` int64 [N] (the ranges of the module docstring)."""
        s = np.ascontiguousarray(seed, dtype=np.int64).view(np.uint64)
        return cls(_mixed(s ^ _UC0), np.ascontiguousarray(index, dtype=np.int64).view(np.uint64) << _UINDEX)

    def take(self, rows: np.ndarray) -> Keys:
        """The keys of ``rows`` (indices)."""
        return Keys(self._absorbed[rows], self._index_word[rows])

    def __len__(self) -> int:
        return int(self._absorbed.shape[0])

    def uniform(self, position: np.ndarray, purpose: Purpose | np.ndarray) -> np.ndarray:
        """One float64 in [0, 1) per key (``uniform``): ``position`` int64 [N] or [N, M] (row ``i``'s
        positions on row ``i``), ``purpose`` a ``Purpose`` or an int64 array shaped like it."""
        absorbed, index_word = self._absorbed, self._index_word
        if position.ndim == 2:
            absorbed, index_word = absorbed[:, None], index_word[:, None]
        salt = np.asarray(purpose, dtype=np.int64).view(np.uint64) << _UPURPOSE if isinstance(purpose, np.ndarray) else _SALTS[purpose]
        word = np.ascontiguousarray(position, dtype=np.int64).view(np.uint64) | index_word
        word |= salt
        word ^= absorbed
        z = _mixed(word)
        z += _UC1
        z = _mixed(z) >> _U11
        out: np.ndarray = z.astype(np.float64)
        out *= _TWO_POW_M53
        return out
