"""dk.h's `dk_layer` (the static arguments of attn.c `dk_decode_layer`) mirrored as a ctypes Structure, and the
check every library load makes that the two agree field for field. Imports nothing of the package, so the build can
run it."""

from __future__ import annotations

import ctypes

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class DkLayer(ctypes.Structure):
    """dk.h `dk_layer`, field for field."""

    _fields_ = [  # noqa: RUF012  (ctypes' own class attribute)
        ("a_fn", _P), ("a_scale", _P), ("a_base", _P), ("iters", _I), ("hc_eps", _F), ("norm_eps", _F),
        ("a_norm", _P), ("fa", _I), ("wa", _P), ("sa", _P), ("q_norm", _P), ("Q", _I), ("fb", _I), ("wb", _P),
        ("sb", _P), ("H", _I), ("D", _I), ("fk", _I), ("wk", _P), ("sk", _P), ("kv_norm", _P), ("rd", _I),
        ("eps", _F), ("scale", _F), ("P", _I), ("pf", _P), ("pw", _P), ("ps", _P), ("pn", _P),
        ("ring", _P), ("wl", _I), ("pool", _P), ("epb", _I), ("sink", _P), ("wo_a", _P), ("G", _I), ("R", _I),
        ("fo", _I), ("wo", _P), ("so", _P), ("C", _I), ("states", _P * 10), ("W", _I * 2), ("rows", _I * 2),
        ("cepb", _I * 2), ("cm", _I * 2), ("cd", _I * 2), ("ceps", _F * 2),
        ("f_fn", _P), ("f_scale", _P), ("f_base", _P), ("f_norm", _P), ("gate_w", _P), ("E", _I), ("bias", _P),
        ("K", _I), ("route_scale", _F), ("limit", _F), ("I", _I), ("e_lo", _I), ("e_n", _I), ("fmt_r", _I),
        ("r", _P), ("fmt_s", _I), ("s", _P), ("n", _I), ("dim", _I)]


class DkMtpIn(ctypes.Structure):
    """attn.c `dk_mtp_in` (dk_mtp_pass's MTP-input arguments), field for field."""

    _fields_ = [  # noqa: RUF012
        ("embed", _P), ("ebf16", _I), ("V", _I), ("enorm", _P), ("hnorm", _P), ("eps", _F), ("fe", _I), ("we", _P),
        ("se", _P), ("fh", _I), ("wh", _P), ("sh", _P)]


class DkHead(ctypes.Structure):
    """attn.c `dk_head` (dk_mtp_pass's LM-head arguments), field for field."""

    _fields_ = [  # noqa: RUF012
        ("fn", _P), ("scale", _P), ("base", _P), ("hc_eps", _F), ("norm_eps", _F), ("norm_w", _P), ("fmt", _I),
        ("w", _P), ("s", _P), ("V", _I)]


def layout_mismatch(lib: ctypes.CDLL, struct: type[ctypes.Structure] = DkLayer) -> str | None:
    """Where `struct` (DkLayer) differs from the library's dk_layer (attn.c dk_layer_layout: its size and every
    field's offset), else None. The library's loader refuses a library where it does."""
    fields = struct._fields_
    out = (ctypes.c_int64 * (len(fields) + 1))()
    n = lib.dk_layer_layout(out, len(fields) + 1)
    if n != len(fields):
        return f"dk_layer has {n} fields, {struct.__name__} {len(fields)}"
    if out[0] != ctypes.sizeof(struct):
        return f"sizeof(dk_layer) {out[0]}, ctypes.sizeof({struct.__name__}) {ctypes.sizeof(struct)}"
    for i, (name, _) in enumerate(fields):
        if out[i + 1] != getattr(struct, name).offset:
            return f"field {name}: offset {out[i + 1]} in C, {getattr(struct, name).offset} in {struct.__name__}"
    return None
