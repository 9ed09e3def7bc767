"""Writes tests/fixtures/tensorboard/events.bin with TensorBoard's own Python writer (its RecordWriter and Event
protos), then reads it back with TensorBoard's own reader: the events src/telemetry/tensorboard.rs's test writes and
compares byte for byte. The wall times are fixed (a real writer stamps the clock) so that the bytes repeat.

  python3 -m venv /tmp/tbenv && /tmp/tbenv/bin/pip install tensorboard==2.21.0
  /tmp/tbenv/bin/python scripts/make_tensorboard_fixture.py
"""

import io
import sys

from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.record_writer import RecordWriter

OUT = "tests/fixtures/tensorboard/events.bin"


def scalars(wall_time, step, values):
    summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=t, simple_value=v) for t, v in values])
    return event_pb2.Event(wall_time=wall_time, step=step, summary=summary)


def main():
    events = [
        event_pb2.Event(wall_time=1_700_000_000.25, file_version="brain.Event:2"),
        scalars(1_700_000_001.5, 10, [("train/loss", 2.5), ("train/lr", 0.001), ("train/acceptance_length", 1.75)]),
        scalars(1_700_000_002.0, 0, [("eval/decoded_acceptance_length", 3.125)]),
        scalars(1_700_000_003.0, 1_234_567, [("train/loss", -0.0625)]),
    ]
    buffer = io.BytesIO()
    writer = RecordWriter(buffer)
    for e in events:
        writer.write(e.SerializeToString())
    with open(OUT, "wb") as f:
        f.write(buffer.getvalue())

    # Read back as TensorBoard reads a run folder's files.
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    read = list(EventFileLoader(OUT).Load())
    assert [e.step for e in read] == [0, 10, 0, 1_234_567], read
    assert read[1].summary.value[2].tag == "train/acceptance_length"
    print(f"wrote {OUT}: {len(buffer.getvalue())} bytes, {len(read)} events read back", file=sys.stderr)


if __name__ == "__main__":
    main()
