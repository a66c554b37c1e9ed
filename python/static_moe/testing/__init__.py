"""Testing helpers shipped with the package: numerics (SPEC §2 tolerances) and input generators."""
