"""The byte layout of a PLE ring's control block: one page-locked host buffer shared by the GPU kernels
(`pallas.py`) and the host server (`fnx.ple.ring`). All words are little-endian uint32; a pair is two words
written by one 8-byte store, so the reader sees both halves of one write or neither.

| bytes | written by | what |
|---|---|---|
| HEADER (0) | GPU, `post` | pair (seq, n): request `seq` has `n` row ids |
| DONE (64) | host | the last request whose rows are in the ring |
| ABANDONED (128) | GPU, `wait` | the last request the GPU stopped waiting for (its deadline passed) |
| PAIRS (4096) | GPU, `post` | pair (seq, id) per row id, in request order |
| rows_offset(max_ids) | host | the rows, raw table bytes, in request order (repeats included) |

A request's seq is max(DONE, ABANDONED) + 1, read by `post` (requests follow one another on one stream: each
`post` is followed by its `wait` before the next `post`), so seqs only grow and one the GPU gave up on is
never reused."""

HEADER = 0
DONE = 64
ABANDONED = 128
PAIRS = 4096
PAGE = 4096


def rows_offset(max_ids: int) -> int:
    """Byte offset of the rows area for a ring of `max_ids` row ids."""
    return PAIRS + -(-max_ids * 8 // PAGE) * PAGE


def total_bytes(max_ids: int, row_bytes: int) -> int:
    return rows_offset(max_ids) + -(-max_ids * row_bytes // PAGE) * PAGE
