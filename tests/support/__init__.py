"""What tests and scripts share: the load fuzzer (``fuzzing``) and the PyTorch LLaMA peer
(``torch_llama``). Test machinery, never installed: tests import it as ``tests.support.NAME``
(``pythonpath = ["."]`` in pyproject.toml's pytest settings), and so do the scripts, run from the
repository's root as ``python -m scripts.NAME``."""
