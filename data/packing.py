"""`data.packing=true`: several conversations end to end in each training row, so that a batch
holds little padding.

The conversations are packed once, before training, first-fit decreasing: the longest first,
each into the first row with room for it (rows of the largest of `data.buckets` targets, i.e.
that many + 1 tokens). The packing depends on the conversations' lengths alone, so it is the
same on every rerun, in every process and worker; the training pipeline then draws the packed
rows as it draws any examples (a fresh order each epoch, batch b made from batch b's rows alone),
and its iterator's state stays the index of the next batch, so a resume is exact.

Grain's `FirstFitPackIterDataset` is not used: it packs a stream of single examples, and its
iterator state is its parent's state at the last batch it emitted plus the rows it has emitted
since, so batch b cannot be made without packing every example before it. zoo's pipeline makes
each batch from its index alone (in a worker process, `data.workers`, or after a resume).

A packed row's columns: `tokens` end to end; `segment_ids` (1, 2, ... for each input position's
conversation, 0 for padding) and `positions` (each position within its conversation), which the
model reads to keep attention within a conversation and restart its rotary positions; and
`loss_mask` of the conversations' own masks, with the target of each conversation's last token
(the next one's first) cleared: no conversation is trained to predict another.
"""

from __future__ import annotations

import numpy as np
from zoo.data.text import LENGTH, TOKENS

from zoo.plugin import LOSS_MASK, POSITIONS, SEGMENT_IDS, Batch


def first_fit(sizes: np.ndarray, capacity: int) -> np.ndarray:
    """The row of each item of `sizes` (each at most `capacity`), first-fit decreasing; rows are
    numbered 0, 1, ... as they are opened. A tree of each subtree's largest room finds the first
    row with room in log(rows) steps."""
    count = len(sizes)
    leaves = 1 << max(0, count - 1).bit_length()
    room = [capacity] * (2 * leaves)  # node i: the largest room among its rows
    rows = np.empty(count, np.int64)
    for item in np.argsort(-np.asarray(sizes), kind="stable"):
        need, node = int(sizes[item]), 1
        while node < leaves:
            node = 2 * node if room[2 * node] >= need else 2 * node + 1
        rows[item] = node - leaves
        room[node] -= need
        while node > 1:
            node //= 2
            room[node] = max(room[2 * node], room[2 * node + 1])
    return rows


def packed_rows(sizes: np.ndarray, capacity: int) -> list[np.ndarray]:
    """Which items (indices into `sizes`) each packed row holds, in the order they were placed."""
    rows = first_fit(sizes, capacity)
    placed = np.argsort(-np.asarray(sizes), kind="stable")  # the order they were placed in
    by_row = placed[np.argsort(rows[placed], kind="stable")]
    ends = np.cumsum(np.bincount(rows, minlength=int(rows.max()) + 1 if len(rows) else 0))
    return np.split(by_row, ends[:-1]) if len(rows) else []


def pack(pieces: list[list[tuple[np.ndarray, np.ndarray]]], longest: int) -> Batch:
    """Rows of `longest` targets from each row's (token ids, 1 for each token that carries loss)
    pieces, end to end; see the module's doc for the columns."""
    tokens = np.zeros((len(pieces), longest + 1), np.int32)
    trained = np.zeros((len(pieces), longest + 1), np.uint8)
    segments = np.zeros((len(pieces), longest + 1), np.int32)
    positions = np.zeros((len(pieces), longest + 1), np.int32)
    lengths = np.zeros(len(pieces), np.int32)
    for i, row in enumerate(pieces):
        at = 0
        for segment, (ids, marks) in enumerate(row, start=1):
            end = at + len(ids)
            tokens[i, at:end], trained[i, at:end] = ids, marks
            segments[i, at:end], positions[i, at:end] = segment, np.arange(len(ids))
            at = end
        lengths[i] = max(at - 1, 0)
    same = segments[:, 1:] == segments[:, :-1]
    return {
        TOKENS: tokens,
        LENGTH: lengths,
        LOSS_MASK: trained[:, 1:] * same,
        SEGMENT_IDS: segments[:, :-1],
        POSITIONS: positions[:, :-1],
    }
