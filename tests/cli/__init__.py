"""The `engram` command and its tooling: import/export, the settings and config file, doctor, the
bundled llama-server build."""
