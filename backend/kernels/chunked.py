"""Chunked prefill of Mamba2 layers over a varlen batch: causal conv1d and the SSD scan.

A prefill batch packs the tokens of several prompts: ``x[cu_seqlens[i]:cu_seqlens[i+1]]`` is
sequence ``i``. Each sequence starts from the state in its slot ``slot_idx[i]`` (zero after a
clear, the checkpoint after a copy-on-write, its own state for a chunked-prefill continuation),
leaves its final state there and returns per-token outputs. ``slot_idx[i] == -1`` skips a
sequence (outputs zero, pool untouched); so does an empty sequence (its state stays as it is).

Status: **torch on every device** (no Triton kernel yet), batched over the sequences: the number
of torch operations does not grow with the number of sequences. The live sequences (slot not -1,
at least one token) become rows, longest first:

- the conv lays the rows' streams "conv state, then the tokens" one after another, runs the
  depthwise conv over the whole concatenation at once (``width`` shifted multiply-adds, cheaper
  than ``conv1d`` at these widths; outputs that straddle two streams are never read), gathers each
  token's output and takes each row's final state from the last ``width - 1`` entries of its own
  stream;
- the SSD scan is the chunked (block-decomposed) form: within a chunk of ``chunk_size`` tokens the
  output is a masked, decay-weighted ``C Bᵀ`` product, across chunks the state is carried in
  float32. The tokens go to a chunk table (block ``c`` holds chunk ``c`` of every row that has
  one, so a row is padded to a whole number of chunks, not to the longest row), with ``dt = 0`` on
  the padding so it neither decays nor feeds the state. A Python loop runs over the chunk index
  (the longest row's chunk count), never over sequences; each step is one batched chunk of the
  rows still running. ``B`` and ``C`` stay per group (heads are viewed as ``[ngroups, heads per
  group]``). When one ``[rows, Q, Q, nheads]`` tensor of a step would exceed
  ``SCAN_GROUP_ELEMENTS`` the step's rows go in groups, so the scan's working memory stays that of
  one sequence or of ``SCAN_GROUP_ELEMENTS``, whichever is larger.

Both kernels compute in float32 and store in the state and output dtypes. ``backend.reference``
holds the token-by-token scans the tests compare against.

Invariants checked before computing (``ValueError``): shapes as in ``backend.kernels.conv`` /
``backend.kernels.ssm`` with the token axis packed; ``cu_seqlens`` 1-D integer, starting at 0,
non-decreasing, ending at the token count, one entry more than ``slot_idx``; slots -1 or in
``[0, num_slots)`` and not repeated (unless ``check_slots=False``).
"""

from __future__ import annotations

from itertools import pairwise

import attrs
import numpy as np
import torch
import torch.nn.functional as F

from backend.kernels import checks
from backend.kernels.checks import require
from backend.readback import host_values

__all__ = ["SCAN_GROUP_ELEMENTS", "Capture", "causal_conv1d_prefill", "ssd_prefill"]

SCAN_GROUP_ELEMENTS = 1 << 22
"""Elements of one ``[rows, Q, Q, nheads]`` float32 tensor of a step of the batched SSD scan above
which ``ssd_prefill`` splits the step's rows into groups (a group holds at least one row)."""


def _check_varlen(cu_seqlens: torch.Tensor, slot_idx: torch.Tensor, total: int, num_slots: int, check_slots: bool) -> list[int]:
    device = slot_idx.device
    checks.check_index("cu_seqlens", cu_seqlens, length=None, device=device)
    require(cu_seqlens.shape[0] >= 1, "cu_seqlens needs at least one entry")
    checks.check_index("slot_idx", slot_idx, length=cu_seqlens.shape[0] - 1, device=device)
    bounds: list[int] = host_values(cu_seqlens).tolist()  # (staged: the host's values, no readback)
    require(bounds[0] == 0 and bounds[-1] == total, f"cu_seqlens must run from 0 to {total}, got {bounds[:4]}...")
    require(all(a <= b for a, b in pairwise(bounds)), "cu_seqlens must be non-decreasing")
    if check_slots:
        checks.check_slot_rows("slot_idx", slot_idx, num_slots)
    return bounds


