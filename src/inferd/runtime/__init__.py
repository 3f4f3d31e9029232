"""The runtime contract every model kind implements, and the registry of served model versions."""
