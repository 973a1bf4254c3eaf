"""Python and command-line client of the appliance's gRPC API.

    python -m appliance.client "Hello"                     # stream a completion to the terminal
    python -m appliance.client --startup                   # print the startup report
    python -m appliance.client --health                    # print the health status

Exit status: 0 when the request finished (length, stop or eos), 1 on an RPC error or when the server aborted the
request (the streamed text is then incomplete), 2 on bad command-line arguments.

    with ApplianceClient("127.0.0.1:50051") as c:
        for delta in c.generate("Hello", max_tokens=32):   # RequestOutput deltas, last one has finish_reason
            print(delta.new_text, end="")

A blocking (sync) client: one call is one stream, and closing the generate() iterator cancels the call,
which aborts the request in the engine. No torch, no Hydra.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from appliance.core.request import FinishReason, RequestOutput
from appliance.core.secrets import AUTH_TOKEN_ENV
from appliance.core.tables import startup_report_table
from appliance.serve.api import appliance_pb2 as pb
from appliance.serve.api import appliance_pb2_grpc as pb_grpc
from appliance.serve.convert import generate_request, startup_report, to_output

DEFAULT_ADDRESS = "127.0.0.1:50051"


class ApplianceClient:
    """One channel to one server. TLS when root_cert is given (or tls=True for the system roots)."""

    def __init__(self, address: str = DEFAULT_ADDRESS, *, token: str | None = None,
                 root_cert: str | Path | bytes | None = None, tls: bool = False, server_name: str | None = None,
                 max_message_bytes: int = 16 * 1024 * 1024):
        options: list[tuple[str, int | str]] = [("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.max_receive_message_length", max_message_bytes)]
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        if root_cert is not None or tls:
            roots = root_cert if isinstance(root_cert, (bytes, type(None))) else Path(root_cert).read_bytes()
            self.channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(roots), options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        self.address = address
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.stub = pb_grpc.ApplianceStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    def startup(self, timeout: float | None = None) -> pb.StartupResponse:
        """The startup report; waits while the server starts, up to timeout (then DEADLINE_EXCEEDED)."""
        return self.stub.Startup(pb.StartupRequest(), timeout=timeout, metadata=self.metadata)

    def generate(self, prompt: str | Sequence[int], *, request_id: str = "", timeout: float | None = None,
                 **sampling) -> Iterator[RequestOutput]:
        """Stream the deltas of one request. Sampling keywords: max_tokens, temperature, top_p, top_k, seed,
        stop, stop_token_ids, ignore_eos, logprobs, prompt_logprobs, constraint (an OutputConstraint). Closing the
        iterator early cancels the call (the server aborts it)."""
        call = self.stub.Generate(generate_request(prompt, request_id, **sampling), timeout=timeout,
                                  metadata=self.metadata)
        try:
            for msg in call:
                yield to_output(msg)
        finally:
            call.cancel()      # no-op once the stream completed

    def complete(self, prompt: str | Sequence[int], **kw) -> tuple[list[int], str, RequestOutput | None]:
        """Run one request to the end: (token ids, text, last delta; None when the stream sent none)."""
        ids: list[int] = []
        text: list[str] = []
        last = None
        for last in self.generate(prompt, **kw):
            ids.extend(last.new_token_ids)
            text.append(last.new_text)
        return ids, "".join(text), last

    def health(self, service: str = "", timeout: float | None = 5.0) -> str:
        """SERVING | NOT_SERVING | SERVICE_UNKNOWN | UNKNOWN for the overall server ("") or one service."""
        resp = self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_until_serving(self, timeout: float = 60.0, poll_s: float = 0.1) -> None:
        deadline = time.monotonic() + timeout
        last = "unreachable"
        while time.monotonic() < deadline:
            try:
                last = self.health(timeout=max(0.1, min(2.0, deadline - time.monotonic())))
                if last == "SERVING":
                    return
            except grpc.RpcError as exc:
                last = exc.code().name
            time.sleep(poll_s)
        raise TimeoutError(f"{self.address} not SERVING after {timeout} s (last: {last})")

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "ApplianceClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- command line --------------------------------------------------------------------------------------

def startup_text(r: pb.StartupResponse) -> str:
    """The Startup response as the server printed it at startup: the same tables, every number."""
    return startup_report_table(startup_report(r))


def rpc_error_text(exc: grpc.RpcError, address: str) -> str:
    """One line for the terminal; when nothing listens at the address, how to start a server."""
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE and "failed to connect" in details.lower():
        return (f"error: no appliance server answers at {address} ({details}).\n"
                f"Start one in another terminal with `python -m appliance` (the embedded tiny model on "
                f"{DEFAULT_ADDRESS}; `python -m appliance --help` for more), or pass --address HOST:PORT.")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return (f"error: {code.name}: {details}.\n"
                f"Pass the server's token: --token TOKEN, or export {AUTH_TOKEN_ENV}=TOKEN (the variable the server "
                f"reads too).")
    return f"error: {code.name}: {details}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m appliance.client", description=__doc__.split("\n\n")[0])
    p.add_argument("prompt", nargs="?", help="prompt text to complete (streamed to stdout)")
    p.add_argument("--startup", action="store_true", help="print the startup report and exit")
    p.add_argument("--health", action="store_true", help="print the health status and exit")
    p.add_argument("--yaml", action="store_true", help="with --startup: also print the resolved config YAML")
    p.add_argument("--address", default=DEFAULT_ADDRESS, help=f"server address (default {DEFAULT_ADDRESS})")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens to generate (server default 16)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--timeout", type=float, default=None, help="deadline of the call in seconds")
    p.add_argument("--token", default=os.environ.get(AUTH_TOKEN_ENV),
                   help=f"bearer token (default ${AUTH_TOKEN_ENV}, the variable the server reads too)")
    p.add_argument("--tls-root-cert", default=None, help="PEM root certificate: connect with TLS")
    p.add_argument("--tls", action="store_true", help="connect with TLS using the system roots")
    p.add_argument("--tls-server-name", default=None, help="expected name in the server certificate")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not (args.startup or args.health or args.prompt is not None):
        build_parser().error("give a prompt, --startup or --health")
    client = ApplianceClient(args.address, token=args.token, root_cert=args.tls_root_cert, tls=args.tls,
                             server_name=args.tls_server_name)
    try:
        if args.health:
            print(client.health(timeout=args.timeout))
        if args.startup:
            report = client.startup(timeout=args.timeout)
            print(startup_text(report))
            if args.yaml:
                print(report.resolved_config_yaml)
        if args.prompt is not None:
            last = None
            for last in client.generate(args.prompt, timeout=args.timeout, max_tokens=args.max_tokens,
                                        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                        seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos):
                sys.stdout.write(last.new_text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            if last is not None and last.usage is not None:
                u = last.usage
                reason = "unfinished" if last.finish_reason is None else last.finish_reason.value
                print(f"[{reason}: prompt {u.prompt_tokens}, completion {u.completion_tokens}, "
                      f"cached prompt {u.cached_prompt_tokens} tokens]", file=sys.stderr)
            if last is None or last.finish_reason in (None, FinishReason.ABORTED):
                print("error: the server aborted the request before it finished (e.g. it is shutting down); "
                      "the text above is incomplete", file=sys.stderr)
                return 1
    except grpc.RpcError as exc:
        print(rpc_error_text(exc, args.address), file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
