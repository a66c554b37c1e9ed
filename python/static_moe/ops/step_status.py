"""The forward's step header: every rank's status and configuration, carried in the all-gather it already makes.

Each rank's packed send buffer ``[C, W]`` ends in ``STEP_HEADER_NBYTES`` = 64 columns; row 0 of them holds this
header (16 little-endian int32), the other rows are 0xFF. After the all-gather every rank reads the S headers
(rows 0, C, 2C, … of the gathered buffer) and reaches the same verdict from the same bytes, so every rank
either runs the rest of the step or raises — and the collectives never fall out of step (docs/errors.md).

====  ==================  ===========================================================================
word  field               meaning
====  ==================  ===========================================================================
0     magic               ``MAGIC``: the header is from this protocol (0xFFFFFFFF = a rank sent padding)
1     kind                ``OK``; ``VALUE_ERROR`` / ``TYPE_ERROR`` / ``OTHER_ERROR``: the rank's call failed
                          a host-side check, its message (UTF-8, ``length`` bytes) fills the rank's data
                          columns row by row; ``NEED_FRAME``: the rank's call is fine but no workspace of
                          the group fits it (every rank then acquires one, if all say so)
2     length / overflow   error kinds: bytes of that message; ``OK`` with the all-to-all dispatch (SPEC §7):
                          the rows this rank could not slot (past Cd), 0 otherwise
3, 4  ids_lo, ids_hi      min / max of the rank's topk_idx (−1, −1 for T = 0): computed on the device
5     bad_scale           flat index of the first x_scale that is not a positive finite number, or −1;
                          computed on the device
6…15  configuration       capacity, H, I, E, k, ep_size, formats (activation | weight << 4 | dispatch << 8
                          | combine << 12), activation
                          group, swiglu_limit and fp8_max as float32 bits (0 = no limit); −1 = unknown
                          (the rank's arguments were too malformed to tell: not compared)
====  ==================  ===========================================================================

Words 3–5 are computed with tensor ops where the inputs live, so building the header never reads a device
tensor on the host. Reading the gathered headers back is the step's one host read (free on CPU; on CUDA one
small device→host copy, i.e. a stream sync — see :func:`device_verdict` for what runs under graph capture).

This module owns the wire format and the verdict; the forward (ops/forward.py) only calls it in step order:

    before the all-gather   call_config_words, error_kind, message_bytes → build_header → write_frame
    after it                gathered_headers → decide(headers, read_messages(...)) → raise_verdict
                            (under CUDA graph capture: device_verdict, and NaN output instead of raising)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from ..workspace import STEP_HEADER_NBYTES

MAGIC = 0x314D5453  # "STM1"
OK, VALUE_ERROR, TYPE_ERROR, OTHER_ERROR, NEED_FRAME = 0, 1, 2, 3, 4
WORDS = STEP_HEADER_NBYTES // 4
CONFIG_FIELDS = (
    "capacity",
    "hidden",
    "intermediate",
    "num_experts",
    "topk",
    "ep_size",
    "formats",
    "act_group",
    "swiglu_limit",
    "fp8_max",
)
_CONFIG0 = 6
UNKNOWN = -1
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_ACT_CODES = {"bf16": 0, "fp8": 1}
_WEIGHT_CODES = {"bf16": 0, "fp8": 1, "fp4": 2}
_DISPATCH_CODES = {"all_gather": 0, "all_to_all": 1}
_COMBINE_CODES = {"fp32": 0, "bf16": 1}


def f32_bits(v: float | None) -> int:
    """float32 bits of v as a signed int32 (0 for None: a limit is never 0)."""
    if v is None:
        return 0
    return struct.unpack("<i", struct.pack("<f", v))[0]


def bits_f32(b: int) -> float:
    return struct.unpack("<f", struct.pack("<i", b))[0]


def config_words(
    capacity,
    hidden,
    intermediate,
    num_experts,
    topk,
    ep_size,
    act_format,
    weight_format,
    act_group,
    swiglu_limit,
    fp8_max,
    dispatch="all_gather",
    combine="fp32",
) -> list[int]:
    """The 10 configuration words; pass None for what is unknown."""

    def known(v):
        return UNKNOWN if v is None else int(v)

    formats = (
        UNKNOWN
        if act_format is None
        or weight_format is None
        or dispatch not in _DISPATCH_CODES
        or combine not in _COMBINE_CODES
        else (
            _ACT_CODES[act_format]
            | _WEIGHT_CODES[weight_format] << 4
            | _DISPATCH_CODES[dispatch] << 8
            | _COMBINE_CODES[combine] << 12
        )
    )
    return [
        known(capacity),
        known(hidden),
        known(intermediate),
        known(num_experts),
        known(topk),
        known(ep_size),
        formats,
        known(act_group),
        f32_bits(swiglu_limit),
        f32_bits(fp8_max),
    ]


def call_config_words(cfg: dict, call_ok: bool) -> list[int]:
    """The header's configuration words of a call whose configuration ``cfg`` gives the fields of
    :func:`config_words` by name (None: unknown). A rank whose call failed its own checks sends none (all
    unknown): its failure is reported as such, and only the calls that passed are compared with each other."""
    if not call_ok:
        return [UNKNOWN] * len(CONFIG_FIELDS)
    return config_words(
        cfg["capacity"],
        cfg["hidden"],
        cfg["intermediate"],
        cfg["num_experts"],
        cfg["topk"],
        cfg["ep_size"],
        cfg["act_format"],
        cfg["weight_format"],
        cfg["act_group"],
        cfg["swiglu_limit"],
        cfg["fp8_max"],
        cfg.get("dispatch", "all_gather"),
        cfg.get("combine", "fp32"),
    )


def error_kind(e: BaseException) -> int:
    """The header kind that reports a failed call's exception (read back as the same type by :func:`decide`)."""
    if isinstance(e, ValueError):
        return VALUE_ERROR
    if isinstance(e, TypeError):
        return TYPE_ERROR
    return OTHER_ERROR


