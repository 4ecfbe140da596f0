"""Sparse-attention block retrieval: which blocks will a decode step attend to?

Pure numpy, no I/O. The daemon owns one :class:`SparseIndex` per sequence (session) of a
namespace, inserts a block's :class:`BlockSummary` when the block is committed, removes it when
the block is forgotten, and answers HINTs carrying query vectors with :meth:`SparseIndex.select`
(ranked blocks to keep and to promote) and :meth:`SparseIndex.predict_next` (blocks to start
moving for the next step). See ``docs/slsap-sparse.md``.
"""

from kvtierd.slsap.sparse.config import RerankScore, Selection, SparseConfig
from kvtierd.slsap.sparse.index import SparseIndex
from kvtierd.slsap.sparse.ivf import ClusterLists
from kvtierd.slsap.sparse.summary import (
    BlockLayout,
    BlockSummary,
    keys_from_block,
    summarize_block,
    summarize_keys,
    summarize_sequence,
)

__all__ = [
    "BlockLayout",
    "BlockSummary",
    "ClusterLists",
    "RerankScore",
    "Selection",
    "SparseConfig",
    "SparseIndex",
    "keys_from_block",
    "summarize_block",
    "summarize_keys",
    "summarize_sequence",
]
