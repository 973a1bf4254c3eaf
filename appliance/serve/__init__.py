"""Network front ends (layer 4): the server's lifecycle (server.py) around one engine, its gRPC front end (grpc.py)
and OpenAI-compatible HTTP front end (openai/), what both read (state.py), their ports (ports.py), the proto
conversions, bearer-token auth and the committed API stubs (api/). They drive the engine (layer 3) and read core
types."""
