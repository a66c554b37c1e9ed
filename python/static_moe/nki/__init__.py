"""NKI (Trainium) side of static_moe: the interpreter of the NKI subset our kernels use
(:mod:`.interpreter`) and the shim that kernels import ``nl`` / ``nisa`` from (:mod:`.shim`)."""
