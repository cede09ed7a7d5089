"""Text <-> token ids for serving: the bundled models' bytes (``ByteTokenizer``) or a checkpoint's
``tokenizer.json`` (``HFTokenizer``, the ``tokenizers`` library, offline), and incremental
detokenisation that never splits a UTF-8 character (``Detokenizer``).

``encode`` adds what the tokenizer's own post-processor adds (a BOS, say); ``decode`` leaves special
tokens out. A ``Detokenizer`` takes generated ids one at a time and returns the text they complete:
bytes of a character that is not complete yet are held back until it is (a byte-level BPE splits
an emoji over several tokens), and ``flush`` returns what is left, so the pieces joined are exactly
``decode`` of all the ids.
"""

from __future__ import annotations

import codecs
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from backend.files import CheckpointError, file_kind
from ir.columns import int_problem
from ir.errors import short_repr

__all__ = ["MAX_ID", "MAX_TOKENIZER_BYTES", "REPLACEMENT", "ByteTokenizer", "Detokenizer", "HFTokenizer", "Tokenizer", "check_ids"]

REPLACEMENT = "\ufffd"
"""U+FFFD, what an unfinished or invalid character decodes to."""
MAX_ID = 1 << 32
"""Ids a ``tokenizer.json`` decoder takes (32-bit); an id it does not know (a model's vocabulary
may hold padding rows beyond the tokenizer's) decodes to nothing, as transformers decodes it."""
MAX_TOKENIZER_BYTES = 256 << 20
"""Largest ``tokenizer.json`` read (real ones are 2 to 20 MB)."""


def check_ids(ids: object, vocab: int) -> list[int]:
    """``ids`` as a list of token ids in ``[0, vocab)`` (ints or numpy ints, never ``bool``,
    ``float`` or ``str``), or ``ValueError`` naming the first bad one."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple, range)):
        raise ValueError(f"token ids must be a list or tuple of ints, got {short_repr(ids)}")
    out = []
    for i in ids:
        problem = int_problem(i)
        if problem is not None:
            raise ValueError(f"token id {problem} (got {short_repr(i)})")
        n = int(i)
        if not 0 <= n < vocab:
            raise ValueError(f"token id {n} is not in [0, {vocab})")
        out.append(n)
    return out


def _check_text(text: object) -> str:
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {short_repr(text)}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text is not valid Unicode ({e.reason} at character {e.start})") from None
    return text


@runtime_checkable
class Detokenizer(Protocol):
    """Incremental detokenisation of one output (see the module): ``push`` each generated id, ``flush``
    at the end; the pieces joined are ``decode`` of all the ids, and no piece splits a character."""

    def push(self, token: int) -> str:
        """The text completed by ``token`` (may be empty)."""
        ...

    def flush(self) -> str:
        """The text of the ids pushed but not returned yet (an unfinished character as U+FFFD)."""
        ...


@runtime_checkable
class Tokenizer(Protocol):
    """Text to token ids and back, for serving text (see the module): ``ByteTokenizer`` for the bundled
    models, ``HFTokenizer`` for a checkpoint. Refuses text that is not a valid ``str`` and ids that are
    not ints in range (``ValueError``)."""

    @property
    def vocab_size(self) -> int:
        """Ids are in ``[0, vocab_size)``."""
        ...

    @property
    def name(self) -> str:
        """What the tokenizer is, for reports (``"bytes"``, or the ``tokenizer.json`` path)."""
        ...

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, with what the tokenizer's post-processor adds (a BOS, say)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens left out."""
        ...

    def detokenizer(self) -> Detokenizer:
        """A fresh ``Detokenizer`` for one output."""
        ...

    def single_id(self, text: str) -> int | None:
        """The one id ``text`` encodes to without special tokens, or None if it is not one token."""
        ...