@attrs.frozen
class Capture:
    """States at inner positions of a varlen batch: the state of sequence ``seq[j]`` after its
    first ``at[j]`` tokens (``1 <= at[j] <=`` its length) is stored in entry ``j`` of the kernel's
    capture tensor, besides the final state the slot receives. Host ints: the kernels do their
    index arithmetic on the host. Each sequence is captured at most once and must be live."""

    seq: tuple[int, ...]
    at: tuple[int, ...]

    def __attrs_post_init__(self) -> None:
        require(len(self.seq) == len(self.at), f"Capture: {len(self.seq)} sequences but {len(self.at)} positions")
        require(len(set(self.seq)) == len(self.seq), f"Capture: a sequence is captured twice: {list(self.seq)[:8]}")


def _check_capture(capture: Capture | None, bounds: list[int], slot_idx: torch.Tensor, out: torch.Tensor | None, shape: tuple[int, ...]) -> None:
    """``capture`` names live sequences at positions inside them and ``out`` holds one state per entry."""
    if capture is None:
        require(out is None, "capture_state given without a capture")
        return
    require(out is not None, "a capture needs capture_state")
    assert out is not None
    checks.check_tensor("capture_state", out, shape=(len(capture.seq), *shape), device=slot_idx.device, dtypes=checks.STATE_DTYPES)
    slots = host_values(slot_idx).tolist()
    for s, a in zip(capture.seq, capture.at, strict=True):
        require(0 <= s < len(slots), f"capture sequence {s} out of range [0, {len(slots)})")
        length = bounds[s + 1] - bounds[s]
        require(slots[s] >= 0, f"capture sequence {s} is skipped (slot -1)")
        require(1 <= a <= length, f"capture position {a} of sequence {s} outside [1, {length}]")


