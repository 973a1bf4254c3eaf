"""Generated gRPC stubs of protos/appliance/v1/appliance.proto (package appliance.v1).

Import them as `from appliance.serve.api import appliance_pb2, appliance_pb2_grpc`. They are committed;
regenerate with `python -m appliance.serve.api.generate` after editing the .proto. This __init__ imports
nothing on purpose, so regeneration works even when the committed stubs are stale or broken.
"""
