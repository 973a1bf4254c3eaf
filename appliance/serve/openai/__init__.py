"""The OpenAI-compatible HTTP front end, split by endpoint as vLLM's and SGLang's `entrypoints/openai/` are:
protocol (request bodies), responses (response bodies), errors, serving_completion, serving_chat,
serving_tokenize, serving_models, streaming (the n-choice fan-out and server-sent events) and app (the FastAPI
app, its bearer token, and uvicorn on the server's event loop)."""
