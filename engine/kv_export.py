"""Which of a finished request's prompt KV the engine hands back with its last output.

A request asks for it with `export_kv_from` (a position) and a `KVExport` part:

    prompt    [ export_kv_from .. prompt end )   PD prefill side: what the decode side lacks
    computed  [ max(from, cached) .. end )       what this engine computed (the cache did not
                                                 serve it): write-through of every prompt
    reused    [ from .. cached )                 what the prefix cache served: blocks used a
                                                 second time, the selective write-through

`cached` is the prefix the cache served at admission (whole blocks). The real engine and the
simulated one both take their range from `export_range`.
"""

from __future__ import annotations

import enum


class KVExport(enum.Enum):
    PROMPT = "prompt"
    COMPUTED = "computed"
    REUSED = "reused"


def export_range(part: KVExport, start: int, cached: int, prompt_len: int) -> tuple[int, int]:
    """The prompt positions [begin, end) to export; empty when begin >= end."""
    if part is KVExport.COMPUTED:
        return max(start, cached), prompt_len
    if part is KVExport.REUSED:
        return start, min(cached, prompt_len)
    return start, prompt_len
