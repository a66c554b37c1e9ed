"""Testing helpers shipped with the package: numerics (SPEC §2 tolerances), input generators, the machine's
measured limits (roofline) and gloo multi-rank runs."""
