"""The most frames per second the stream pipeline could give: what bench/bench.py's pipeline
section compares the measured rate with; tests/test_bench_bound.py checks the arithmetic."""
from __future__ import annotations


def pipeline_bound(stage_s: dict[str, float], prepare_workers: int, cores: int) -> float:
    """The most frames per second the pipeline could give, from the stage times per frame
    (seconds, mean busy time per item, measured while the stages overlap).

    Each stage bounds it by its threads over its time: prepare runs on a pool of
    `prepare_workers` threads (prepare_workers / prepare), encode and decode on one each
    (1 / encode, 1 / decode). The CPU bounds it too: each frame costs the sum of its stage
    times in core-seconds (one onnxruntime thread per graph), and only `cores` cores run
    them (cores / sum); on 2 cores this is usually the tighter bound. It is honest only as
    far as the stage times are: it leaves out the source's reader thread, the GIL between
    the stage threads, and anyone else's work on a shared machine, so the pipeline may
    fall short of it, not exceed it by much."""
    per_thread = [stage_s["prepare"] / prepare_workers] + [t for stage, t in stage_s.items() if stage != "prepare"]
    return min(1 / max(per_thread), cores / sum(stage_s.values()))
