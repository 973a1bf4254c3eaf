"""Proto <-> core conversions, in one place for the server and the client (both directions of every enum).

StartupReport <-> StartupResponse, SamplingParams <-> proto SamplingParams, GenerateRequest -> prompt,
RequestOutput <-> GenerateResponse, EngineStats -> StatsResponse.
"""

from __future__ import annotations

from typing import Sequence

from appliance.core.constraint import ConstraintKind, OutputConstraint
from appliance.core.planner import CapacityPlan, DeviceBudget, GroupPlan
from appliance.core.request import (
    FinishReason,
    RequestError,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
    Usage,
)
from appliance.core.startup_report import StartupReport
from appliance.engine.stats import EngineStats, HistogramSnapshot
from appliance.serve.api import appliance_pb2 as pb

_FINISH = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.ABORTED: pb.FINISH_REASON_ABORTED,
}
_FINISH_FROM_PB = {v: k for k, v in _FINISH.items()}
_HISTORY = {"ring": pb.HISTORY_KIND_RING, "full": pb.HISTORY_KIND_FULL}
HISTORY_NAMES = {v: k for k, v in _HISTORY.items()}      # proto enum -> "ring" | "full"


def startup_response(report: StartupReport) -> pb.StartupResponse:
    """The Startup answer: everything the engine resolved and allocated, from its StartupReport."""
    plan = report.plan
    return pb.StartupResponse(
        model_name=report.model_name, arch=report.arch, device_kind=report.device_kind,
        device_count=report.device_count, npu_memory_utilization=plan.utilization,
        decode_batch=plan.decode_batch, block_size=plan.block_size, max_model_len=plan.max_model_len,
        devices=[pb.DeviceMemory(name=d.name, total_bytes=d.total_bytes, free_bytes=d.free_bytes,
                                 peak_non_kv_bytes=d.peak_non_kv_bytes, usable_bytes=d.usable_bytes,
                                 budget_bytes=d.budget_bytes, headroom_bytes=d.headroom_bytes,
                                 non_torch_margin_bytes=d.non_torch_margin_bytes)
                 for d in plan.devices],
        scratch_bytes=plan.scratch_bytes, bytes_per_slot=plan.bytes_per_slot, capacity_slots=plan.capacity_slots,
        max_concurrency=plan.max_concurrency, kv_tokens_per_device=plan.kv_tokens_per_device,
        limiting_device=plan.limiting_device, budget_bytes=plan.budget_bytes, kv_cache_bytes=plan.kv_cache_bytes,
        cache_groups=[pb.CacheGroup(name=g.name, layers=g.num_layers, rows_per_block=g.rows_per_block,
                                    page_size_bytes=g.page_size_bytes, max_blocks_per_seq=g.max_blocks_per_seq,
                                    num_blocks=g.num_blocks, total_bytes=g.bytes, share_of_budget=g.share_of_budget,
                                    history=_HISTORY.get(g.history, pb.HISTORY_KIND_UNSPECIFIED))
                      for g in plan.groups],
        resolved_config_yaml=report.resolved_config_yaml, weights=report.weights, override=plan.override or "",
        load_seconds=report.load_seconds, profile_seconds=report.profile_seconds,
        allocate_seconds=report.allocate_seconds, notes=list(report.notes),
    )


