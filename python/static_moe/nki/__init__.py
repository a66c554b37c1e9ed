"""NKI (Trainium) side of static_moe: the shim that kernels import ``nl`` / ``nisa`` from (:mod:`.shim`: the real
NKI, or the repository's NKI interpreter in development) and the dispatch of the ops to the NKI kernels
(:mod:`.dispatch`). The kernels themselves are :mod:`static_moe.nki_kernels`."""
