"""Test fixtures kept out of the installed package: scripted devices, tiny checkpoints, KV-cache inspection."""
