"""Alerts: named questions a daemon stream asks about its frames, read as true / false /
unknown, debounced, and announced when they change.

    a frame the stream submits ─► StreamAlerts.ask: each alert that is due (every N frames,
        the stream not behind or the alert at its floor, fewer than ALERT_INFLIGHT of its
        questions unanswered, a place free) ─► a question riding with the frame's own request
        (Request.followers: the frame decoded, scheduled and encoded once for all of them,
        the questions decoded beside it, each reusing the image's prompt prefix)
    its answer (decode thread) ─► Rule.read: "true" | "false" | "unknown"
        ─► Debounce: on_after true / off_after false readings in a row change the state
        ─► an event {"stream", "alert", "state", "frame", "time"}: the stream's SSE
           listeners (`event: alert`) and the alert's webhook (WebhookSender)

The stream's own answers come first: alerts take the capacity that is spare. An alert due
on a frame the stream is behind on (the frame waited for a place of the stream's: the
source delivers faster than the stream answers, edgemm.streams.run), or on one of the
SPARE_AFTER - 1 frames after it, is deferred to the next frame (counted), unless it has
gone max(every, max_every) frames without being asked: that floor keeps a saturated
stream's alerts alive at a cost bounded by (number of alerts) / max_every questions per
frame, and it is what they cost a stream that has no capacity to spare. A stream that keeps up with its source (a camera with compute left over) asks every
alert on every frame it is due.

What is fair and bounded. The stream's own prompt keeps its share of the pipeline
(edgemm.streams.manager.STREAM_SHARE frames in flight) untouched: alert questions have places of
their own, ALERT_SHARE per stream, and an alert has at most ALERT_INFLIGHT questions in
flight. An alert that is due when it has that many unanswered, or no place is free, is
asked on the next frame instead (counted as skipped); the alerts that waited longest go
first. A reading about an older frame than one already read (overtaken) is left out.
Nothing waits for a place: asking never slows the stream's own frames down beyond the
pipeline work the questions are. Riding with a frame, a question takes no inbox place of
the pipeline's; asked without one (`ask` with no leader) it is a request of its own, for
which the daemon's pipeline keeps max_streams × ALERT_SHARE inbox places
(edgemm.streams.manager.reserved_places), so they never crowd out the API. A frame the pipeline
refuses takes its questions with it: never asked, they are counted as skipped.

A webhook is a thread of its own with a bounded queue: when it falls behind (an endpoint
that is slow, down or hangs), the oldest events are dropped and counted; the stream never
waits for it. Each attempt has a deadline of timeout_s as a whole (every connect, write and
read of it gets what is left: edgemm.net.outbound), and only the reply's status and at most
REPLY_BYTES of its body are read. A closed webhook delivers what it holds for at most one
timeout_s more, then drops the rest; at most MAX_DRAINING closed webhooks drain at once
(another is abandoned at once: its connection, or its connect in progress, shut and its
queue dropped, so its thread ends within moments even against a host that drops SYNs).
Its token comes from an environment variable or an owner-only file, as the offload
client's key does, and is sent only in the Authorization header.

    rules.py     an answer → true / false / unknown
    schedule.py  which frames ask (every, the floor, the places), the debounced state: StreamAlerts
    webhook.py   the bounded queue and the thread that sends it: WebhookSender
    metrics.py   the figures on /metrics
"""
