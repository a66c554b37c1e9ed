"""Collective loading: read or store weights on every rank of the EP group, so that an error on one rank raises on
every rank (through ``workspace.converge``) and no rank returns a layer its peers do not have."""

from __future__ import annotations

from .. import workspace as _workspace


def collectively(ep_group, size: int, stage: str, fn, cleanup=None, others_error=None):
    """``fn()`` on every rank; if it raised on any rank, every rank raises (``workspace.converge``, with its
    ``others_error``) after ``cleanup()`` (e.g. giving back a workspace lease), so no rank returns a layer its peers
    do not have."""
    result, error = None, None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001  (any failure must reach the other ranks)
        error = e
    try:
        if size > 1:
            _workspace.converge(ep_group, error, stage, others_error)
        elif error is not None:
            raise error
    except BaseException:
        if cleanup is not None:
            cleanup()
        raise
    return result
