"""The CLI's modes besides serve: validate, plan and bench. Each takes a RuntimeConfig and the job's output
directory (None outside Hydra) and returns the job's result as a dict."""