def startup_report(msg: pb.StartupResponse) -> StartupReport:
    """The inverse of startup_response, so the client prints the same tables as the server (every number)."""
    plan = CapacityPlan(
        utilization=msg.npu_memory_utilization, decode_batch=msg.decode_batch, max_model_len=msg.max_model_len,
        block_size=msg.block_size,
        devices=tuple(DeviceBudget(d.name, d.total_bytes, d.free_bytes, d.peak_non_kv_bytes, d.non_torch_margin_bytes,
                                   d.usable_bytes, d.budget_bytes, d.headroom_bytes) for d in msg.devices),
        limiting_device=msg.limiting_device, budget_bytes=msg.budget_bytes, scratch_bytes=msg.scratch_bytes,
        bytes_per_slot=msg.bytes_per_slot, capacity_slots=msg.capacity_slots,
        groups=tuple(GroupPlan(g.name, HISTORY_NAMES.get(g.history, "?"), g.layers, g.rows_per_block,
                               g.page_size_bytes, g.max_blocks_per_seq, g.num_blocks, g.total_bytes, g.share_of_budget)
                     for g in msg.cache_groups),
        kv_cache_bytes=msg.kv_cache_bytes, unused_bytes=msg.budget_bytes - msg.scratch_bytes - msg.kv_cache_bytes,
        kv_tokens_per_device=msg.kv_tokens_per_device, max_concurrency=msg.max_concurrency,
        override=msg.override or None, data_parallel_size=msg.max_concurrency // max(msg.capacity_slots, 1))
    return StartupReport(model_name=msg.model_name, arch=msg.arch, device_kind=msg.device_kind,
                         device_count=msg.device_count, plan=plan, resolved_config_yaml=msg.resolved_config_yaml,
                         weights=msg.weights, load_seconds=msg.load_seconds, profile_seconds=msg.profile_seconds,
                         allocate_seconds=msg.allocate_seconds, notes=tuple(msg.notes))


def output_constraint(msg: pb.OutputConstraint) -> OutputConstraint | None:
    """Proto constraint -> the engine's; errors (checked later by validate_request) name sampling.constraint.<kind>."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    field = f"sampling.constraint.{kind}"
    if kind == "json_schema":
        return OutputConstraint.json_schema(msg.json_schema, field=field)
    if kind == "json_object":
        if not msg.json_object:
            raise RequestError(field, "must be true (leave the constraint unset for unconstrained output)")
        return OutputConstraint.json_object(field=field)
    if kind == "regex":
        return OutputConstraint.regex(msg.regex, field=field)
    if kind == "grammar":
        return OutputConstraint.grammar(msg.grammar, field=field)
    return OutputConstraint.choice(list(msg.choice.choices), field=field)


def constraint_message(constraint: OutputConstraint) -> pb.OutputConstraint:
    kind = constraint.kind
    if kind is ConstraintKind.JSON_OBJECT:
        return pb.OutputConstraint(json_object=True)
    if kind is ConstraintKind.CHOICE:
        return pb.OutputConstraint(choice=pb.Choices(choices=list(constraint.choices)))
    if kind is ConstraintKind.REGEX:
        return pb.OutputConstraint(regex=constraint.text)
    if kind is ConstraintKind.GRAMMAR:
        return pb.OutputConstraint(grammar=constraint.text)
    return pb.OutputConstraint(json_schema=constraint.text)


def sampling_params(msg: pb.SamplingParams) -> SamplingParams:
    """Proto sampling -> engine SamplingParams; unset optional fields take the engine's defaults."""
    default = SamplingParams()
    return SamplingParams(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else default.max_tokens,
        temperature=msg.temperature,
        top_p=msg.top_p if msg.HasField("top_p") else default.top_p,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop), stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        constraint=output_constraint(msg.constraint) if msg.HasField("constraint") else None,
    )


def request_prompt(req: pb.GenerateRequest) -> str | list[int]:
    which = req.WhichOneof("prompt")
    if which == "text":
        return req.text
    if which == "token_ids":
        return list(req.token_ids.ids)
    raise RequestError("prompt", "set either prompt text or token_ids")


