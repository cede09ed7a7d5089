"""Minting the ids that name a forward's kept results: samples, drafts, verifies, hidden states.

They share ``ir.init``'s process-unique serial counter underneath, so every id here is positive,
unique across processes and increasing within one epoch: the backend's freshness check (each draft
and verify runs once, in the order its id was minted) reads the epoch and the counter of a
``DraftId`` or ``VerifyId`` exactly as of a ticket serial. Each function says what it mints and
returns that id's own type (``ir.ids``), so mypy refuses a sample id where a ticket serial, a draft
id or a verify id is expected.
"""

from __future__ import annotations

from ir.ids import DraftId, HiddenId, SampleId, VerifyId
from ir.init import mint_serial

__all__ = [
    "mint_sample_id",
    "mint_draft_id",
    "mint_verify_id",
    "mint_hidden_id",
]


def mint_sample_id() -> SampleId:
    """A fresh id for the tokens one forward samples (``DecodePlan.sample_id``)."""
    return SampleId(mint_serial())


def mint_draft_id() -> DraftId:
    """A fresh id for one speculative draft's kept states and proposals (``DraftBatch.draft_id``)."""
    return DraftId(mint_serial())


def mint_verify_id() -> VerifyId:
    """A fresh id for one verify forward's intermediate states (``VerifyBatch.verify_id``)."""
    return VerifyId(mint_serial())


def mint_hidden_id() -> HiddenId:
    """A fresh id for the target hidden states one forward keeps for the draft head (``ir.hidden``)."""
    return HiddenId(mint_serial())
