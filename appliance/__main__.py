"""`python -m appliance`: one line at once, then the CLI (appliance.cli).

The line comes before any import beyond the standard library: Hydra, torch and the model take seconds to load,
minutes on a busy host, and a launch must not pass that in silence."""

import sys


def launch_line(argv: list[str]) -> str | None:
    """What a serve or bench launch says first, read from the command line alone (the config is not composed
    yet); None for flags (--help, -m, ...) and for the modes that answer at once."""
    if any(arg.startswith("-") for arg in argv):
        return None
    overrides = dict(arg.lstrip("+~").split("=", 1) for arg in argv if "=" in arg)
    mode = overrides.get("mode", "serve")
    if mode not in ("serve", "bench"):
        return None
    model = overrides.get("model", "the embedded default model")
    device = overrides.get("device", "the default device")
    count = f" x{overrides['device.count']}" if "device.count" in overrides else ""
    return f"starting: {mode} {model} on {device}{count} (loading torch and the model)"


if __name__ == "__main__":
    line = launch_line(sys.argv[1:])
    if line is not None:
        print(line, flush=True)
    from appliance.cli import main

    main()
