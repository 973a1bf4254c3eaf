"""The engine core in its own process (as vLLM's API server / EngineCore): the front ends talk to it over ZMQ.

    client.py        EngineProcessClient: the front ends' EngineClient; starts the core, relays requests
    requests.py      the front end's request table and output processing (text, stop strings, hold-back)
    child.py         the core's process: spawned, its sockets, the receive thread that watches it
    faults.py        an exception in the core as a message, and back
    core_process.py  the core's main: the in-process Engine, driven by the commands it receives, sending CoreOutputs
    messages.py      the msgspec messages between them

server.engine_process=true chooses it (appliance/serve/server.py: serve). Nothing here imports torch on the front
side: only the core process loads the engine and the device plane.
"""