def describe_error(e: BaseException) -> str:
    """The message a failed call sends its peers: the exception's text, after its type's name when the peers will
    not raise that type (anything but ValueError, TypeError and RuntimeError, e.g. "MemoryError: ...")."""
    if isinstance(e, (ValueError, TypeError, RuntimeError)):
        return str(e)
    return f"{type(e).__name__}: {e}"


def describe_config_word(field: str, value: int) -> str:
    if value == UNKNOWN:
        return "unknown"
    if field == "formats":
        act = {v: k for k, v in _ACT_CODES.items()}.get(value & 0xF, "?")
        wgt = {v: k for k, v in _WEIGHT_CODES.items()}.get(value >> 4 & 0xF, "?")
        dsp = {v: k for k, v in _DISPATCH_CODES.items()}.get(value >> 8 & 0xF, "?")
        cmb = {v: k for k, v in _COMBINE_CODES.items()}.get(value >> 12 & 0xF, "?")
        extra = (f", dispatch {dsp}" if value >> 8 & 0xF else "") + (f", combine {cmb}" if value >> 12 & 0xF else "")
        return f"{act} x {wgt}{extra}"  # the defaults (all-gather, fp32) unnamed
    if field == "swiglu_limit":
        return "None" if value == 0 else repr(bits_f32(value))
    if field == "fp8_max":
        return repr(bits_f32(value))
    return str(value)


_HOST_WORDS: dict = {}


def _host_words_on(device: torch.device, words: tuple[int, ...]) -> torch.Tensor:
    """int32 [16] of host-known words on ``device``, cached per (device, words) so a steady-state CUDA step makes no
    host→device copy (a pageable copy would wait for the stream)."""
    key = (str(device), words)
    t = _HOST_WORDS.get(key)
    if t is None:
        if len(_HOST_WORDS) > 256:
            _HOST_WORDS.clear()
        t = torch.tensor(words, dtype=torch.int32).to(device)
        _HOST_WORDS[key] = t
    return t


def build_header(
    device: torch.device,
    kind: int,
    length: int,
    config: list[int],
    topk_idx: torch.Tensor | None,
    x_scale: torch.Tensor | None,
) -> torch.Tensor:
    """int32 [16] on ``device``. topk_idx (int32 / int64, as the call gave it: never narrowed before this range
    check) / x_scale (this rank's, or None when its call already failed) feed the value words with tensor ops
    only; ids outside int32 saturate to its bounds, which lie outside [−1, E) too."""
    words = [MAGIC, kind, length, -1, -1, -1] + config
    host = _host_words_on(device, tuple(words))
    if kind != OK or topk_idx is None:
        return host
    parts = [host[:3]]
    if topk_idx.numel():
        # In the ids' own dtype, then saturated into int32: an int64 id of 2^32 + 1 must not wrap to a valid 1.
        lo, hi = torch.aminmax(topk_idx.reshape(-1))
        parts.append(torch.stack((lo, hi)).clamp(_INT32_MIN, _INT32_MAX).to(torch.int32))
    else:
        parts.append(host[3:5])
    if x_scale is not None and x_scale.numel():
        bad = ~(torch.isfinite(x_scale) & (x_scale > 0)).reshape(-1)
        first = torch.where(bad.any(), bad.to(torch.int32).argmax(), -1).to(torch.int32)
        parts.append(first.reshape(1))
    else:
        parts.append(host[5:6])
    parts.append(host[6:])
    return torch.cat(parts)


