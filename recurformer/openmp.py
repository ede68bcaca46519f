"""OpenMP's wait policy, decided before torch loads its OpenMP runtime.

OpenMP's default wait policy lets an idle thread spin (libgomp: ~300,000 spins, a few ms) before
it sleeps; on a CPU shared with another busy process a spinning thread holds the core the other
threads of the same parallel region wait for, and every region stalls (benchmarks/threads.py:
generation and a training step ~20x slower on a loaded 2-core machine with 2 threads, as fast as
1 thread or faster with passive waiting). The runtime reads ``OMP_WAIT_POLICY`` and
``GOMP_SPINCOUNT`` once, when torch loads it, and has no call to change them later. Importing this
module first (``recurformer/__init__.py`` does) sets ``OMP_WAIT_POLICY=PASSIVE`` unless the user
set a policy, which holds where recurformer is imported before torch (the command line); where
torch came first, ``SPINNING`` records that the runtime already runs with the spinning default, and
``device.cpu_threads`` then keeps torch's threads to the CPUs that are idle. Nothing here imports
torch."""

import os
import sys

USER_POLICY = "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ
SPINNING = "torch" in sys.modules and not USER_POLICY  # torch loaded OpenMP with its default policy
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # for torch loaded after this, and subprocesses