def token_logprob_message(lp: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
                           top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def token_logprob(msg: pb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(msg.token_id, msg.logprob, msg.rank, tuple((t.token_id, t.logprob) for t in msg.top))


def generate_response(out: RequestOutput) -> pb.GenerateResponse:
    """A delta as the Generate stream sends it; the prompt's first logprob (None: nothing precedes the first token)
    is left out, as the proto's repeated field cannot hold it."""
    msg = pb.GenerateResponse(request_id=out.request_id, token_ids=out.new_token_ids, text=out.new_text,
                              logprobs=[token_logprob_message(lp) for lp in out.logprobs or ()])
    if out.prompt_logprobs is not None:
        msg.prompt_token_ids.extend(out.prompt_token_ids or ())
        msg.prompt_logprobs.extend(token_logprob_message(lp) for lp in out.prompt_logprobs[1:] if lp is not None)
    if out.finish_reason is not None:
        msg.finish_reason = _FINISH[FinishReason(out.finish_reason)]
    if out.usage is not None:
        msg.usage.prompt_tokens = out.usage.prompt_tokens
        msg.usage.completion_tokens = out.usage.completion_tokens
        msg.usage.cached_prompt_tokens = out.usage.cached_prompt_tokens
    return msg


def to_output(msg: pb.GenerateResponse) -> RequestOutput:
    """A GenerateResponse as the engine's RequestOutput, so gRPC and offline results compare directly."""
    usage = None
    if msg.HasField("usage"):
        usage = Usage(msg.usage.prompt_tokens, msg.usage.completion_tokens, msg.usage.cached_prompt_tokens)
    prompt = None
    if msg.prompt_token_ids:
        prompt = (None, *(token_logprob(lp) for lp in msg.prompt_logprobs))
    return RequestOutput(request_id=msg.request_id, new_token_ids=tuple(msg.token_ids), new_text=msg.text,
                         finish_reason=_FINISH_FROM_PB.get(msg.finish_reason), usage=usage,
                         logprobs=tuple(token_logprob(lp) for lp in msg.logprobs) or None,
                         prompt_logprobs=prompt, prompt_token_ids=tuple(msg.prompt_token_ids) or None)


def sampling_message(max_tokens: int | None = None, temperature: float = 0.0, top_p: float | None = None,
                     top_k: int = 0, seed: int | None = None, stop: Sequence[str] = (),
                     stop_token_ids: Sequence[int] = (), ignore_eos: bool = False, logprobs: int | None = None,
                     prompt_logprobs: int | None = None, constraint: OutputConstraint | None = None
                     ) -> pb.SamplingParams:
    """Proto sampling from keywords; None leaves an optional field unset (the server's default applies)."""
    msg = pb.SamplingParams(temperature=temperature, top_k=top_k, stop=list(stop),
                            stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos, logprobs=logprobs,
                            prompt_logprobs=prompt_logprobs)
    if max_tokens is not None:
        msg.max_tokens = max_tokens
    if top_p is not None:
        msg.top_p = top_p
    if seed is not None:
        msg.seed = seed
    if constraint is not None:
        msg.constraint.CopyFrom(constraint_message(constraint))
    return msg


def generate_request(prompt: str | Sequence[int], request_id: str = "", **sampling) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=request_id, sampling=sampling_message(**sampling))
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


def _histogram(h: HistogramSnapshot) -> pb.Histogram:
    return pb.Histogram(upper_bounds=h.upper_bounds, bucket_counts=h.bucket_counts, count=h.count, sum=h.sum)


def stats_response(stats: EngineStats, state: str) -> pb.StatsResponse:
    """The Stats answer: the engine's live figures (the same snapshot GET /metrics exports)."""
    return pb.StatsResponse(
        state=state, num_requests_running=stats.num_running, num_requests_waiting=stats.num_waiting,
        num_preemptions=stats.num_preemptions, prompt_tokens=stats.prompt_tokens,
        generation_tokens=stats.generation_tokens, prefix_cache_queries=stats.prefix_cache_queries,
        prefix_cache_hits=stats.prefix_cache_hits, requests_finished=dict(stats.finished),
        cache_groups=[pb.CacheGroupUsage(name=g.name, total_blocks=g.total_blocks, used_blocks=g.used_blocks,
                                         free_blocks=g.free_blocks, usage=g.usage) for g in stats.groups],
        time_to_first_token_seconds=_histogram(stats.time_to_first_token),
        time_per_output_token_seconds=_histogram(stats.time_per_output_token),
        e2e_request_latency_seconds=_histogram(stats.e2e_request_latency),
        spec_verify_rows=stats.spec_rows, spec_draft_tokens=stats.spec_proposed,
        spec_accepted_tokens=stats.spec_accepted, spec_draft_tokens_by_position=stats.spec_proposed_by_position,
        spec_accepted_tokens_by_position=stats.spec_accepted_by_position,
    )
