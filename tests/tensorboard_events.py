"""Reads the TensorBoard event files the metric writer tests write."""

from __future__ import annotations

import pathlib
import struct


def read_events(
    logdir: pathlib.Path,
) -> tuple[dict[str, dict[int, float]], dict[str, dict[int, str]]]:
    """(scalars, texts) of TensorBoard event files: ``{tag: {step: value}}`` each
    (TFRecord framing: length, crc, data, crc)."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, dict[int, float]] = {}
    texts: dict[str, dict[int, str]] = {}
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                if value.HasField("tensor"):
                    text = b"".join(value.tensor.string_val).decode()
                    texts.setdefault(value.tag, {})[event.step] = text
                else:
                    scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars, texts