def write_frame(
    send: torch.Tensor, parts_width: int, header: torch.Tensor, packed: torch.Tensor | None, message: bytes = b""
) -> None:
    """Fill the uint8 [C, W] send buffer: the packed parts (or, for a failed call, 0xFF and the message), then the
    header in row 0 of the last 64 columns, 0xFF below it."""
    c = send.shape[0]
    if packed is not None:
        send[:, :parts_width].copy_(packed)
    else:
        area = torch.full((c * parts_width,), 0xFF, dtype=torch.uint8)
        if message:
            area[: len(message)] = torch.frombuffer(bytearray(message), dtype=torch.uint8)
        send[:, :parts_width].copy_(area.view(c, parts_width))
    send[1:, parts_width:].fill_(0xFF)
    send[0, parts_width:].copy_(header.view(torch.uint8))


def message_bytes(text: str, room: int) -> bytes:
    """UTF-8 of text, cut (visibly, with "…") to fit the ``room`` bytes of a rank's data columns."""
    data = text.encode("utf-8")
    if len(data) <= room:
        return data
    tail = " …".encode()
    return data[: max(0, room - len(tail))].decode("utf-8", "ignore").encode("utf-8") + tail


def gathered_headers(gathered: torch.Tensor, capacity: int, parts_width: int) -> torch.Tensor:
    """int32 [S, 16] on gathered's device: row 0 of each rank's block, header columns."""
    return gathered[::capacity, parts_width : parts_width + STEP_HEADER_NBYTES].contiguous().view(torch.int32)


def read_messages(gathered: torch.Tensor, headers: list[list[int]], capacity: int, parts_width: int) -> dict[int, str]:
    """{rank: its decoded message} for every rank whose header (host copy) reports a failed call; the message is
    read from that rank's data columns of ``gathered`` (a host read of at most its C·W bytes)."""
    out = {}
    for r, h in enumerate(headers):
        if h[0] == MAGIC and h[1] in (VALUE_ERROR, TYPE_ERROR, OTHER_ERROR):
            n = max(0, min(h[2], capacity * parts_width))
            raw = gathered[r * capacity : (r + 1) * capacity, :parts_width].reshape(-1)[:n].cpu().numpy().tobytes()
            out[r] = raw.decode("utf-8", "replace")
    return out


@dataclass
class Verdict:
    """What every rank concludes from the S headers (the same on every rank)."""

    config_diffs: list[str]  # "capacity: 4 on ranks [0]; 8 on ranks [1]"
    failures: dict[int, tuple[str, str]]  # rank -> (exception type name, message)
    need_frame: list[int]  # ranks whose call fits no workspace
    bad_magic: list[int]


