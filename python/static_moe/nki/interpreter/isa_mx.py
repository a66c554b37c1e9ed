"""trn3 (NeuronCore-v4) MX instructions: ``nc_matmul_mx`` and ``quantize_mx``.

Not modelled yet: the x4 packed dtypes (``float8_e4m3fn_x4``, ``float8_e5m2_x4``, ``float4_e2m1fn_x4``) have
no storage in the interpreter (see :mod:`.dtypes`), so these instructions refuse with ``not-modelled`` and a
reason rather than computing something unchecked. On trn2 they do not exist (isa stub: "Available only on
NeuronCore-v4 and newer"), which is refused as ``target``.
"""

from __future__ import annotations

from .errors import NkiRuleError, check
from .state import current


def _refuse(name: str):
    check(current().spec.mx, "target", f"nisa.{name} is available only on NeuronCore-v4 (trn3); the target is "
          f"{current().spec.name}")
    raise NkiRuleError("not-modelled", f"nisa.{name}: the x4 packed MX dtypes are not modelled by the interpreter")


def nc_matmul_mx(dst, stationary, moving, stationary_scale, moving_scale, tile_position=None, tile_size=None,
                 accumulate=None, name=None):
    _refuse("nc_matmul_mx")


def quantize_mx(dst, src, dst_scale, name=None):
    _refuse("quantize_mx")
