"""Pure, typed passes between IR node types, one module per pass.

A pass never mutates its input, never calls the backend, and returns its input object when it
changes nothing. Configuration comes in a frozen context argument.

Every pass checks its arguments at entry, one ``isinstance`` per argument (``passes._args``): an
argument of the wrong type raises ``PreconditionError`` naming the pass, the argument, the type
received and the value, before anything else runs.
"""

from passes.accept import accept
from passes.commit import commit
from passes.filter_batch import filter_batch
from passes.lower import LowerContext, lower
from passes.merge_batch import merge_batch
from passes.mix_with_running import mix_with_running
from passes.prepare_for_decode import DecodeContext, prepare_for_decode
from passes.prepare_for_draft import SpecContext, prepare_for_draft
from passes.prepare_for_draft_commit import prepare_for_draft_commit
from passes.prepare_for_draft_extend import prepare_for_draft_extend
from passes.prepare_for_extend import prepare_for_extend
from passes.prepare_for_head_commit import prepare_for_head_commit
from passes.prepare_for_head_extend import prepare_for_head_extend
from passes.prepare_for_verify import prepare_for_verify
from passes.withdraw import withdraw

__all__ = [
    "DecodeContext",
    "LowerContext",
    "SpecContext",
    "accept",
    "commit",
    "prepare_for_draft",
    "prepare_for_draft_commit",
    "prepare_for_draft_extend",
    "prepare_for_head_commit",
    "prepare_for_head_extend",
    "prepare_for_verify",
    "filter_batch",
    "lower",
    "merge_batch",
    "mix_with_running",
    "prepare_for_decode",
    "prepare_for_extend",
    "withdraw",
]
