"""The committed stubs in appliance/serve/api/ match protos/appliance/v1/appliance.proto, and the API has its contract."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("grpc_tools", reason="grpcio-tools (dev dependency) regenerates the stubs")

from google.protobuf import descriptor_pb2  # noqa: E402

from appliance.serve.api import appliance_pb2 as pb  # noqa: E402
from appliance.serve.api.generate import API_DIR, STUB_NAMES, generate_stubs  # noqa: E402

# What only records the generator's version; another grpcio-tools release writes other numbers there.
_VERSION_MARKS = [re.compile(r"^# Protobuf Python Version: .*$", re.M),
                  re.compile(r"^GRPC_GENERATED_VERSION = .*$", re.M),
                  re.compile(r"ValidateProtobufRuntimeVersion\(.*?\n\)", re.S)]


def _normalized(text: str) -> str:
    for mark in _VERSION_MARKS:
        text = mark.sub("<version>", text)
    return text


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stubs")
    generate_stubs(out)
    return out


@pytest.mark.parametrize("name", STUB_NAMES)
def test_committed_stubs_match_the_proto(fresh, name):
    committed = (API_DIR / name).read_text()
    assert _normalized(committed) == _normalized((fresh / name).read_text()), (
        f"appliance/serve/api/{name} is stale: run `python -m appliance.serve.api.generate` (make proto) and commit it")


def test_committed_descriptor_equals_the_compiled_proto(fresh):
    namespace: dict = {}
    source = (fresh / "appliance_pb2.py").read_text()
    blob = re.search(r"AddSerializedFile\((b'.*?')\)\n", source, re.S).group(1)
    compiled = descriptor_pb2.FileDescriptorProto.FromString(eval(blob, namespace))  # noqa: S307 - our own file
    committed = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(committed)
    assert committed == compiled


def test_grpc_stub_imports_the_package_module():
    text = (API_DIR / "appliance_pb2_grpc.py").read_text()
    assert "from appliance.serve.api import appliance_pb2" in text
    assert "appliance.v1 import" not in text


def _fields(message) -> set[str]:
    return set(message.DESCRIPTOR.fields_by_name)


def test_contract_of_design_section_5():
    service = pb.DESCRIPTOR.services_by_name["Appliance"]
    assert service.full_name == "appliance.v1.Appliance"
    startup, generate = service.methods_by_name["Startup"], service.methods_by_name["Generate"]
    assert not startup.server_streaming and generate.server_streaming and not generate.client_streaming
    assert {"model_name", "arch", "device_kind", "device_count", "npu_memory_utilization", "decode_batch",
            "block_size", "max_model_len", "devices", "scratch_bytes", "bytes_per_slot", "capacity_slots",
            "max_concurrency", "kv_tokens_per_device", "limiting_device", "cache_groups",
            "resolved_config_yaml"} <= _fields(pb.StartupResponse)
    assert {"name", "total_bytes", "free_bytes", "peak_non_kv_bytes", "budget_bytes"} <= _fields(pb.DeviceMemory)
    assert {"name", "layers", "rows_per_block", "page_size_bytes", "max_blocks_per_seq", "num_blocks",
            "total_bytes", "share_of_budget", "history"} <= _fields(pb.CacheGroup)
    assert set(pb.HistoryKind.keys()) >= {"HISTORY_KIND_RING", "HISTORY_KIND_FULL"}
    assert [f.name for f in pb.GenerateRequest.DESCRIPTOR.oneofs_by_name["prompt"].fields] == ["text", "token_ids"]
    assert {"request_id", "sampling"} <= _fields(pb.GenerateRequest)
    assert {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
            "ignore_eos", "logprobs", "prompt_logprobs", "constraint"} == _fields(pb.SamplingParams)
    assert pb.SamplingParams.DESCRIPTOR.fields_by_name["seed"].has_presence
    assert {"request_id", "token_ids", "text", "finish_reason", "usage", "logprobs", "prompt_token_ids",
            "prompt_logprobs"} == _fields(pb.GenerateResponse)
    assert {"token_id", "logprob", "rank", "top"} == _fields(pb.TokenLogprob)
    assert pb.FinishReason.keys() == ["FINISH_REASON_UNSPECIFIED", "FINISH_REASON_LENGTH", "FINISH_REASON_STOP",
                                      "FINISH_REASON_EOS", "FINISH_REASON_ABORTED"]
    assert {"prompt_tokens", "completion_tokens", "cached_prompt_tokens"} == _fields(pb.Usage)
