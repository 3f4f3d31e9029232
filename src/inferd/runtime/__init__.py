"""The runtime contract every model kind implements, the registry of served model versions, the Kind
registry, and the hub where workers join them."""
