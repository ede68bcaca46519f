"""Recurrent attention of the Recurrent Transformer layer ("The Recurrent Transformer: Greater
Effective Depth and Efficient Decoding", §"The Recurrent Transformer layer", §"Exact Tiling for
Training and Prefill", §"The backward pass", appendix algorithms "Exact tiled forward pass" and
UpdateTile), generalised to blocks of b positions.

One layer, per head, positions grouped into blocks of b (b = 1 is the paper's layer):

    q_i, k~_i, v~_i                       from the layer input x_i (all known up front)
    a_i = softmax_j(q_i . k_j * s + bias(i - j)) v_j   over
          persistent pairs (k_j, v_j) of every position j in an earlier block, and
          temporary pairs (k~_j, v~_j) of positions j <= i in i's own block
    (z_i, k_i, v_i) = finish(a_i)         z_i: layer output; (k_i, v_i): persistent pair from z_i

Two exact evaluations:

* ``recurrent_attention_naive`` (``naive.py``): one block at a time over the growing prefix (softmax over all
  visible keys at once). O(N^2) K/V reads; the reference.
* ``recurrent_attention_tiled`` (``tiled.py``): all queries up front; online-softmax accumulators (running max m,
  normaliser l, numerator o) per query, first filled with the temporary pairs and with the
  persistent pairs of earlier calls (the cache). Then for block t = 1..nB (1-indexed): its queries
  are complete, so a_t = o_t / l_t, finish() runs once for the whole block, and with P the largest
  power of two dividing t the key tile of blocks t-P+1..t updates the queries of blocks t+1..t+P
  (truncated at nB; any nB). Every (query block > key block) pair is visited exactly once, and
  each key is read O(log N) times. Accumulators are kept in fp32 under bf16/fp16.
  As in the authors' code, the queries, accumulators and persistent pairs sit in buffers
  allocated once per call, position-major, so a block's write and a tile's read are contiguous
  slices, and each tile update (``tile_update``) is one region ``torch.compile(dynamic=False)``
  can compile (``compiled_tile_update``).

Both take the state of earlier calls (persistent cache and the temporaries of an unfinished
block), so a sequence split across calls gives the same result as one call. Autograd runs
through the naive one. The tiled one records no graph (it writes its buffers in place) and has
its own backward (``_TiledRecurrentAttention``) that saves only
O(N d) tensors and recomputes the tile scores, like FlashAttention, run over the blocks in
reverse because finish() sits inside the recurrence (its vector-Jacobian product per block).
"""

from .common import BiasFn, Finish, RecurrentInputs, Stats, TileUpdate, alibi_bias, block_edges, kv_reads, tile_schedule
from .naive import recurrent_attention_naive
from .tiled import compiled_tile_update, finish_vjp, recurrent_attention_tiled, softmax_backward, tile_update

__all__ = [
    "BiasFn",
    "Finish",
    "RecurrentInputs",
    "Stats",
    "TileUpdate",
    "alibi_bias",
    "block_edges",
    "compiled_tile_update",
    "finish_vjp",
    "kv_reads",
    "recurrent_attention_naive",
    "recurrent_attention_tiled",
    "softmax_backward",
    "tile_schedule",
    "tile_update",
]
