"""A request's output as text: incremental detokenisation and stop strings.

``TextStream`` takes the generated ids as they arrive and returns the text that may be shown now.
Stop strings are matched on the detokenised text, as the OpenAI API defines them: the text ends
before the first stop string, and the stream reports ``stopped``. So that a stop string split
across tokens (or across the deltas of a speculative window) is never shown in part, the last
``longest stop - 1`` characters are held back until more text or the end decides them.

Invariant: the pieces ``push`` and ``finish`` return, joined, equal the whole output's decoded text
cut before the first stop string (all of it when none occurs); ``tokens`` counts the ids taken up
to and including the one whose text completed the stop string.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from compiler.serve.tokenizer import Detokenizer


class TextStream:
    def __init__(self, detokenizer: Detokenizer, stops: Sequence[str]) -> None:
        self._detok = detokenizer
        self._stops = tuple(stops)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._buf = ""
        self.stopped = False
        self.tokens = 0
        self.text = ""
        """Everything returned so far."""

    def _scan(self) -> None:
        """Cut ``_buf`` at the first stop string in it, if any."""
        cut = min((i for i in (self._buf.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self._buf = self._buf[:cut]
            self.stopped = True

    def _take(self, upto: int) -> str:
        out, self._buf = self._buf[:upto], self._buf[upto:]
        self.text += out
        return out

    def push(self, ids: Iterable[int]) -> str:
        """The text ``ids`` make showable (ids after a stop string are not taken)."""
        for t in ids:
            if self.stopped:
                break
            self.tokens += 1
            self._buf += self._detok.push(t)
            if self._stops:
                self._scan()
        if self.stopped:
            return self._take(len(self._buf))
        return self._take(max(0, len(self._buf) - self._hold))

    def finish(self) -> str:
        """The rest of the text, at the end of the output."""
        if not self.stopped:
            self._buf += self._detok.flush()
            if self._stops:
                self._scan()
        return self._take(len(self._buf))