class _ByteDetokenizer:
    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        (t,) = check_ids([token], 256)
        return self._utf8.decode(bytes((t,)))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class ByteTokenizer:
    """The bundled models' vocabulary: a token is a byte of the UTF-8 text; nothing is special."""

    vocab_size = 256
    name = "bytes"

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``."""
        return list(_check_text(text).encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """``ids`` (each in ``[0, 256)``) as UTF-8, an invalid sequence as U+FFFD."""
        return bytes(check_ids(ids, 256)).decode("utf-8", errors="replace")

    def detokenizer(self) -> Detokenizer:
        """A fresh incremental UTF-8 decoder."""
        return _ByteDetokenizer()

    def single_id(self, text: str) -> int | None:
        """The byte ``text`` is, when it is one byte in UTF-8; else None."""
        data = _check_text(text).encode("utf-8")
        return data[0] if len(data) == 1 else None


class _WindowDetokenizer:
    """Incremental decoding by re-decoding a short window of ids: the text of ``ids[prefix:]`` minus
    that of ``ids[prefix:read]`` is new once it does not end in an unfinished character (U+FFFD);
    then the window moves up. Decoding from an earlier id rather than the new id alone keeps what a
    decoder does at a token boundary (a leading space, bytes of one character) as a whole-sequence
    decode does it, and each push costs a window, not the whole output."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def _delta(self) -> str:
        before = self._tok._decode_checked(self._ids[self._prefix : self._read])
        after = self._tok._decode_checked(self._ids[self._prefix :])
        return after[len(before) :]

    def push(self, token: int) -> str:
        (t,) = check_ids([token], MAX_ID)  # before it is kept: a bad id must not break the stream
        self._ids.append(t)
        new = self._delta()
        if not new or new.endswith(REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return new

    def flush(self) -> str:
        new = self._delta()
        self._prefix = self._read = len(self._ids)
        return new


class HFTokenizer:
    """A checkpoint's ``tokenizer.json`` through the ``tokenizers`` library (nothing downloaded)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        given: object = path  # checked at run time too: callers need not be type-checked
        if not isinstance(given, (str, Path)) or not str(given):
            raise CheckpointError(repr(given), "a tokenizer path must be a non-empty str or Path")
        p = Path(path)
        try:
            st = os.stat(p)
        except FileNotFoundError:
            raise CheckpointError(p, "no tokenizer.json (serving text needs the checkpoint's tokenizer)") from None
        except (OSError, ValueError) as e:
            raise CheckpointError(p, f"cannot read the tokenizer ({e})") from None
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(p, f"the tokenizer is {file_kind(st.st_mode)}, not a regular file")
        if st.st_size > MAX_TOKENIZER_BYTES:
            raise CheckpointError(p, f"tokenizer of {st.st_size} bytes is over the limit of {MAX_TOKENIZER_BYTES}")
        try:
            self._tok = _Tokenizer.from_file(str(p))
        except Exception as e:  # the Rust library raises plain Exceptions for a file it cannot parse
            raise CheckpointError(p, f"the tokenizer does not parse ({' '.join(str(e).split())[:200]})") from None
        self.path = p
        self._vocab = int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def vocab_size(self) -> int:
        """Ids are in ``[0, vocab_size)``: the tokenizer's vocabulary with its added tokens."""
        return self._vocab

    @property
    def name(self) -> str:
        """The ``tokenizer.json`` path."""
        return str(self.path)

    def vocab(self) -> dict[str, int]:
        """Every token's id, added tokens included (a copy)."""
        return dict(self._tok.get_vocab(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, with the special tokens the post-processor adds."""
        return list(self._tok.encode(_check_text(text), add_special_tokens=True).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens left out (an id the tokenizer does not know decodes to
        nothing)."""
        return str(self._tok.decode(check_ids(ids, MAX_ID), skip_special_tokens=True))

    def _decode_checked(self, ids: list[int]) -> str:
        """``decode`` of ids already checked (the detokenizer's window)."""
        return str(self._tok.decode(ids, skip_special_tokens=True))

    def detokenizer(self) -> Detokenizer:
        """A fresh ``Detokenizer`` that re-decodes a short window of ids per push."""
        return _WindowDetokenizer(self)

    def single_id(self, text: str) -> int | None:
        """The one id ``text`` encodes to without special tokens, or None if it is not one token."""
        ids = self._tok.encode(_check_text(text), add_special_tokens=False).ids
        return int(ids[0]) if len(ids) == 1 else None
