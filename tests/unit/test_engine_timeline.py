"""The engine's timeline records: a recovery step survives its JSON form and comes back."""

from __future__ import annotations

import json

import pytest

from ftengine.faults import Fault, FaultKind
from ftengine.timeline import StepRecord, TimelineBuilder


def test_a_step_reads_back_from_its_json_form() -> None:
    failed = StepRecord("comm_rebuild", 2, 10.0, 10.25, "DeviceError: link lost")
    running = StepRecord("validate", 1, 11.0)
    for step in (failed, running):
        assert StepRecord.from_dict(json.loads(json.dumps(step.to_dict()))) == step
    assert StepRecord.from_dict(json.loads(json.dumps(failed.to_dict()))).seconds == 0.25


def test_every_step_of_a_timeline_reads_back() -> None:
    log = TimelineBuilder(1, Fault(FaultKind.DEAD_PEER, rank=3, at=5.0), 5.5)
    log.end_step(log.begin_step("quarantine", 0, 5.5), 5.75)
    log.begin_step("mask", 1, 6.0)
    steps = json.loads(json.dumps(log.snapshot().to_dict()))["steps"]
    assert tuple(StepRecord.from_dict(raw) for raw in steps) == log.snapshot().steps


def test_missing_optional_fields_default_and_a_wrong_shape_raises() -> None:
    assert StepRecord.from_dict({"name": "detect", "start": 1}) == StepRecord("detect", 0, 1.0)
    with pytest.raises(KeyError):
        StepRecord.from_dict({"name": "detect"})
    with pytest.raises(ValueError):
        StepRecord.from_dict({"name": "detect", "start": "soon"})
