"""Length-extrapolation evaluation (Liang, "Block-wise Recurrent Transformer",
§5.1): for each length L the model reads windows of L tokens chunk by chunk through the streaming
contract (so memory stays bounded for recurrent models at any L) and the loss / accuracy is taken
on the last ``last`` tokens of each window only.

The scored set is deterministic and shared by every model and length: the windows end at fixed
positions, ``last`` tokens apart, so their scored blocks tile the evaluation text after the first
``context`` tokens (the whole validation split by default; ``windows=K`` keeps K of them, evenly
spaced; ``recurformer eval`` and ``api.evaluate`` keep ``DEFAULT_WINDOWS`` unless asked for all).
Lengths therefore differ only in how much history the model read, and two checkpoints
evaluated on the same text score the same tokens. The 95% interval is a percentile bootstrap over
documents (the text's BOS-separated documents; over the windows instead when no BOS is known or
the scored tokens lie in fewer than ``MIN_DOCUMENTS`` documents, as in one long book) with a fixed
bootstrap seed: the mean loss is the total loss over the total token count of the resampled
units; a paired difference resamples the same units for both models.

``lengths``: the measurement and its options (``LengthOptions``, ``evaluate_lengths``), the
evaluation text; ``results``: what each length measured, paired differences, the table, JSON and
figure; ``command``: ``recurformer eval`` (``EvalOptions``, ``evaluate_checkpoints``). The
bootstrap itself is ``recurformer.intervals``, shared with the probe."""
