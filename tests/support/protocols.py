"""Read by mypy only (tests/test_mypy.py): the classes that must satisfy each Protocol do, checked statically."""

from __future__ import annotations

from appliance.engine.engine import Engine
from appliance.engine.process.client import EngineProcessClient
from appliance.serve.state import EngineClient
from npu.device_group import DeviceGroup
from npu.runner import ModelRunner
from npu.step import StepExecutor


def engine_serves_the_front_ends(engine: Engine) -> EngineClient:
    return engine


def engine_process_serves_the_front_ends(client: EngineProcessClient) -> EngineClient:
    return client


def runners_and_device_groups_run_steps(runner: ModelRunner, group: DeviceGroup) -> list[StepExecutor]:
    return [runner, group]
