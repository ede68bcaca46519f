"""What does the state carry? Two counterfactual probes read through the streaming contract.

**repeat** (copy). A document is ``s1, gap, marker, s2`` with ``s2 = s1``: the ``tinystories-repeat``
val split as it is (no gap), text files of such documents (scripts/make_copy_task.py: a story's
first sentence, the rest of the story as the gap), or, for any other text, passages of ``n`` tokens
cut from it (no gap). For the copy offset k (the k-th token of s2):

- copy_gain(k) = loss(s1[k]) − loss(s2[k]): how much better the copy is predicted than the
  original, both in the true document. Filed under distance k: the last k tokens before s1[k]
  and before s2[k] are the same, the tokens k back differ.
- swap_Δ(k) = loss(s2[k] | s1 replaced by another passage of the same length) − loss(s2[k] | s1):
  how much the prediction depends on what s1 said. Filed under k + |gap| + |marker|, the distance
  back to the nearest swapped token.

Distances count tokens back from the token a prediction is made from, so a model whose receptive
field is R tokens (see ``receptive_field``) has copy_gain and swap_Δ exactly 0 at every distance > R.

**swap** (any corpus). For a block of S target positions starting at t0 and a distance d, the
history older than d tokens before t0 (positions < t0 − d) is replaced by other text of the same
length; swap_Δ = loss(altered history) − loss(true history). A target at t0 + i then has its nearest
replaced token d + i tokens back (counted from the token it is predicted from).

Every document is read after a warm prefix of stream text of random length, so chunk, segment
and block phases vary. Values are averaged per document within log-spaced distance bins, and
each bin reports the mean over documents with a 95% percentile-bootstrap interval that resamples
documents (not tokens).

``options``: the tasks and their options (``ProbeOptions``); ``samples``: the documents of each task,
rows of tokens and the comparisons between their losses; ``measure``: reading the rows through the
streaming contract and binning the comparisons by distance; ``results``: ``ProbeResult``, its
tables, JSON, merge and figure; ``command``: ``recurformer probe``. The bootstrap is
``recurformer.intervals``, shared with the evaluation."""