def _group_by_value(values: list[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for r, v in enumerate(values):
        out.setdefault(v, []).append(r)
    return out


def decide(headers: list[list[int]], messages: dict[int, str]) -> Verdict:
    """The verdict from host copies of the S headers; ``messages`` holds the decoded message of every rank whose
    kind is an error."""
    s = len(headers)
    bad_magic = [r for r in range(s) if headers[r][0] != MAGIC]
    good = [r for r in range(s) if r not in bad_magic]
    diffs = []
    for i, field in enumerate(CONFIG_FIELDS):
        known = {r: headers[r][_CONFIG0 + i] for r in good if headers[r][_CONFIG0 + i] != UNKNOWN}
        if len(set(known.values())) > 1:
            groups = _group_by_value(list(known.values()))
            ranks = list(known)
            diffs.append(
                f"{field}: "
                + "; ".join(
                    f"{describe_config_word(field, v)} on ranks {[ranks[j] for j in js]}" for v, js in groups.items()
                )
            )
    failures: dict[int, tuple[str, str]] = {}
    need = []
    for r in good:
        h = headers[r]
        kind = h[1]
        if kind in (VALUE_ERROR, TYPE_ERROR, OTHER_ERROR):
            name = {VALUE_ERROR: "ValueError", TYPE_ERROR: "TypeError"}.get(kind, "RuntimeError")
            failures[r] = (name, messages.get(r, "(no message)"))
        elif kind == NEED_FRAME:
            need.append(r)
        elif kind == OK:
            e = h[_CONFIG0 + 3]
            lo, hi, bad = h[3], h[4], h[5]
            if lo < -1 or hi >= e:
                failures[r] = (
                    "ValueError",
                    f"forward: topk_idx must hold global expert ids in [-1, {e}) (−1 = "
                    f"empty slot), got values in [{lo}, {hi}]",
                )
            elif bad >= 0:
                groups = h[_CONFIG0 + 1] // h[_CONFIG0 + 7] if h[_CONFIG0 + 7] > 0 else 1  # H / g per row
                failures[r] = (
                    "ValueError",
                    f"forward: x_scale must hold positive finite scales, but x_scale"
                    f"[{bad // groups}, {bad % groups}] is not (NaN, Inf, 0 or negative: e.g. a NaN "
                    "or Inf in the activation it was quantized from)",
                )
        else:
            failures[r] = ("RuntimeError", f"forward: unknown step status {kind}")
    return Verdict(diffs, failures, need, bad_magic)


def _strip(msg: str) -> str:
    return msg[len("forward: ") :] if msg.startswith("forward: ") else msg


def others_error(failures: dict[int, tuple[str, str]]) -> RuntimeError:
    """The error the ranks whose own call passed raise when ``failures`` (rank -> (type name, message)) did not."""
    ranks = sorted(failures)
    detail = "; ".join(
        f"rank {r}: {_strip(failures[r][1])}" if len(ranks) > 1 else _strip(failures[r][1]) for r in ranks
    )
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
    return RuntimeError(f"forward: {who} failed: {detail}")


def raise_verdict(v: Verdict, rank: int, size: int, error: BaseException | None) -> None:
    """Raise what the verdict asks of this rank (``error``: its own call's exception, or None), or return when the
    step goes on (every rank fine; or every rank needs another workspace: ``v.need_frame`` holds all S ranks).

    In that order: ranks that sent no header (RuntimeError); configurations that differ (ValueError on every
    rank); failed calls (the failing rank raises its own error, the others :func:`others_error`); workspaces
    held on some ranks only (ValueError)."""
    if v.bad_magic:
        raise RuntimeError(
            f"forward: ranks {v.bad_magic} sent no step header (their packed rows do not come from "
            "this version of static_moe's forward); every rank of the group must run the same code"
        )
    if v.config_diffs:
        extra = ""
        if v.failures:
            extra = " (also: " + "; ".join(f"rank {r}: {_strip(m)}" for r, (_, m) in sorted(v.failures.items())) + ")"
        raise ValueError(
            f"forward: configurations differ across the EP group (group ranks {list(range(size))}): "
            + " | ".join(v.config_diffs)
            + extra
            + "; every rank must call forward with the same "
            "capacity, H, I, num_experts, top-k, formats, dispatch, combine, activation group, swiglu_limit and "
            "fp8_max"
        )
    if v.failures:
        if rank in v.failures:
            if error is not None:
                raise error
            raise ValueError(v.failures[rank][1])
        raise others_error(v.failures)
    if v.need_frame and len(v.need_frame) != size:
        others = [r for r in range(size) if r not in v.need_frame]
        raise ValueError(
            f"forward: ranks {v.need_frame} hold no workspace for this step's configuration but ranks "
            f"{others} do: workspaces were acquired or closed on some ranks only (acquire and close "
            "them on every rank of the group, in the same order)"
        )


def overflow_ranks(headers: list[list[int]]) -> list[int]:
    """Ranks whose (OK) header reports rows it could not slot with the all-to-all dispatch (SPEC §7)."""
    return [r for r, h in enumerate(headers) if h[0] == MAGIC and h[1] == OK and h[2] > 0]


def device_overflow(headers: torch.Tensor) -> torch.Tensor:
    """bool [] on the headers' device: :func:`overflow_ranks` is not empty (for CUDA graph capture)."""
    h = headers.to(torch.int64)
    return ((h[:, 0] == MAGIC) & (h[:, 1] == OK) & (h[:, 2] > 0)).any()


def device_verdict(headers: torch.Tensor) -> torch.Tensor:
    """bool [] on the headers' device: whether any rank's header says the step must not give results.

    For CUDA graph capture, where the host cannot read the headers: the forward then runs both collectives as
    always and fills its output with NaN when this is true, so a failed step is never silent and never hangs.
    """
    h = headers.to(torch.int64)
    cfg = h[:, _CONFIG0:]
    bad = (h[:, 0] != MAGIC) | (h[:, 1] != OK) | (h[:, 3] < -1) | (h[:, 4] >= cfg[:, 3]) | (h[:, 5] >= 0)
    return bad.any() | (cfg != cfg[:1]).any()
