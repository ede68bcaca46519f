"""Training, as one loop run by every command that trains (``loop.run_loop``): ``train``'s
stateful segment training (``trainer.Trainer``) and ``synth``'s task training
(``recurformer.synth.job``) are jobs of that loop.

- ``config``: the run config (model, data and train sections) and its merging;
- ``parts``: the training state as named parts, saved to and restored from one checkpoint;
- ``signals``: SIGINT/SIGTERM finish the step and save; ``ranks``: processes under ``torchrun``;
- ``data``: the run's prepared data; ``meter``: tokens/s, mfu and the run's logs;
- ``steps``: one optimizer step of stateful segment training; ``trainer``: a run of it;
- ``command``: ``recurformer train``.
"""