@attrs.frozen
class _Live:
    """The live sequences of a varlen batch (slot not -1, at least one token) as rows
    ``0..rows-1``, longest first (ties in batch order), and where their tokens are.

    ``rank[j]`` and ``offset[j]`` (host arrays) are the row and the position within it of live
    token ``j``, in packed order; ``tokens`` are the packed indices of the live tokens, ``None`` when
    every token is live; ``slots`` and ``lengths`` are per row; ``row_of[i]`` is sequence ``i``'s
    row (-1 when it is not live). With padding inserted (``_live``'s ``pads``) a row's length and
    its tokens' offsets count the padding."""

    rows: int
    lengths: list[int]
    slots: torch.Tensor
    rank: np.ndarray
    offset: np.ndarray
    tokens: torch.Tensor | None
    row_of: np.ndarray

    def gather(self, packed: torch.Tensor) -> torch.Tensor:
        """The live tokens of a packed ``[total, ...]`` tensor, in float32."""
        return (packed if self.tokens is None else packed[self.tokens]).float()

    def scatter(self, live: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """A packed tensor shaped and typed like ``like``: ``live`` at the live tokens, zero elsewhere."""
        if self.tokens is None:
            return live.to(like.dtype)
        out = torch.zeros_like(like)
        out[self.tokens] = live.to(like.dtype)
        return out


def _live(bounds: list[int], slot_idx: torch.Tensor, pads: dict[int, tuple[int, int]] | None = None) -> _Live | None:
    """The live sequences, ``None`` when there are none (index arithmetic on the host). ``pads``:
    sequence ``i`` -> ``(at, n)``, ``n`` padding positions inserted before its token ``at`` (they
    hold no token: the scan's table leaves them zero)."""
    cu = np.asarray(bounds, dtype=np.int64)
    lengths = np.diff(cu)
    slots = host_values(slot_idx)
    live = (slots >= 0) & (lengths > 0)
    if not live.any():
        return None
    lens = lengths[live]  # batch order
    offset = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    tokens = np.repeat(cu[:-1][live], lens) + offset
    padded = lens.copy()
    if pads:
        which = np.cumsum(live) - 1  # sequence -> live index
        for i, (at, n) in pads.items():
            k = int(which[i])
            padded[k] += n
            first = int(np.sum(lens[:k]))
            offset[first + at : first + int(lens[k])] += n
    order = np.argsort(-padded, kind="stable")  # row -> live sequence
    rank = np.empty_like(order)  # live sequence -> row
    rank[order] = np.arange(order.shape[0])
    row_of = np.full(slots.shape[0], -1, dtype=np.int64)
    row_of[live] = rank
    every_token = int(lens.sum()) == bounds[-1]
    return _Live(
        rows=int(order.shape[0]),
        lengths=padded[order].tolist(),
        slots=torch.as_tensor(slots[live][order], device=slot_idx.device),
        rank=np.repeat(rank, lens),
        offset=offset,
        tokens=None if every_token else torch.as_tensor(tokens, device=slot_idx.device),
        row_of=row_of,
    )


def causal_conv1d_prefill(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    silu: bool,
    cu_seqlens: torch.Tensor,
    slot_idx: torch.Tensor,
    check_slots: bool = True,
    capture: Capture | None = None,
    capture_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed ``x [total, dim]`` -> ``out [total, dim]``; each slot's conv state is used and replaced.
    ``capture``: also store each named sequence's conv state after its first ``at`` tokens (the
    last ``width - 1`` inputs before that position) in ``capture_state [len(capture.seq), dim,
    width - 1]``."""
    require(x.dim() == 2, f"x must be [total_tokens, dim], got {tuple(x.shape)}")
    require(weight.dim() == 2, f"weight must be [dim, width], got shape {tuple(weight.shape)}")
    total, dim = x.shape
    width = weight.shape[1]
    require(2 <= width <= 4, f"conv width must be in [2, 4], got {width}")
    checks.check_tensor("weight", weight, shape=(dim, width), device=x.device, dtypes=checks.STATE_DTYPES)
    checks.check_optional("bias", bias, shape=(dim,), device=x.device, dtypes=checks.STATE_DTYPES)
    require(conv_state.dim() == 3, f"conv_state must be [num_slots, dim, width - 1], got {tuple(conv_state.shape)}")
    checks.check_tensor(
        "conv_state", conv_state, shape=(conv_state.shape[0], dim, width - 1), device=x.device, dtypes=checks.STATE_DTYPES
    )
    bounds = _check_varlen(cu_seqlens, slot_idx, total, conv_state.shape[0], check_slots)
    _check_capture(capture, bounds, slot_idx, capture_state, (dim, width - 1))
    live = _live(bounds, slot_idx)
    if live is None:
        return torch.zeros_like(x)

    keep = width - 1
    # The streams "conv state, then the tokens" of the rows, one after another: row r's stream
    # starts at base[r]. Output t of a row is its stream's entries t .. t + keep times the weight,
    # so `width` shifted multiply-adds over the whole concatenation give every output (entries that
    # straddle two streams are computed and never read).
    lengths = np.asarray(live.lengths)
    base = np.cumsum(keep + lengths) - (keep + lengths)
    at_token = base[live.rank] + live.offset  # stream index of each live token's first window entry

    def index(a: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(a, device=x.device)

    stream = torch.empty((int(base[-1]) + keep + live.lengths[-1], dim), dtype=torch.float32, device=x.device)
    stream[index((base[:, None] + np.arange(keep)).reshape(-1))] = conv_state[live.slots].transpose(1, 2).reshape(-1, dim).float()
    stream[index(at_token + keep)] = live.gather(x)
    outputs = stream.shape[0] - keep
    w = weight.float().T.contiguous()  # [width, dim]: contiguous rows keep the multiply-adds vectorized
    y = stream[:outputs] * w[0] if bias is None else torch.addcmul(bias.float(), stream[:outputs], w[0])
    for k in range(1, width):
        y.addcmul_(stream[k : k + outputs], w[k])
    y_live = y[index(at_token)]  # [live tokens, dim]
    # a row of length L leaves its stream entries L .. L + keep - 1
    final = stream[index(base[:, None] + lengths[:, None] + np.arange(keep))]  # [rows, keep, dim]
    conv_state[live.slots] = final.transpose(1, 2).to(conv_state.dtype)
    if capture is not None and capture.seq:
        assert capture_state is not None
        # after `at` tokens a row's state is its stream entries at .. at + keep - 1, as its final
        # state is after L tokens
        starts = base[live.row_of[np.asarray(capture.seq)]] + np.asarray(capture.at)
        inner = stream[index(starts[:, None] + np.arange(keep))]  # [captures, keep, dim]
        capture_state.copy_(inner.transpose(1, 2))
    return live.scatter(F.silu(y_live) if silu else y_live, x)


def _ssd_chunk(
    state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor
) -> torch.Tensor:
    """One chunk of ``Q`` tokens of ``b`` rows, float32, head-major with heads as ``[G, h]`` (groups,
    heads per group): ``state [b, G, h, P, N]`` (advanced in place to the chunk's end), ``x [b, G,
    h, Q, P]``, ``dt [b, G, h, Q]`` (final, after bias/softplus; zero on padding), ``A [G, h]``,
    ``B, C [b, G, Q, N]``. Returns ``y [b, G, h, Q, P]`` without the ``D`` skip and the ``z`` gate;
    every contraction is a batched matmul over ``(b, G)`` or ``(b, G, h)``."""
    rows, groups, per_group, head_dim, d_state = state.shape
    q = x.shape[3]
    log_decay = (dt * A[:, :, None]).cumsum(dim=-1)  # [b, G, h, Q]: log of the decay from chunk start through t
    # decay from token i to token t (i <= t), zero for t < i: zeroed before the exp so t < i cannot
    # overflow, and after it (exp(0) = 1); a -inf fill would send half of the entries down the slow
    # path of exp
    weights = (log_decay[..., :, None] - log_decay[..., None, :]).tril_().exp_().tril_()  # [b, G, h, t, i]
    weights.mul_((C @ B.transpose(-1, -2))[:, :, None])  # times C_t . B_i
    dtx = x * dt[..., None]  # [b, G, h, Q, P]
    # C_t . (carried state), all heads of a group in one matmul: [b, G, Q, N] @ [b, G, N, h * P]
    carried = C @ state.reshape(rows, groups, per_group * head_dim, d_state).transpose(-1, -2)
    carried = carried.view(rows, groups, q, per_group, head_dim).transpose(2, 3)  # [b, G, h, Q, P]
    y = weights @ dtx + carried * torch.exp(log_decay)[..., None]
    to_end = torch.exp(log_decay[..., -1:] - log_decay)  # [b, G, h, Q]: decay from token i to the chunk end
    fed = (dtx * to_end[..., None]).transpose(-1, -2).reshape(rows, groups, per_group * head_dim, q) @ B
    state.mul_(torch.exp(log_decay[..., -1])[..., None, None]).add_(fed.view(state.shape))
    return y


def ssd_prefill(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    *,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    cu_seqlens: torch.Tensor,
    slot_idx: torch.Tensor,
    chunk_size: int = 64,
    check_slots: bool = True,
    capture: Capture | None = None,
    capture_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed ``x [total, H, P]``, ``dt [total, H]``, ``B, C [total, G, N]`` -> ``y [total, H, P]``;
    each slot's SSM state is the initial state and receives the final one. ``capture``: also store
    each named sequence's state after its first ``at`` tokens in ``capture_state [len(capture.seq),
    H, P, N]``: the sequence's chunks restart at ``at`` (padding fills the chunk that ends there),
    so that state is a chunk-end state, computed as a scan that stopped at ``at`` computes it."""
    require(chunk_size > 0, f"chunk_size must be positive, got {chunk_size}")
    require(state.dim() == 4, f"state must be [num_slots, nheads, head_dim, d_state], got {tuple(state.shape)}")
    num_slots, nheads, head_dim, d_state = state.shape
    total = x.shape[0] if x.dim() else 0
    device = x.device
    floats = checks.STATE_DTYPES
    checks.check_tensor("state", state, shape=state.shape, device=device, dtypes=floats)
    checks.check_tensor("x", x, shape=(total, nheads, head_dim), device=device, dtypes=floats)
    checks.check_tensor("dt", dt, shape=(total, nheads), device=device, dtypes=floats)
    checks.check_tensor("A", A, shape=(nheads,), device=device, dtypes=floats)
    require(B.dim() == 3, f"B must be [total, ngroups, d_state], got {tuple(B.shape)}")
    ngroups = B.shape[1]
    require(ngroups > 0 and nheads % ngroups == 0, f"nheads {nheads} is not a multiple of ngroups {ngroups}")
    checks.check_tensor("B", B, shape=(total, ngroups, d_state), device=device, dtypes=floats)
    checks.check_tensor("C", C, shape=(total, ngroups, d_state), device=device, dtypes=floats)
    checks.check_optional("D", D, shape=(nheads,), device=device, dtypes=floats)
    checks.check_optional("z", z, shape=(total, nheads, head_dim), device=device, dtypes=floats)
    checks.check_optional("dt_bias", dt_bias, shape=(nheads,), device=device, dtypes=floats)
    bounds = _check_varlen(cu_seqlens, slot_idx, total, num_slots, check_slots)
    _check_capture(capture, bounds, slot_idx, capture_state, (nheads, head_dim, d_state))
    live = _live(bounds, slot_idx)
    if live is None:
        return torch.zeros_like(x)
    q = min(chunk_size, live.lengths[0])
    captured: dict[int, list[tuple[int, int]]] = {}  # chunk index -> (capture entry, sequence)
    if capture is not None and capture.seq:
        # pad each captured sequence so that its position `at` ends a chunk (a chunk then never
        # straddles it); at its own end nothing follows, so nothing is padded
        pads = {
            s: (a, -a % q) for s, a in zip(capture.seq, capture.at, strict=True) if a < bounds[s + 1] - bounds[s] and a % q
        }
        if pads:
            live = _live(bounds, slot_idx, pads)
            assert live is not None
        for j, (s, a) in enumerate(zip(capture.seq, capture.at, strict=True)):
            captured.setdefault(-(-a // q) - 1, []).append((j, s))

    # The chunk table: block c holds chunk c (tokens c * q .. c * q + q - 1) of every row that has
    # one; the rows are longest first, so those are rows 0 .. running[c] - 1. A chunk runs past its
    # row's end only in the row's last chunk, or before a captured position (padding, dt = 0 there).
    chunks = -(-np.asarray(live.lengths) // q)  # per row
    running = (chunks[:, None] > np.arange(int(chunks[0]))).sum(axis=0)  # per chunk index
    begin = np.cumsum(running) - running
    chunk_of = live.offset // q
    entry = (  # [table row, G, h, position] of every live token
        torch.as_tensor(begin[chunk_of] + live.rank, device=device),
        slice(None),
        slice(None),
        torch.as_tensor(live.offset - chunk_of * q, device=device),
    )
    table = int(running.sum())
    per_group = nheads // ngroups

    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.float32, device=device)

    x_live = live.gather(x)  # [live, H, P]
    dt_live = live.gather(dt)
    if dt_bias is not None:
        dt_live = dt_live + dt_bias.float()
    if dt_softplus:
        dt_live = F.softplus(dt_live)
    x_tab = zeros(table, ngroups, per_group, q, head_dim)
    x_tab[entry] = x_live.reshape(-1, ngroups, per_group, head_dim)
    dt_tab = zeros(table, ngroups, per_group, q)  # zero on padding: it neither decays nor feeds the state
    dt_tab[entry] = dt_live.reshape(-1, ngroups, per_group)
    B_tab = zeros(table, ngroups, q, d_state)
    B_tab[entry[:2] + entry[3:]] = live.gather(B)
    C_tab = torch.zeros_like(B_tab)
    C_tab[entry[:2] + entry[3:]] = live.gather(C)
    A_g = A.float().reshape(ngroups, per_group)
    carried = state[live.slots].float().reshape(live.rows, ngroups, per_group, head_dim, d_state)  # advanced in place

    # rows per step: the [rows, Q, Q, nheads] tensors stay within SCAN_GROUP_ELEMENTS (or one row)
    per_step = max(1, SCAN_GROUP_ELEMENTS // (q * q * nheads))
    y_tab = torch.empty_like(x_tab)
    for c, (b0, n) in enumerate(zip(begin.tolist(), running.tolist(), strict=True)):  # over chunk indices, never over sequences
        for r0 in range(0, n, per_step):
            r1 = min(r0 + per_step, n)
            rows = slice(b0 + r0, b0 + r1)
            y_tab[rows] = _ssd_chunk(carried[r0:r1], x_tab[rows], dt_tab[rows], A_g, B_tab[rows], C_tab[rows])
        for j, s in captured.get(c, ()):
            assert capture_state is not None
            capture_state[j] = carried[int(live.row_of[s])].reshape(nheads, head_dim, d_state)
    y_live = y_tab[entry].reshape(-1, nheads, head_dim)  # [live, H, P]
    if D is not None:
        y_live = y_live + D.float()[:, None] * x_live
    if z is not None:
        y_live = y_live * F.silu(live.gather(z))
    state[live.slots] = carried.reshape(live.rows, nheads, head_dim, d_state).to(state.dtype)
    return live.scatter(y_live, x)
