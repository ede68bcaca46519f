"""``recurformer synth``, the synthetic diagnostics ("The Recurrent Transformer: Greater Effective Depth and Efficient
Decoding", §"Synthetic diagnostics"): train a small model of any registered architecture on one task
of ``recurformer.data.synthetic`` and report its test accuracy.

Protocol. For every learning rate of a small sweep, a fresh model (same seed) is trained with
AdamW (``optim.make_optimizer``; betas 0.9/0.98 as in that paper's appendix) and warmup + cosine
(``optim.lr_at``) for a budget of optimizer steps over a fixed training set; the learning rate
with the best accuracy on a validation split is selected, and its test accuracy is reported
(train, validation and test rows are disjoint). Evaluation reads every row through the streaming
contract, ``chunk`` tokens per call with the state carried, teacher-forced argmax at the scored
positions; so a passkey at L = 16384 costs bounded memory for a bounded-state model. Tasks with a
length (passkey filler, copy string, copy delay, MQAR distance) are also tested at every ``eval_lengths`` value,
including lengths never trained. Compression is read through MAD's AutoEncoder head
(``learner.CompressionDecoder``): every token is decoded from the model's features at the last position.

Metrics. ``token_accuracy`` is *micro* (correct scored tokens / scored tokens);
``macro_accuracy`` is the per-class recall averaged over target classes present (what MAD's
torchmetrics ``MulticlassAccuracy`` reports by default); ``exact_match`` is the fraction of rows
whose scored tokens are all correct (the paper's "sequence-level accuracy"). The headline
``accuracy`` is micro token accuracy for MAD tasks and exact match for copy, delayed copy and
passkey.

Model. The paper's synthetic setting (one layer, width 128, MLP 512, 16 heads) unless overridden;
the field that bounds each model's direct reach (``ModelConfig.context_field``: window, chunk,
segment or block length; llama's ``window=None`` stays full attention, the Recurrent Transformer
has none) is set to ``context`` (32 by default), so a bounded model must use its state on tasks
longer than that.

Recipes for memory (``recurformer.curriculum``): ``schedule`` changes the task length or the
truncation by step (a curriculum), ``train_lengths`` draws each batch's length from a range
(mixed lengths; with a length schedule, from its low end up to the stage's length), ``state_init``
starts each training row from a noisy state or another row's final state, and ``truncation``
backpropagates through that many segments of ``context`` tokens before detaching
(``learner.Learner.backward``). Any of the first two, or ``fresh_data``, draws the
training rows fresh for every batch (``job.FreshRows``), disjoint from every held-out row; so does
``train_settings``, task-parameter settings a batch draws one of (Zoology's mixture of (seq_len,
num_pairs), task ``mqar_zoology``), and ``eval_settings`` tests the model at more settings after
training (the result's ``by_setting``). Validation and test rows are at the task's own parameters, or at
the length a schedule ends at (a curriculum is scored at the length it trains towards).

Modules: ``config`` (the protocol's settings and the recipe checks), ``learner`` (the model and its
read-out, scored), ``job`` (one learning rate's training as a job of the one training loop,
``recurformer.training.loop``, its progress saved through the training parts), ``run`` (the
sweep, the tests, the result), ``command`` (``recurformer synth``).
"""
