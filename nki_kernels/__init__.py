"""The NKI (Trainium) kernels, one module per op (docs/backends/nki.md). The repository keeps them in its
top-level ``nki_kernels/``; they install as ``static_moe.nki_kernels`` (setup.py's ``package_dir``). Each kernel
imports ``nl`` / ``nisa`` from ``static_moe.nki.shim``, so importing one needs a real ``nki`` or, in a development
checkout, the repository's NKI interpreter (``tools/`` on ``sys.path``); without either it raises ImportError."""
