"""A daemon stream's state, as GET /v1/streams shows it, and the changes it may make."""
from __future__ import annotations

import enum


class StreamState(str, enum.Enum):
    """str-valued: JSON, the API and /metrics show the value ("running"). STOPPING is never
    stored: it is what the API shows of a deleted stream whose thread has not ended yet."""
    STARTING = "starting"  # until the source delivers its first frame
    RUNNING = "running"
    RETRYING = "retrying"  # the source failed to open or deliver; retried with backoff
    FAILED = "failed"  # the source is one no retry can fix (SourceUnusable)
    ENDED = "ended"  # a file or folder came to its end
    STOPPED = "stopped"  # stopped by DELETE or the daemon's drain
    STOPPING = "stopping"

    def __str__(self) -> str:
        return self.value

    def to(self, new: StreamState) -> StreamState:
        """`new`, if a stream in this state may go there; a change not in TRANSITIONS is a bug."""
        if new not in TRANSITIONS[self]:
            raise ValueError(f"a stream does not go from {self.value} to {new.value}")
        return new

    @property
    def live(self) -> bool:
        """Whether its source is being run (its health reports still count)."""
        return self in (StreamState.STARTING, StreamState.RUNNING, StreamState.RETRYING)


_RUN_ENDS = {StreamState.FAILED, StreamState.ENDED, StreamState.STOPPED}
# a failed or ended stream may still be stopped: a DELETE that came while its run was ending
TRANSITIONS: dict[StreamState, frozenset[StreamState]] = {
    StreamState.STARTING: frozenset({StreamState.RUNNING, StreamState.RETRYING, *_RUN_ENDS}),
    StreamState.RUNNING: frozenset({StreamState.RUNNING, StreamState.RETRYING, *_RUN_ENDS}),
    StreamState.RETRYING: frozenset({StreamState.RUNNING, StreamState.RETRYING, *_RUN_ENDS}),
    StreamState.FAILED: frozenset({StreamState.STOPPED}),
    StreamState.ENDED: frozenset({StreamState.STOPPED}),
    StreamState.STOPPED: frozenset(),
    StreamState.STOPPING: frozenset(),
}
