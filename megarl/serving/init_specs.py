"""The receive specs in a weight-bridge init body, decoded: what each inference worker is told at connect.

The trainer's bridge packs them (:class:`megarl.bridge.schedule.ReceiverSpecs`, whose docstring gives the
format); the receivers (:mod:`megarl.bridge.receiver`) and the trainer's SGLang control handles
(:mod:`megarl.serving.sglang`, which drives SGLang's per-bucket receive calls) read them back with
:func:`worker_specs`. Here, below both, so that either may.
"""

from __future__ import annotations

import base64
import functools
import itertools
import json
import zlib


def expand_template(template: dict, senders: list[int]) -> dict:
    """A sharded template with each message's slot replaced by its sender: the plain spec."""
    rounds = [[[senders[j], pieces] for j, pieces in msgs] for msgs in template["rounds"]]
    return {**template, "sender_ranks": list(template["sender_ranks"]), "rounds": rounds}


@functools.lru_cache(maxsize=16)
def unpack_part(packed: str) -> dict:
    """The part of :func:`megarl.bridge.schedule._pack` (a sharded template back in rows), decoded once per distinct part
    (the trainer's SGLang controls hold one body per server, all naming the same part: one copy).
    Do not modify it."""
    part = json.loads(zlib.decompress(base64.b64decode(packed)))
    return from_columns(part) if "columns" in part else part


def _undelta(deltas: list[int]) -> list[int]:
    return list(itertools.accumulate(deltas))


def from_columns(part: dict) -> dict:
    """The sharded template (in rows) of one in columns (:meth:`megarl.bridge.schedule.ReceiverSpecs._sharded_template`)."""
    names, shapes, paddings, kinds = part["names"], part["shapes"], part["paddings"], part["kinds"]
    columns = part["tensors"]
    tensors = [
        [names[n], None if e < 0 else e, list(shapes[s]), [list(r) for r in paddings[p]]]
        for n, e, s, p in zip(
            _undelta(columns["name"]), _undelta(columns["expert"]), columns["shape"], columns["padding"]
        )
    ]
    rounds = [
        [[j, [[slot, *kinds[k]] for slot, k in zip(_undelta(slots), ks)]] for j, slots, ks in messages]
        for messages in part["rounds"]
    ]
    return {
        "mode": "sharded",
        "senders": part["senders"],
        "sender_ranks": part["sender_ranks"],
        "tensors": tensors,
        "rounds": rounds,
    }


def worker_specs(specs: dict, shared: dict | None, rank: int) -> dict:
    """``{mode: plain spec}`` of TP rank ``rank`` from an init body's ``specs`` and ``shared``
    (plain specs, the format before packing, are taken as they are)."""
    out = {}
    for mode, spec in specs[str(rank)].items():
        if "packed" not in spec:
            out[mode] = spec
            continue
        part = unpack_part((shared or {})[spec["packed"]])
        out[mode] = expand_template(part, spec["senders"]) if part["mode"] == "sharded" else part
    return out
