"""The benchmark, profiling and data scripts: modules of the repository, each run from its root
as ``python -m scripts.NAME`` (``--help`` gives its options). What they share lives in
``scripts/_measure.py`` (threads, shapes, timing, the machine's peaks) and ``tests/support/``
(the load fuzzer, the PyTorch LLaMA peer)."""
