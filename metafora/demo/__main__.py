"""``python -m metafora.demo worker``: the demo's worker process."""

from metafora.demo.worker import worker_main

worker_main()
